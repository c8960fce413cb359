"""Alert rules: create, edit, enable/disable, list (the Python API behind ``magpie alerts rules``).

Rule kinds (``threshold`` units in brackets):

* ``usable_routes`` - breach when fewer than ``threshold`` [routes] of the workspace are usable now:
  ``route_health.alive`` and ``last_checked_at`` within the freshness window (``freshness_s`` or
  ``MAGPIE_ALERT_FRESHNESS_SECONDS``). Samples = routes with a fresh check.
* ``success_rate`` - breach when the share of alive checks [percent, 0-100] in the workspace's check
  history of the last ``MAGPIE_ALERT_WINDOW_SECONDS`` (15 minutes) is below ``threshold``. Samples = checks.
* ``latency`` - breach when the ``percentile`` (50 or 95) of the latency [ms] of alive checks in that
  window is above ``threshold``. Samples = alive checks with a latency.

A rule may be scoped to a **rotator** of the workspace (``rotator``): ``usable_routes`` then counts the
routes of the rotator's eligible pool (its filters applied to fresh, alive routes), and ``success_rate``
and ``latency`` read the workspace's check history of the rotator's upstream protocols (its
``protocols`` filter; all when it has none): checker measurements, not client traffic, and not only the
routes that pass its other filters right now.

``protocols`` (subset of :data:`magpie.base.protocols.PROTOCOLS`, ``None`` = all) narrows the routes; with fewer than
``min_samples`` samples the rule's verdict is Unknown. Every change (edit, enable, disable) increments
``revision``, so an evaluation computed against the old revision is discarded (see
:mod:`magpie.alerts.evaluate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.errors import Refusal, RefusedError
from magpie.base.protocols import PROTOCOLS

KINDS = ("usable_routes", "success_rate", "latency")
PERCENTILES = (50, 95)
DEFAULT_MIN_SAMPLES = {"usable_routes": 1, "success_rate": 10, "latency": 10}
_UNSET = object()


def describe_rule(kind: str, threshold: float, percentile: int | None, protocols, rotator: str | None = None) -> str:
    """One-line description of a rule's breach condition, e.g. ``success rate < 90% (http,socks5)``."""
    scope = f" ({','.join(protocols)})" if protocols else ""
    if rotator:
        scope += f" [rotator {rotator}]"
    t = f"{threshold:g}"
    if kind == "usable_routes":
        return f"usable routes < {t}{scope}"
    if kind == "success_rate":
        return f"success rate < {t}%{scope}"
    return f"p{percentile} latency > {t} ms{scope}"


class RuleConflict(RefusedError, RuntimeError):
    """An edit named an ``expected_revision`` that is no longer the rule's revision: a refusal
    (``revision_changed``, exit status 3); nothing changed. ``detail``: which revision the rule is at."""

    def __init__(self, detail: str):
        super().__init__(Refusal.REVISION_CHANGED, detail=detail)


@dataclass(frozen=True, slots=True)
class Rule:
    """One alert rule with its current evaluation status.

    ``status`` is ``ok`` or ``open`` (an incident is open); ``last_outcome`` is ``breach``, ``healthy``,
    ``unknown`` or ``None`` (never evaluated); ``last_value`` is in the kind's threshold unit.
    """

    id: int
    workspace_id: int
    workspace: str
    name: str
    kind: str
    threshold: float
    percentile: int | None
    protocols: list[str] | None
    min_samples: int
    freshness_s: int | None
    enabled: bool
    revision: int
    created_at: datetime
    updated_at: datetime
    status: str = "ok"
    last_outcome: str | None = None
    last_value: float | None = None
    last_reason: str | None = None
    last_evaluated_at: datetime | None = None
    rotator: str | None = None

    def describe(self) -> str:
        """One-line human description, e.g. ``p95 latency > 800 ms (socks5)``."""
        return describe_rule(self.kind, self.threshold, self.percentile, self.protocols, self.rotator)

    def as_json(self) -> dict:
        """All fields plus ``description`` as a JSON-ready dict (datetimes left to the encoder)."""
        d = {f: getattr(self, f) for f in self.__slots__}
        d["description"] = self.describe()
        return d


_SELECT = """
    SELECT r.id, r.workspace_id, w.name AS workspace, r.name, r.kind, r.threshold, r.percentile, r.protocols,
           r.min_samples, r.freshness_s, r.enabled, r.revision, r.created_at, r.updated_at,
           COALESCE(s.status, 'ok') AS status, s.last_outcome, s.last_value, s.last_reason, s.last_evaluated_at,
           ro.name AS rotator
    FROM alert_rules r JOIN workspaces w ON w.id = r.workspace_id
    LEFT JOIN alert_rule_state s ON s.rule_id = r.id
    LEFT JOIN rotators ro ON ro.id = r.rotator_id
"""


