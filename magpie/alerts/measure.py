"""Alert measurement (phase 1 of an evaluation): what the checks already recorded, one verdict per rule.

:func:`measure_workspace` takes no locks and runs few queries for all of a workspace's enabled rules: one
for the rules, one over ``route_health`` for every usable-routes rule, one over the 15-minute window of
``check_history`` for every success-rate and latency rule (one ``FILTER`` column per distinct protocol
scope, :data:`SCOPE_CHUNK` scopes per query). Each rule gets a :class:`Measurement`: ``breach``,
``healthy`` or ``unknown`` (no data, fewer than ``min_samples`` samples, or the query failed - e.g.
``MAGPIE_ALERT_QUERY_TIMEOUT_MS`` hit). The result, a :class:`WorkspaceSnapshot`, also carries each
rule's ``revision`` and state ``generation`` so that :func:`magpie.alerts.evaluate.apply_workspace` can
skip rules that changed in between.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.alerts.streaks import Measurement
from magpie.rotator.pool import filter_sql

log = logging.getLogger(__name__)

SCOPE_CHUNK = 16
"""Distinct protocol scopes measured per query."""


@dataclass(frozen=True, slots=True)
class RuleSnapshot:
    """A rule as read in phase 1, with the ``revision`` and state ``generation`` phase 2 must still find."""

    id: int
    workspace_id: int
    name: str
    kind: str
    threshold: float
    percentile: int | None
    protocols: tuple[str, ...] | None
    min_samples: int
    freshness_s: int | None
    revision: int
    generation: int
    rotator_filters: str | None = None
    """Canonical JSON of the rotator's filters for a rotator-scoped rule (None: workspace-wide)."""

    def history_protocols(self) -> tuple[str, ...] | None:
        """Protocols whose check history the rule reads: its own, else its rotator's upstream protocols."""
        if self.protocols or not self.rotator_filters:
            return self.protocols
        protos = json.loads(self.rotator_filters).get("protocols")
        return tuple(sorted(protos)) if protos else None


@dataclass(slots=True)
class WorkspaceSnapshot:
    """Phase-1 result for one workspace: its enabled rules and one :class:`Measurement` per rule id."""

    workspace_id: int
    workspace: str
    now: datetime
    rules: list[RuleSnapshot]
    measurements: dict[int, Measurement]


def evaluation_time(now: datetime | None) -> datetime:
    """``now``, or the current UTC time when it is ``None``; raises ValueError for a naive datetime."""
    if now is None:
        return datetime.now(UTC)
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    return now


def _scope_sql(protocols, key: str, params: dict) -> str:
    if not protocols:
        return "TRUE"
    params[key] = list(protocols)
    return f"r.protocol = ANY(:{key})"


def _chunks(seq: list, n: int):
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def _timeout(conn: sa.Connection, ms: int) -> None:
    conn.execute(sa.text("SELECT set_config('statement_timeout', :v, true)"), {"v": str(int(ms))})


def _measure_usable(engine, ws_id, rules, now, settings) -> dict[int, Measurement]:
    scopes = sorted({(r.protocols, r.freshness_s or settings.alert_freshness_seconds, r.rotator_filters)
                     for r in rules}, key=repr)
    found: dict[tuple, tuple[int, int]] = {}
    for chunk in _chunks(scopes, SCOPE_CHUNK):
        params: dict = {"w": ws_id, "now": now}
        cols = []
        for i, (protos, fresh, pool_filters) in enumerate(chunk):
            scope = _scope_sql(protos, f"p{i}", params)
            if pool_filters:
                extra, fparams = filter_sql(json.loads(pool_filters), key=f"f{i}_")
                scope += extra
                params.update(fparams)
            params[f"cut{i}"] = now - timedelta(seconds=fresh)
            fresh_sql = f"{scope} AND h.last_checked_at > :cut{i} AND h.last_checked_at <= :now"
            cols.append(f"count(*) FILTER (WHERE {fresh_sql}) AS c{i}, "
                        f"count(*) FILTER (WHERE {fresh_sql} AND h.alive) AS u{i}")
        sql = (f"SELECT {', '.join(cols)} FROM route_workspaces rw JOIN routes r ON r.id = rw.route_id "
               "JOIN route_health h ON h.route_id = rw.route_id WHERE rw.workspace_id = :w")
        with engine.begin() as conn:
            _timeout(conn, settings.alert_query_timeout_ms)
            row = conn.execute(sa.text(sql), params).one()
        for i, sc in enumerate(chunk):
            found[sc] = (int(row[2 * i]), int(row[2 * i + 1]))
    out = {}
    for r in rules:
        checked, usable = found[(r.protocols, r.freshness_s or settings.alert_freshness_seconds, r.rotator_filters)]
        if checked < r.min_samples:
            out[r.id] = Measurement("unknown", float(usable) if checked else None, checked,
                                    f"{checked} freshly checked routes < min_samples {r.min_samples}")
        else:
            out[r.id] = Measurement("breach" if usable < r.threshold else "healthy", float(usable), checked)
    return out


