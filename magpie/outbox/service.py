"""The email outbox: enqueue in the caller's transaction, send from per-instance workers, leader housekeeping.

* :func:`enqueue` writes a ``pending`` row inside the caller's transaction, so an email exists exactly
  when the business change that caused it committed (alert transition, invitation).
* :func:`send_one` claims one due row (``FOR UPDATE SKIP LOCKED`` + a fresh claim token, committed before
  sending), sends it over SMTP (:mod:`magpie.outbox.smtp`) and records the outcome with the token.
  Failures are retried on the :class:`~magpie.base.backoff.Backoff` curve (``MAGPIE_EMAIL_BACKOFF_*``, equal
  jitter) until ``max_attempts``; a permanent SMTP refusal fails the row at once.
* :func:`run_outbox_workers` runs ``MAGPIE_EMAIL_WORKERS`` threads of :func:`send_one` in parallel.
* :func:`housekeeping` (run by :func:`run_housekeeping` under the ``outbox-housekeeping`` leader lock)
  returns expired claims to ``pending`` (or ``failed`` once attempts are used up). Sent and failed rows
  past ``MAGPIE_OUTBOX_RETENTION_SECONDS`` are deleted by the ``outbox_cleanup`` maintenance job
  (:mod:`magpie.maintenance.outbox`), the one place outbox rows are deleted.

Claiming, recording, retries and listing are the shared machinery of :mod:`magpie.claims`
(:data:`OUTBOX` is this table's :class:`~magpie.claims.ClaimTable`).

Delivery is at least once: a worker that dies after the SMTP server accepted a message but before
recording it leaves a claim that expires and is sent again, with the same ``Message-ID``.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from email.utils import parseaddr

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.base.backoff import Backoff
from magpie.claims import Claim, ClaimTable, Outcome, retry_curve, run_workers
from magpie.outbox.smtp import PermanentSmtpError, SmtpError, build_message, send_message

OUTBOX = ClaimTable(
    "email_outbox",
    noun="outbox row",
    list_columns="id, kind, recipient, subject, status, attempts, max_attempts, next_attempt_at, "
                 "claim_expires_at, last_error, created_at, sent_at",
    list_filters={"kind": ("t.kind", "text")},
)
"""The outbox table's claims: rows are claimed one at a time; expired claims return through housekeeping."""


def _clean_header(value: str, what: str) -> str:
    if "\r" in value or "\n" in value:
        raise ValueError(f"{what} must not contain line breaks")
    return value


def validate_address(address: str) -> str:
    """Return ``address`` stripped if it looks like one mailbox (``local@domain``); else ``ValueError``."""
    address = _clean_header(address.strip(), "email address")
    name, addr = parseaddr(address)
    if not addr or addr != address or "@" not in addr or addr.startswith("@") or addr.endswith("@") or " " in addr:
        raise ValueError(f"not an email address: {address!r}")
    return addr


def enqueue(
    conn: sa.Connection,
    recipient: str,
    subject: str,
    body: str,
    *,
    kind: str,
    max_attempts: int = 8,
    dedupe_key: str | None = None,
    now: datetime | None = None,
    domain: str = "magpie.local",
) -> int | None:
    """Add a ``pending`` email to the outbox in the caller's transaction.

    Args:
        conn: connection inside the caller's transaction.
        recipient: one address (validated by :func:`validate_address`).
        subject: one line (no CR/LF). body: plain text.
        kind: free label such as ``alert`` or ``invitation``.
        max_attempts: attempts before the row becomes ``failed`` (>= 1).
        dedupe_key: optional unique key; a second enqueue with the same key adds nothing.
        now: first due time (``None``: database now).
        domain: right-hand side of the generated ``Message-ID``.
    Returns:
        The new row id, or ``None`` when ``dedupe_key`` already exists.
    Raises:
        ValueError: malformed recipient or subject, or ``max_attempts < 1``.
    """
    if max_attempts < 1:
        raise ValueError("max_attempts must be >= 1")
    recipient = validate_address(recipient)
    subject = _clean_header(subject, "subject")
    row = conn.execute(
        sa.text(
            """
            INSERT INTO email_outbox (recipient, subject, body, kind, message_id, dedupe_key, max_attempts,
                                      next_attempt_at, created_at, updated_at)
            VALUES (:r, :s, :b, :k, :m, :d, :n, COALESCE(CAST(:now AS timestamptz), now()),
                    COALESCE(CAST(:now AS timestamptz), now()), COALESCE(CAST(:now AS timestamptz), now()))
            ON CONFLICT (dedupe_key) DO NOTHING
            RETURNING id
            """
        ),
        {"r": recipient, "s": subject, "b": body, "k": kind, "m": f"<{uuid.uuid4().hex}.outbox@{domain}>",
         "d": dedupe_key, "n": int(max_attempts), "now": now},
    ).first()
    return None if row is None else int(row[0])


def message_domain(settings) -> str:
    """Domain for generated Message-IDs: the one of ``MAGPIE_SMTP_FROM`` (``magpie.local`` if none)."""
    addr = parseaddr(settings.smtp_from)[1]
    return addr.rsplit("@", 1)[1] if "@" in addr else "magpie.local"


def enqueue_email(engine: Engine, settings, recipient: str, subject: str, body: str, *, kind: str = "notice",
                  dedupe_key: str | None = None, now: datetime | None = None) -> int | None:
    """:func:`enqueue` in its own transaction, with ``max_attempts`` from ``MAGPIE_EMAIL_MAX_ATTEMPTS``."""
    with engine.begin() as conn:
        return enqueue(conn, recipient, subject, body, kind=kind, max_attempts=settings.email_max_attempts,
                       dedupe_key=dedupe_key, now=now, domain=message_domain(settings))


