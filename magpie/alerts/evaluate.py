"""Alert evaluation: read what the checks already recorded, count breached/healthy minutes, open/recover.

Evaluation never runs a check and never touches the Redis schedule. Once a minute (beat task
``magpie.alerts.evaluate``, under the Redis leader lock ``<prefix>leader:alerts``) each workspace with
enabled rules is handled in two phases:

1. :func:`magpie.alerts.measure.measure_workspace` - no locks, few queries: a :class:`Measurement`
   (``breach``, ``healthy`` or ``unknown``) per enabled rule.
2. :func:`apply_workspace` (here) - one transaction: lock the rules and their state rows, drop every rule
   whose ``revision`` or state ``generation`` changed since phase 1 (edited, disabled, or evaluated by
   someone else: *stale*), then advance the streaks (:func:`magpie.alerts.streaks.advance`), open/recover
   incidents, queue webhook deliveries and alert emails, and bump ``generation``. Rule state, incident
   transitions and delivery rows commit together.

An incident opens at ``MAGPIE_ALERT_OPEN_MINUTES`` (2) consecutive breached minutes and recovers at
``MAGPIE_ALERT_RECOVER_MINUTES`` (2) consecutive healthy ones; Unknown minutes neither open nor recover
one (:mod:`magpie.alerts.streaks` has the exact rules).

Every function takes ``now`` (timezone-aware :class:`datetime`) so tests can drive time. The phase-1
names (:func:`measure_workspace`, :class:`Measurement`, :class:`RuleSnapshot`,
:class:`WorkspaceSnapshot`) are importable from here too.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.alerts.measure import (  # noqa: F401 (phase-1 names re-exported)
    SCOPE_CHUNK,
    RuleSnapshot,
    WorkspaceSnapshot,
    evaluation_time,
    measure_workspace,
)
from magpie.alerts.rules import describe_rule
from magpie.alerts.streaks import (  # noqa: F401 (re-exported)
    MAX_GAP_MINUTES,
    OPENED,
    RECOVERED,
    Measurement,
    StreakState,
    advance,
    epoch_minute,
    is_stale,
)
from magpie.alerts.webhook import encode_payload
from magpie.outbox.service import enqueue, message_domain

log = logging.getLogger(__name__)


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


def _open_incident(conn, snap: WorkspaceSnapshot, rule: RuleSnapshot, m: Measurement) -> dict:
    """Insert an open incident for ``rule``; returns its notification view."""
    incident_id = conn.execute(
        sa.text(
            """
            INSERT INTO alert_incidents (rule_id, workspace_id, rule_revision, status, opened_at, open_value)
            VALUES (:r, :w, :rev, 'open', :now, :v) RETURNING id
            """
        ),
        {"r": rule.id, "w": snap.workspace_id, "rev": rule.revision, "now": snap.now, "v": m.value},
    ).scalar_one()
    return {"id": incident_id, "status": "open", "opened_at": snap.now.isoformat(), "recovered_at": None}


def _recover_incident(conn, snap: WorkspaceSnapshot, incident_id: int | None, m: Measurement) -> dict | None:
    """Mark incident ``incident_id`` recovered; returns its notification view (``None``: it was not open)."""
    row = conn.execute(
        sa.text(
            """
            UPDATE alert_incidents SET status = 'recovered', recovered_at = :now, recover_value = :v
            WHERE id = :i AND status = 'open' RETURNING id, opened_at
            """
        ),
        {"i": incident_id, "now": snap.now, "v": m.value},
    ).first()
    if row is None:
        return None
    return {"id": row[0], "status": "recovered", "opened_at": row[1].isoformat(),
            "recovered_at": snap.now.isoformat()}


def apply_workspace(engine: Engine, snap: WorkspaceSnapshot, settings, *,
                    fence: tuple[str, int] | None = None) -> EvaluationReport:
    """Phase 2: apply a :class:`WorkspaceSnapshot` in one transaction, skipping stale rules.

    A rule is stale (skipped, nothing written for it) when it was deleted, disabled or edited (its
    ``revision`` changed) or its state was written by another evaluation (its ``generation`` changed)
    after ``snap`` was measured.

    ``fence`` is the evaluating leader's ``(fence name, generation)``: the transaction first checks it
    (:func:`magpie.coordination.fencing.fence`), so a former leader that goes on after a newer one wrote is refused.

    Returns an :class:`EvaluationReport` for the workspace (``applied``, ``stale``, ``transitions``).
    Raises ``sqlalchemy.exc.SQLAlchemyError`` on a database failure, :class:`magpie.coordination.fencing.StaleLeader`
    when fenced (nothing of the workspace is written either way).
    """
    report = EvaluationReport(snap.now, workspaces=1, rules=len(snap.rules))
    if not snap.rules:
        return report
    minute = epoch_minute(snap.now)
    with engine.begin() as conn:
        if fence is not None:
            from magpie.coordination.fencing import fence as check_fence

            check_fence(conn, *fence)
        cur = {r["id"]: r for r in conn.execute(sa.text(_LOCK_SQL), {"ids": [r.id for r in snap.rules]}).mappings()}
        channels = None
        for rule in snap.rules:
            c = cur.get(rule.id)
            if is_stale(c, revision=rule.revision, generation=rule.generation):
                report.stale += 1
                continue
            m = snap.measurements[rule.id]
            report.outcomes[m.outcome] += 1
            step = advance(StreakState.from_row(c), m, minute=minute, revision=rule.revision,
                           open_minutes=settings.alert_open_minutes,
                           recover_minutes=settings.alert_recover_minutes)
            state, event, incident_id, incident = step.state, step.transition, c["open_incident_id"], None
            if event == OPENED:
                incident = _open_incident(conn, snap, rule, m)
                incident_id = incident["id"]
            elif event == RECOVERED:
                incident = _recover_incident(conn, snap, incident_id, m)
                incident_id = None
            n = conn.execute(
                sa.text(_UPDATE_STATE_SQL),
                {"id": rule.id, "gen": rule.generation, "rev": state.rule_revision, "status": state.status,
                 "b": state.breach_minutes, "h": state.healthy_minutes, "lm": state.last_minute,
                 "o": m.outcome, "v": m.value, "n": m.samples, "why": m.reason, "now": snap.now,
                 "inc": incident_id},
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
                       now: datetime | None = None,
                       fence: tuple[str, int] | None = None) -> EvaluationReport:
    """Measure then apply one workspace at ``now`` (see :func:`measure_workspace`, :func:`apply_workspace`)."""
    return apply_workspace(engine, measure_workspace(engine, workspace_id, settings, now=now), settings,
                           fence=fence)


def evaluate_all(engine: Engine, settings, *, now: datetime | None = None,
                 cancel: threading.Event | None = None,
                 fence: tuple[str, int] | None = None) -> EvaluationReport:
    """Evaluate every workspace with enabled rules at ``now``; stop between workspaces when ``cancel`` is set.

    A workspace whose evaluation raises is logged and counted in ``errors``; the others still run. With
    ``fence`` (the leader's fence name and generation), a refusal by a newer leader's generation stops
    the pass (counted in ``errors``).
    """
    from magpie.coordination.fencing import StaleLeader

    now = evaluation_time(now)
    total = EvaluationReport(now)
    with engine.connect() as conn:
        ws_ids = [r[0] for r in conn.execute(
            sa.text("SELECT DISTINCT workspace_id FROM alert_rules WHERE enabled ORDER BY 1"))]
    for ws in ws_ids:
        if cancel is not None and cancel.is_set():
            log.warning("alerts: leadership lost; evaluation stopped before workspace %s", ws)
            break
        try:
            total.add(evaluate_workspace(engine, ws, settings, now=now, fence=fence))
        except StaleLeader as exc:
            log.warning("alerts: %s; evaluation stopped before workspace %s", exc, ws)
            total.errors += 1
            break
        except Exception:  # noqa: BLE001 - one workspace must not stop the others
            log.exception("alerts: evaluation of workspace %s failed", ws)
            total.errors += 1
    return total


def run_evaluation(redis_client, engine: Engine, settings, *, now: datetime | None = None,
                   ttl_ms: int = 60_000, once_per_slot: bool = False) -> EvaluationReport | None:
    """:func:`evaluate_all` under the Redis leader lock ``<prefix>leader:alerts``.

    ``once_per_slot`` (beat triggers): evaluate only if no pass ran the current slot of
    ``MAGPIE_ALERT_EVAL_INTERVAL`` seconds yet (:func:`magpie.coordination.leader.claim_cadence_slot`), however many
    beats trigger it. Returns ``None`` when another instance leads or the slot already ran (nothing
    evaluated). Losing the lock mid-pass stops the pass between workspaces; a workspace already being
    applied is protected by the state generation check, and every workspace transaction by the lock's
    fencing token (a newer leader's refuses ours).
    """
    from magpie.coordination.leader import LeaderLock, claim_cadence_slot

    lock = LeaderLock(redis_client, settings.redis_prefix, "alerts", ttl_ms)
    with lock.hold() as lost:
        if lost is None:
            return None
        cadence = float(settings.alert_eval_interval)
        if once_per_slot and cadence > 0 and claim_cadence_slot(
                redis_client, settings.redis_prefix, "alerts", cadence, lock.generation) is None:
            log.info("alerts: this evaluation slot already ran; trigger skipped")
            return None
        return evaluate_all(engine, settings, now=now, cancel=lost,
                            fence=(lock.fence_name, lock.generation))


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