def _rule(row) -> Rule:
    d = dict(row)
    d["protocols"] = list(d["protocols"]) if d["protocols"] is not None else None
    return Rule(**d)


def workspace_id(conn: sa.Connection, workspace: int | str) -> int:
    """Id of ``workspace`` given as id (int) or name (str); ``LookupError`` if it does not exist."""
    col = "id" if isinstance(workspace, int) else "name"
    row = conn.execute(sa.text(f"SELECT id FROM workspaces WHERE {col} = :w"), {"w": workspace}).first()
    if row is None:
        raise LookupError(f"no such workspace: {workspace!r}")
    return int(row[0])


def _validate(kind: str, threshold: float, percentile, protocols, min_samples, freshness_s):
    if kind not in KINDS:
        raise ValueError(f"rule kind must be one of {KINDS}, got {kind!r}")
    threshold = float(threshold)
    if threshold != threshold or threshold < 0:
        raise ValueError("threshold must be a number >= 0")
    if kind == "success_rate" and threshold > 100:
        raise ValueError("a success-rate threshold is a percentage (0-100)")
    if kind == "latency":
        percentile = 95 if percentile is None else int(percentile)
        if percentile not in PERCENTILES:
            raise ValueError(f"percentile must be one of {PERCENTILES}")
    elif percentile is not None:
        raise ValueError("percentile applies to latency rules only")
    if protocols is not None:
        protocols = sorted({p.strip().lower() for p in protocols if p.strip()})
        bad = [p for p in protocols if p not in PROTOCOLS]
        if bad:
            raise ValueError(f"unknown protocol(s) {bad}; use {PROTOCOLS}")
        protocols = protocols or None
    if min_samples is not None and int(min_samples) < 1:
        raise ValueError("min_samples must be >= 1")
    if freshness_s is not None:
        if kind != "usable_routes":
            raise ValueError("freshness_s applies to usable_routes rules only")
        if int(freshness_s) <= 0:
            raise ValueError("freshness_s must be > 0")
        freshness_s = int(freshness_s)
    return threshold, percentile, protocols, freshness_s


def create_rule(
    engine: Engine,
    workspace: int | str,
    name: str,
    kind: str,
    threshold: float,
    *,
    percentile: int | None = None,
    protocols: list[str] | None = None,
    min_samples: int | None = None,
    freshness_s: int | None = None,
    enabled: bool = True,
    rotator: str | None = None,
) -> Rule:
    """Create a rule (revision 1) and its evaluation state, in one transaction.

    Args:
        engine: PostgreSQL engine.
        workspace: workspace id or name.
        name: unique within the workspace.
        kind / threshold / percentile / protocols / freshness_s: see the module docstring; ``percentile``
            defaults to 95 for latency rules.
        min_samples: fewest samples for a verdict (default 1 for usable_routes, 10 otherwise).
        enabled: evaluate it from the next minute.
        rotator: scope the rule to this rotator of the workspace (module doc).
    Returns:
        The new :class:`Rule`.
    Raises:
        ValueError: invalid arguments or a duplicate name. LookupError: unknown workspace.
    """
    threshold, percentile, protocols, freshness_s = _validate(kind, threshold, percentile, protocols,
                                                              min_samples, freshness_s)
    if not name or not name.strip():
        raise ValueError("rule name must not be empty")
    with engine.begin() as conn:
        ws = workspace_id(conn, workspace)
        rotator_id = None
        if rotator is not None:
            rotator_id = conn.execute(sa.text("SELECT id FROM rotators WHERE name = :n AND workspace_id = :w"),
                                      {"n": rotator, "w": ws}).scalar()
            if rotator_id is None:
                raise LookupError(f"no rotator {rotator!r} in workspace {workspace!r}")
        try:
            with conn.begin_nested():
                rid = conn.execute(
                    sa.text(
                        """
                        INSERT INTO alert_rules (workspace_id, name, kind, threshold, percentile, protocols,
                                                 min_samples, freshness_s, enabled, rotator_id)
                        VALUES (:w, :n, :k, :t, :p, :pr, :m, :f, :e, :ro) RETURNING id
                        """
                    ),
                    {"w": ws, "n": name.strip(), "k": kind, "t": threshold, "p": percentile, "pr": protocols,
                     "m": int(min_samples or DEFAULT_MIN_SAMPLES[kind]), "f": freshness_s, "e": bool(enabled), "ro": rotator_id},
                ).scalar_one()
        except sa.exc.IntegrityError:
            raise ValueError(f"workspace {workspace!r} already has a rule named {name!r}") from None
        conn.execute(sa.text("INSERT INTO alert_rule_state (rule_id, rule_revision) VALUES (:r, 1)"), {"r": rid})
        return _rule(conn.execute(sa.text(_SELECT + " WHERE r.id = :id"), {"id": rid}).mappings().one())


