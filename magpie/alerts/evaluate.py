"""Alert evaluation: read what the checks already recorded, count breached/healthy minutes, open/recover.

Evaluation never runs a check and never touches the Redis schedule. Once a minute (beat task
``magpie.alerts.evaluate``, under the Redis leader lock ``<prefix>leader:alerts``) each workspace with
enabled rules is handled in two phases:

1. :func:`measure_workspace` - no locks, few queries for all of the workspace's enabled rules: one for the
   rules, one over ``route_health`` for every usable-routes rule, one over the 15-minute window of
   ``check_history`` for every success-rate and latency rule (one ``FILTER`` column per distinct protocol
   scope). Each rule gets a :class:`Measurement`: ``breach``, ``healthy`` or ``unknown`` (no data, fewer
   than ``min_samples`` samples, or the query failed - e.g. ``MAGPIE_ALERT_QUERY_TIMEOUT_MS`` hit).
2. :func:`apply_workspace` - one transaction: lock the rules and their state rows, drop every rule whose
   ``revision`` or state ``generation`` changed since phase 1 (edited, disabled, or evaluated by someone
   else: *stale*), then update the streaks, open/recover incidents, queue webhook deliveries and alert
   emails, and bump ``generation``. Rule state, incident transitions and delivery rows commit together.

Streaks count *evaluation minutes* (Unix time // 60; a second evaluation in an already counted minute
changes nothing). A ``breach`` minute extends the breach streak and ends the healthy one, and vice versa;
an ``unknown`` minute ends both, so Unknown can neither open nor recover an incident; a gap of more than
one missed minute restarts the streaks; a rule edit (new revision) restarts them too. An incident opens at
``MAGPIE_ALERT_OPEN_MINUTES`` (2) consecutive breached minutes and recovers at
``MAGPIE_ALERT_RECOVER_MINUTES`` (2) consecutive healthy ones; it stays open through Unknown minutes.

Every function takes ``now`` (timezone-aware :class:`datetime`) so tests can drive time.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.alerts.rules import describe_rule
from magpie.alerts.webhook import encode_payload
from magpie.outbox.service import enqueue, message_domain

log = logging.getLogger(__name__)

MAX_GAP_MINUTES = 2
"""A streak survives one missed evaluation minute; a longer gap restarts it."""
SCOPE_CHUNK = 16
"""Distinct protocol scopes measured per query."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """Verdict of one rule for one minute.

    Attributes:
        outcome: ``breach``, ``healthy`` or ``unknown``.
        value: the measured figure in the rule's unit (routes, percent, ms) or ``None``.
        samples: observations behind it (fresh routes, checks, or alive checks with a latency).
        reason: why the outcome is ``unknown`` (``None`` otherwise).
    """

    outcome: str
    value: float | None
    samples: int
    reason: str | None = None


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


@dataclass(slots=True)
class WorkspaceSnapshot:
    """Phase-1 result for one workspace: its enabled rules and one :class:`Measurement` per rule id."""

    workspace_id: int
    workspace: str
    now: datetime
    rules: list[RuleSnapshot]
    measurements: dict[int, Measurement]


@dataclass(frozen=True, slots=True)
class Transition:
    """An incident transition committed by phase 2: ``event`` is ``incident.opened`` or
    ``incident.recovered``; ``deliveries`` / ``emails`` are the webhook and email rows queued for it."""

    rule_id: int
    incident_id: int
    event: str
    value: float | None
    deliveries: int
    emails: int


@dataclass(slots=True)
class EvaluationReport:
    """Totals of one evaluation pass. ``stale`` counts rules skipped because they changed between the
    phases; ``errors`` counts workspaces whose evaluation failed (logged, retried next minute)."""

    now: datetime
    workspaces: int = 0
    rules: int = 0
    applied: int = 0
    stale: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: {"breach": 0, "healthy": 0, "unknown": 0})
    transitions: list[Transition] = field(default_factory=list)
    errors: int = 0

    def add(self, other: "EvaluationReport") -> None:
        """Add ``other``'s counts and transitions to this report."""
        self.workspaces += other.workspaces
        self.rules += other.rules
        self.applied += other.applied
        self.stale += other.stale
        for k, v in other.outcomes.items():
            self.outcomes[k] = self.outcomes.get(k, 0) + v
        self.transitions.extend(other.transitions)
        self.errors += other.errors

    def as_json(self) -> dict:
        """The report as a JSON-ready dict (the Celery task's return value)."""
        return {"now": self.now.isoformat(), "workspaces": self.workspaces, "rules": self.rules,
                "applied": self.applied, "stale": self.stale, "outcomes": dict(self.outcomes),
                "errors": self.errors,
                "transitions": [{"rule_id": t.rule_id, "incident_id": t.incident_id, "event": t.event,
                                 "value": t.value, "deliveries": t.deliveries, "emails": t.emails}
                                for t in self.transitions]}