def _measure_history(engine, ws_id, rules, now, settings) -> dict[int, Measurement]:
    scopes = sorted({r.history_protocols() for r in rules}, key=repr)
    found: dict = {}
    since = now - timedelta(seconds=settings.alert_window_seconds)
    for chunk in _chunks(scopes, SCOPE_CHUNK):
        params: dict = {"w": ws_id, "now": now, "since": since}
        cols = []
        for i, protos in enumerate(chunk):
            s = _scope_sql(protos, f"p{i}", params)
            lat = f"{s} AND h.alive AND h.latency_ms IS NOT NULL"
            cols.append(
                f"count(*) FILTER (WHERE {s}), count(*) FILTER (WHERE {s} AND h.alive), "
                f"count(*) FILTER (WHERE {lat}), "
                f"percentile_cont(0.5) WITHIN GROUP (ORDER BY h.latency_ms) FILTER (WHERE {lat}), "
                f"percentile_cont(0.95) WITHIN GROUP (ORDER BY h.latency_ms) FILTER (WHERE {lat})"
            )
        sql = (f"SELECT {', '.join(cols)} FROM check_history h "
               "JOIN route_workspaces rw ON rw.route_id = h.route_id AND rw.workspace_id = :w "
               "JOIN routes r ON r.id = h.route_id "
               "WHERE h.checked_at > :since AND h.checked_at <= :now")
        with engine.begin() as conn:
            _timeout(conn, settings.alert_query_timeout_ms)
            row = conn.execute(sa.text(sql), params).one()
        for i, sc in enumerate(chunk):
            n, alive, nlat, p50, p95 = row[5 * i : 5 * i + 5]
            found[sc] = (int(n), int(alive), int(nlat), p50, p95)
    out = {}
    for r in rules:
        n, alive, nlat, p50, p95 = found[r.history_protocols()]
        if r.kind == "success_rate":
            rate = 100.0 * alive / n if n else None
            if n < r.min_samples:
                out[r.id] = Measurement("unknown", rate, n, f"{n} checks in the window < min_samples {r.min_samples}")
            else:
                out[r.id] = Measurement("breach" if rate < r.threshold else "healthy", rate, n)
        else:
            p = p50 if r.percentile == 50 else p95
            p = float(p) if p is not None else None
            if nlat < r.min_samples or p is None:
                out[r.id] = Measurement("unknown", p, nlat,
                                        f"{nlat} alive checks with a latency < min_samples {r.min_samples}")
            else:
                out[r.id] = Measurement("breach" if p > r.threshold else "healthy", p, nlat)
    return out


_RULES_SQL = """
    SELECT r.id, r.workspace_id, w.name AS workspace, r.name, r.kind, r.threshold, r.percentile, r.protocols,
           r.min_samples, r.freshness_s, r.revision, s.generation, r.rotator_id, ro.filters AS rotator_filters
    FROM alert_rules r
    JOIN alert_rule_state s ON s.rule_id = r.id
    JOIN workspaces w ON w.id = r.workspace_id
    LEFT JOIN rotators ro ON ro.id = r.rotator_id
    WHERE r.workspace_id = :w AND r.enabled
    ORDER BY r.id
"""


def measure_workspace(engine: Engine, workspace_id: int, settings, *,
                      now: datetime | None = None) -> WorkspaceSnapshot:
    """Phase 1: read the enabled rules of ``workspace_id`` and measure them at ``now`` (no locks).

    Args:
        engine: PostgreSQL engine.
        workspace_id: ``workspaces.id``.
        settings: :class:`magpie.config.Settings` (``alert_window_seconds``, ``alert_freshness_seconds``,
            ``alert_query_timeout_ms``).
        now: evaluation time (timezone-aware; default: the current UTC time). Data after ``now`` is ignored.
    Returns:
        A :class:`WorkspaceSnapshot`. A failed measurement query makes the rules it serves ``unknown``
        (reason ``measurement error: ...``); it is not raised.
    Raises:
        sqlalchemy.exc.SQLAlchemyError: reading the rules themselves failed.
    """
    now = evaluation_time(now)
    with engine.connect() as conn:
        rows = conn.execute(sa.text(_RULES_SQL), {"w": int(workspace_id)}).mappings().all()
    rules = [
        RuleSnapshot(r["id"], r["workspace_id"], r["name"], r["kind"], float(r["threshold"]), r["percentile"],
                     tuple(r["protocols"]) if r["protocols"] else None, r["min_samples"], r["freshness_s"],
                     r["revision"], r["generation"],
                     json.dumps(r["rotator_filters"] or {}, sort_keys=True) if r["rotator_id"] else None)
        for r in rows
    ]
    ws_name = rows[0]["workspace"] if rows else ""
    measurements: dict[int, Measurement] = {}
    groups = {
        "usable": ([r for r in rules if r.kind == "usable_routes"], _measure_usable),
        "history": ([r for r in rules if r.kind != "usable_routes"], _measure_history),
    }
    for label, (group, fn) in groups.items():
        if not group:
            continue
        try:
            measurements.update(fn(engine, workspace_id, group, now, settings))
        except sa.exc.DBAPIError as exc:
            reason = f"measurement error ({label}): {str(getattr(exc, 'orig', exc)).strip()[:300]}"
            log.warning("alerts: workspace %s: %s", workspace_id, reason)
            for r in group:
                measurements[r.id] = Measurement("unknown", None, 0, reason)
    return WorkspaceSnapshot(int(workspace_id), ws_name, now, rules, measurements)