def get_rule(engine: Engine, rule_id: int) -> Rule:
    """The rule ``rule_id``; ``LookupError`` if it does not exist."""
    with engine.connect() as conn:
        row = conn.execute(sa.text(_SELECT + " WHERE r.id = :id"), {"id": int(rule_id)}).mappings().first()
    if row is None:
        raise LookupError(f"no such rule: {rule_id}")
    return _rule(row)


def list_rules(engine: Engine, workspace: int | str | None = None) -> list[Rule]:
    """Rules ordered by workspace and id, of one workspace (id or name) or of all."""
    with engine.connect() as conn:
        if workspace is None:
            rows = conn.execute(sa.text(_SELECT + " ORDER BY r.workspace_id, r.id"))
        else:
            ws = workspace_id(conn, workspace)
            rows = conn.execute(sa.text(_SELECT + " WHERE r.workspace_id = :w ORDER BY r.id"), {"w": ws})
        return [_rule(r) for r in rows.mappings()]


def edit_rule(
    engine: Engine,
    rule_id: int,
    *,
    name: str | None = None,
    threshold: float | None = None,
    percentile=_UNSET,
    protocols=_UNSET,
    min_samples: int | None = None,
    freshness_s=_UNSET,
    enabled: bool | None = None,
    expected_revision: int | None = None,
) -> Rule:
    """Change a rule; arguments left out keep their value. Increments ``revision``.

    Pass ``protocols=None`` / ``freshness_s=None`` to clear them. With ``expected_revision``, the edit
    applies only if the rule is still at that revision (optimistic concurrency for editors).

    Returns the updated :class:`Rule`.
    Raises:
        LookupError: no such rule. RuleConflict: ``expected_revision`` is stale. ValueError: invalid values
        or a duplicate name.
    """
    with engine.begin() as conn:
        cur = conn.execute(
            sa.text("SELECT * FROM alert_rules WHERE id = :id FOR UPDATE"), {"id": int(rule_id)}
        ).mappings().first()
        if cur is None:
            raise LookupError(f"no such rule: {rule_id}")
        if expected_revision is not None and cur["revision"] != expected_revision:
            raise RuleConflict(f"rule {rule_id} is at revision {cur['revision']}, not {expected_revision}")
        new = {
            "name": (name.strip() if name is not None else cur["name"]),
            "threshold": cur["threshold"] if threshold is None else threshold,
            "percentile": cur["percentile"] if percentile is _UNSET else percentile,
            "protocols": cur["protocols"] if protocols is _UNSET else protocols,
            "min_samples": cur["min_samples"] if min_samples is None else int(min_samples),
            "freshness_s": cur["freshness_s"] if freshness_s is _UNSET else freshness_s,
            "enabled": cur["enabled"] if enabled is None else bool(enabled),
        }
        if not new["name"]:
            raise ValueError("rule name must not be empty")
        t, p, pr, f = _validate(cur["kind"], new["threshold"], new["percentile"], new["protocols"],
                                new["min_samples"], new["freshness_s"])
        try:
            with conn.begin_nested():
                conn.execute(
                    sa.text(
                        """
                        UPDATE alert_rules SET name = :n, threshold = :t, percentile = :p, protocols = :pr,
                            min_samples = :m, freshness_s = :f, enabled = :e, revision = revision + 1,
                            updated_at = now()
                        WHERE id = :id
                        """
                    ),
                    {"id": int(rule_id), "n": new["name"], "t": t, "p": p, "pr": pr, "m": new["min_samples"],
                     "f": f, "e": new["enabled"]},
                )
        except sa.exc.IntegrityError:
            raise ValueError(f"the workspace already has a rule named {new['name']!r}") from None
        return _rule(conn.execute(sa.text(_SELECT + " WHERE r.id = :id"), {"id": int(rule_id)}).mappings().one())


def set_enabled(engine: Engine, rule_id: int, enabled: bool) -> Rule:
    """Enable or disable a rule (a new revision). A disabled rule is not evaluated; an incident it has
    open stays open until the rule, enabled again, sees two healthy minutes."""
    return edit_rule(engine, rule_id, enabled=enabled)


def delete_rule(engine: Engine, rule_id: int) -> bool:
    """Delete a rule with its state, incidents and their pending deliveries. True if it existed."""
    with engine.begin() as conn:
        return conn.execute(sa.text("DELETE FROM alert_rules WHERE id = :id"), {"id": int(rule_id)}).rowcount == 1