def _now(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    return now


def epoch_minute(now: datetime) -> int:
    """Unix minute of ``now`` (seconds since the epoch // 60)."""
    return int(now.timestamp()) // 60


# ------------------------------------------------------------------------------------------ phase 1


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
    scopes = sorted({(r.protocols, r.freshness_s or settings.alert_freshness_seconds) for r in rules},
                    key=repr)
    found: dict[tuple, tuple[int, int]] = {}
    for chunk in _chunks(scopes, SCOPE_CHUNK):
        params: dict = {"w": ws_id, "now": now}
        cols = []
        for i, (protos, fresh) in enumerate(chunk):
            scope = _scope_sql(protos, f"p{i}", params)
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
        checked, usable = found[(r.protocols, r.freshness_s or settings.alert_freshness_seconds)]
        if checked < r.min_samples:
            out[r.id] = Measurement("unknown", float(usable) if checked else None, checked,
                                    f"{checked} freshly checked routes < min_samples {r.min_samples}")
        else:
            out[r.id] = Measurement("breach" if usable < r.threshold else "healthy", float(usable), checked)
    return out


def _measure_history(engine, ws_id, rules, now, settings) -> dict[int, Measurement]:
    scopes = sorted({r.protocols for r in rules}, key=repr)
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
        n, alive, nlat, p50, p95 = found[r.protocols]
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
           r.min_samples, r.freshness_s, r.revision, s.generation
    FROM alert_rules r
    JOIN alert_rule_state s ON s.rule_id = r.id
    JOIN workspaces w ON w.id = r.workspace_id
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
    now = _now(now)
    with engine.connect() as conn:
        rows = conn.execute(sa.text(_RULES_SQL), {"w": int(workspace_id)}).mappings().all()
    rules = [
        RuleSnapshot(r["id"], r["workspace_id"], r["name"], r["kind"], float(r["threshold"]), r["percentile"],
                     tuple(r["protocols"]) if r["protocols"] else None, r["min_samples"], r["freshness_s"],
                     r["revision"], r["generation"])
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


# ------------------------------------------------------------------------------------------ phase 2


_LOCK_SQL = """
    SELECT r.id, r.revision, r.enabled, s.generation, s.rule_revision, s.status, s.breach_minutes,
           s.healthy_minutes, s.last_minute, s.open_incident_id
    FROM alert_rules r JOIN alert_rule_state s ON s.rule_id = r.id
    WHERE r.id = ANY(:ids)
    ORDER BY r.id
    FOR UPDATE OF r, s
"""

_UPDATE_STATE_SQL = """
    UPDATE alert_rule_state SET generation = generation + 1, rule_revision = :rev, status = :status,
        breach_minutes = :b, healthy_minutes = :h, last_minute = :lm, last_outcome = :o, last_value = :v,
        last_samples = :n, last_reason = :why, last_evaluated_at = :now, open_incident_id = :inc, updated_at = :now
    WHERE rule_id = :id AND generation = :gen
"""


def _payload(delivery_id, event, snap: WorkspaceSnapshot, rule: RuleSnapshot, incident: dict, m: Measurement) -> dict:
    return {
        "delivery_id": delivery_id,
        "event": event,
        "occurred_at": snap.now.isoformat(),
        "workspace": {"id": snap.workspace_id, "name": snap.workspace},
        "rule": {"id": rule.id, "name": rule.name, "kind": rule.kind, "threshold": rule.threshold,
                 "percentile": rule.percentile, "protocols": list(rule.protocols) if rule.protocols else None,
                 "revision": rule.revision,
                 "description": describe_rule(rule.kind, rule.threshold, rule.percentile, rule.protocols)},
        "incident": incident,
        "measurement": {"value": m.value, "samples": m.samples},
    }


def _email(event: str, snap: WorkspaceSnapshot, rule: RuleSnapshot, incident: dict,
           m: Measurement) -> tuple[str, str]:
    word = "OPEN" if event == "incident.opened" else "RECOVERED"
    desc = describe_rule(rule.kind, rule.threshold, rule.percentile, rule.protocols)
    subject = f"[magpie] {word}: {rule.name} ({snap.workspace})"
    value = "n/a" if m.value is None else f"{m.value:.6g}"
    body = (
        f"Alert rule '{rule.name}' in workspace '{snap.workspace}' is {word.lower()}.\n\n"
        f"Condition: {desc}\n"
        f"Observed: {value} over {m.samples} samples at {snap.now:%Y-%m-%d %H:%M:%S %Z}\n"
        f"Incident: #{incident['id']} opened at {incident['opened_at']}"
        + (f", recovered at {incident['recovered_at']}" if incident.get("recovered_at") else "")
        + "\n"
    )
    return subject, body


def _queue_notifications(conn, settings, channels, event, snap, rule, incident, m) -> tuple[int, int]:
    hooks = mails = 0
    for ch in channels:
        if ch["kind"] == "webhook":
            did = str(uuid.uuid4())
            body = encode_payload(_payload(did, event, snap, rule, incident, m))
            hooks += conn.execute(
                sa.text(
                    """
                    INSERT INTO alert_deliveries (delivery_id, incident_id, channel_id, event, payload, max_attempts,
                                                  next_attempt_at, created_at, updated_at)
                    VALUES (:d, :i, :c, :e, :p, :n, :now, :now, :now)
                    ON CONFLICT (incident_id, channel_id, event) DO NOTHING
                    """
                ),
                {"d": did, "i": incident["id"], "c": ch["id"], "e": event, "p": body,
                 "n": settings.webhook_max_attempts, "now": snap.now},
            ).rowcount
        else:
            subject, body = _email(event, snap, rule, incident, m)
            got = enqueue(conn, ch["target"], subject, body, kind="alert", max_attempts=settings.email_max_attempts,
                          dedupe_key=f"alert:{incident['id']}:{event}:{ch['id']}", now=snap.now,
                          domain=message_domain(settings))
            mails += got is not None
    return hooks, mails


def apply_workspace(engine: Engine, snap: WorkspaceSnapshot, settings) -> EvaluationReport:
    """Phase 2: apply a :class:`WorkspaceSnapshot` in one transaction, skipping stale rules.

    A rule is stale (skipped, nothing written for it) when it was deleted, disabled or edited (its
    ``revision`` changed) or its state was written by another evaluation (its ``generation`` changed)
    after ``snap`` was measured.

    Returns an :class:`EvaluationReport` for the workspace (``applied``, ``stale``, ``transitions``).
    Raises ``sqlalchemy.exc.SQLAlchemyError`` on a database failure (nothing of the workspace is written).
    """
    report = EvaluationReport(snap.now, workspaces=1, rules=len(snap.rules))
    if not snap.rules:
        return report
    minute = epoch_minute(snap.now)
    with engine.begin() as conn:
        cur = {r["id"]: r for r in conn.execute(sa.text(_LOCK_SQL), {"ids": [r.id for r in snap.rules]}).mappings()}
        channels = None
        for rule in snap.rules:
            c = cur.get(rule.id)
            if c is None or not c["enabled"] or c["revision"] != rule.revision or c["generation"] != rule.generation:
                report.stale += 1
                continue
            m = snap.measurements[rule.id]
            report.outcomes[m.outcome] += 1
            if c["rule_revision"] != rule.revision:  # edited since the streaks began
                breach, healthy, last_minute = 0, 0, None
            else:
                breach, healthy, last_minute = c["breach_minutes"], c["healthy_minutes"], c["last_minute"]
            if last_minute is None or minute > last_minute:
                if last_minute is None or minute - last_minute > MAX_GAP_MINUTES:
                    breach = healthy = 0
                if m.outcome == "breach":
                    breach, healthy = breach + 1, 0
                elif m.outcome == "healthy":
                    breach, healthy = 0, healthy + 1
                else:
                    breach = healthy = 0
                last_minute = minute
            status, incident_id = c["status"], c["open_incident_id"]
            event = incident = None
            if status == "ok" and breach >= settings.alert_open_minutes:
                incident_id = conn.execute(
                    sa.text(
                        """
                        INSERT INTO alert_incidents
                            (rule_id, workspace_id, rule_revision, status, opened_at, open_value)
                        VALUES (:r, :w, :rev, 'open', :now, :v) RETURNING id
                        """
                    ),
                    {"r": rule.id, "w": snap.workspace_id, "rev": rule.revision, "now": snap.now, "v": m.value},
                ).scalar_one()
                status, event = "open", "incident.opened"
                incident = {"id": incident_id, "status": "open", "opened_at": snap.now.isoformat(),
                            "recovered_at": None}
            elif status == "open" and healthy >= settings.alert_recover_minutes:
                row = conn.execute(
                    sa.text(
                        """
                        UPDATE alert_incidents SET status = 'recovered', recovered_at = :now, recover_value = :v
                        WHERE id = :i AND status = 'open' RETURNING id, opened_at
                        """
                    ),
                    {"i": incident_id, "now": snap.now, "v": m.value},
                ).first()
                status, event = "ok", "incident.recovered"
                if row is not None:
                    incident = {"id": row[0], "status": "recovered", "opened_at": row[1].isoformat(),
                                "recovered_at": snap.now.isoformat()}
                incident_id = None
            n = conn.execute(
                sa.text(_UPDATE_STATE_SQL),
                {"id": rule.id, "gen": rule.generation, "rev": rule.revision, "status": status, "b": breach,
                 "h": healthy, "lm": last_minute, "o": m.outcome, "v": m.value, "n": m.samples, "why": m.reason,
                 "now": snap.now, "inc": incident_id},
            ).rowcount
            if n != 1:  # cannot happen under the row lock; refuse to commit a half-applied workspace
                raise RuntimeError(f"alert rule {rule.id}: state generation moved under a held lock")
            report.applied += 1
            if incident is not None:
                if channels is None:
                    channels = conn.execute(
                        sa.text("SELECT id, kind, target FROM alert_channels WHERE workspace_id = :w AND enabled "
                                "ORDER BY id"), {"w": snap.workspace_id}).mappings().all()
                hooks, mails = _queue_notifications(conn, settings, channels, event, snap, rule, incident, m)
                report.transitions.append(Transition(rule.id, incident["id"], event, m.value, hooks, mails))
    for t in report.transitions:
        log.info("alerts: rule %s %s (incident %s, value %s)", t.rule_id, t.event, t.incident_id, t.value)
    return report


# ------------------------------------------------------------------------------------------ passes


def evaluate_workspace(engine: Engine, workspace_id: int, settings, *,
                       now: datetime | None = None) -> EvaluationReport:
    """Measure then apply one workspace at ``now`` (see :func:`measure_workspace`, :func:`apply_workspace`)."""
    return apply_workspace(engine, measure_workspace(engine, workspace_id, settings, now=now), settings)


def evaluate_all(engine: Engine, settings, *, now: datetime | None = None,
                 cancel: threading.Event | None = None) -> EvaluationReport:
    """Evaluate every workspace with enabled rules at ``now``; stop between workspaces when ``cancel`` is set.

    A workspace whose evaluation raises is logged and counted in ``errors``; the others still run.
    """
    now = _now(now)
    total = EvaluationReport(now)
    with engine.connect() as conn:
        ws_ids = [r[0] for r in conn.execute(
            sa.text("SELECT DISTINCT workspace_id FROM alert_rules WHERE enabled ORDER BY 1"))]
    for ws in ws_ids:
        if cancel is not None and cancel.is_set():
            log.warning("alerts: leadership lost; evaluation stopped before workspace %s", ws)
            break
        try:
            total.add(evaluate_workspace(engine, ws, settings, now=now))
        except Exception:  # noqa: BLE001 - one workspace must not stop the others
            log.exception("alerts: evaluation of workspace %s failed", ws)
            total.errors += 1
    return total


def run_evaluation(redis_client, engine: Engine, settings, *, now: datetime | None = None,
                   ttl_ms: int = 60_000) -> EvaluationReport | None:
    """:func:`evaluate_all` under the Redis leader lock ``<prefix>leader:alerts``.

    Returns ``None`` when another instance leads (nothing evaluated). Losing the lock mid-pass stops the
    pass between workspaces; a workspace already being applied is protected by the generation check.
    """
    from magpie.leader import LeaderLock

    with LeaderLock(redis_client, settings.redis_prefix, "alerts", ttl_ms).hold() as lost:
        if lost is None:
            return None
        return evaluate_all(engine, settings, now=now, cancel=lost)


def incidents(engine: Engine, *, workspace_id: int | None = None, status: str | None = None,
              limit: int = 50) -> list[dict]:
    """Newest incidents first, with rule name and workspace name; filter by workspace id and status."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                """
                SELECT i.id, i.rule_id, r.name AS rule, w.name AS workspace, i.status, i.opened_at,
                       i.recovered_at, i.open_value, i.recover_value, i.rule_revision
                FROM alert_incidents i
                JOIN alert_rules r ON r.id = i.rule_id JOIN workspaces w ON w.id = i.workspace_id
                WHERE (CAST(:w AS int) IS NULL OR i.workspace_id = :w) AND (CAST(:s AS text) IS NULL OR i.status = :s)
                ORDER BY i.id DESC LIMIT :lim
                """
            ),
            {"w": workspace_id, "s": status, "lim": int(limit)},
        )
        return [dict(r) for r in rows.mappings()]