def backoff_for(settings) -> Backoff:
    """The email retry curve: :func:`magpie.claims.retry_curve` from ``MAGPIE_EMAIL_BACKOFF_BASE`` to
    ``MAGPIE_EMAIL_BACKOFF_CAP`` seconds."""
    return retry_curve(settings.email_backoff_base, settings.email_backoff_cap)


def _send(claim: Claim, settings, sender) -> Outcome:
    try:
        sender(build_message(claim.row, settings.smtp_from), settings)
    except PermanentSmtpError as exc:
        return Outcome(False, str(exc), permanent=True)
    except SmtpError as exc:
        return Outcome(False, str(exc))
    return Outcome(True)


def send_one(engine: Engine, settings, *, now: datetime | None = None, sender=send_message,
             backoff: Backoff | None = None) -> str | None:
    """Claim one due outbox row, send it, record the outcome.

    Args:
        engine: PostgreSQL engine.
        settings: :class:`magpie.config.Settings` (SMTP and email settings).
        now: current time for claiming and scheduling (``None``: database now).
        sender: ``sender(EmailMessage, settings)``; raises :class:`~magpie.outbox.smtp.SmtpError` on failure
            (any other exception counts as a retryable failure too).
        backoff: retry curve (default :func:`backoff_for`).
    Returns:
        ``None`` if nothing was due, else ``"sent"``, ``"retry"``, ``"failed"`` or ``"stale"`` (the claim
        was lost before the outcome could be recorded; the row belongs to a newer claim).
    """
    return OUTBOX.process_one(engine, lambda c: _send(c, settings, sender),
                              claim_seconds=settings.email_claim_seconds,
                              backoff=backoff or backoff_for(settings), now=now)


def run_outbox_workers(engine: Engine, settings, n: int | None = None, *, now: datetime | None = None,
                       budget_s: float | None = None, stop: threading.Event | None = None,
                       poll_s: float | None = None, sender=send_message) -> Counter:
    """Send due outbox rows with ``n`` parallel workers (default ``MAGPIE_EMAIL_WORKERS``).

    Drain mode (``poll_s`` ``None``) returns once no row is due or ``budget_s`` (default
    ``MAGPIE_EMAIL_DRAIN_SECONDS``) has passed; polling mode runs until ``stop`` is set.
    Returns a Counter of outcomes (``sent``, ``retry``, ``failed``, ``stale``, ``error``).
    """
    budget = settings.email_drain_seconds if budget_s is None and poll_s is None else budget_s
    bo = backoff_for(settings)
    return run_workers(n or settings.email_workers,
                       lambda: send_one(engine, settings, now=now, sender=sender, backoff=bo),
                       budget_s=budget, stop=stop, poll_s=poll_s, name="email")


@dataclass(frozen=True, slots=True)
class HousekeepingReport:
    """What one housekeeping pass did: expired claims ``returned`` to pending and ``failed`` (their final
    attempt expired)."""

    returned: int
    failed: int


def housekeeping(engine: Engine, settings, *, now: datetime | None = None, batch: int = 1000,
                 cancel: threading.Event | None = None) -> HousekeepingReport:
    """Return expired claims to ``pending``, or make them ``failed`` when no attempt is left.

    Works in batches of ``batch`` rows per transaction; stops early when ``cancel`` is set (leadership lost).
    ``settings`` is accepted for symmetry with the other outbox jobs; nothing in it is read.
    """
    return HousekeepingReport(*OUTBOX.release_expired(engine, now=now, batch=batch, cancel=cancel))


def run_housekeeping(redis_client, engine: Engine, settings, *, now: datetime | None = None,
                     ttl_ms: int = 60_000, once_per_slot: bool = False) -> HousekeepingReport | None:
    """:func:`housekeeping` under the Redis leader lock ``<prefix>leader:outbox-housekeeping``.

    ``once_per_slot`` (beat triggers): run only if no pass ran the current slot of
    ``MAGPIE_OUTBOX_HOUSEKEEPING_INTERVAL`` seconds yet (:func:`magpie.coordination.leader.claim_cadence_slot`).
    Returns ``None`` when another instance holds the lock or the slot already ran (nothing done).
    """
    from magpie.coordination.leader import LeaderLock, claim_cadence_slot

    lock = LeaderLock(redis_client, settings.redis_prefix, "outbox-housekeeping", ttl_ms)
    with lock.hold() as lost:
        if lost is None:
            return None
        cadence = float(settings.outbox_housekeeping_interval)
        if once_per_slot and cadence > 0 and claim_cadence_slot(
                redis_client, settings.redis_prefix, "outbox-housekeeping", cadence, lock.generation) is None:
            return None
        return housekeeping(engine, settings, now=now, cancel=lost)


def list_outbox(engine: Engine, *, status: str | None = None, kind: str | None = None,
                limit: int = 50) -> list[dict]:
    """Newest outbox rows first (without bodies), optionally filtered by ``status`` and ``kind``.

    Raises ``ValueError`` for an unknown status."""
    return OUTBOX.list_rows(engine, status=status, limit=limit, kind=kind)


def outbox_counts(engine: Engine) -> dict[str, int]:
    """Rows per status, every status present (0 when none)."""
    return OUTBOX.counts(engine)


def retry_email(engine: Engine, row_id: int, *, now: datetime | None = None) -> bool:
    """Operator action: give a ``failed`` row one more attempt, due now. False if it is not ``failed``."""
    return OUTBOX.retry(engine, row_id, now=now)
