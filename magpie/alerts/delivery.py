"""Webhook delivery: claimed ``alert_deliveries`` rows, sent by parallel workers, outcomes fenced by token.

One row per incident transition and webhook channel is written by evaluation (same transaction as the
transition). Delivery workers (``MAGPIE_DELIVERY_WORKERS``, default 10 per instance, threads of
:func:`run_delivery_workers`) each loop over :func:`deliver_one`:

1. claim one due row with ``FOR UPDATE SKIP LOCKED``, writing a fresh claim token and a claim expiry
   (``MAGPIE_DELIVERY_CLAIM_SECONDS``), and commit - no lock is held while sending. Rows whose claim
   expired (a worker died or hung) are claimed again by the next worker while attempts remain; expired
   claims on their final attempt become ``failed``.
2. POST the stored JSON body (:mod:`magpie.alerts.webhook`) with ``X-Magpie-Delivery-ID`` (the row's
   ``delivery_id``, the same on every attempt) and ``X-Magpie-Signature: sha256=<hex HMAC of the body>``
   using the channel's secret. The target's addresses are checked again before the POST.
3. record the outcome only if the claim token is still current (a worker whose claim expired and was
   re-claimed records nothing). A failure is retried on the Backoff curve (``MAGPIE_WEBHOOK_BACKOFF_*``)
   up to ``MAGPIE_WEBHOOK_MAX_ATTEMPTS`` (4) attempts, then the row is ``failed`` with its last error.
   A refused target or a disabled channel fails the row at once.

Delivery is at least once. A receiver that accepts a POST and then loses the reply (crash, dropped
connection, timeout) gets the same delivery again, with the same ``X-Magpie-Delivery-ID`` and body:
receivers must deduplicate by that id.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.alerts import webhook
from magpie.backoff import Backoff
from magpie.crypto import CredentialError, get_keyring
from magpie.outbox import claims
from magpie.outbox.workers import run_workers

log = logging.getLogger(__name__)

TABLE = "alert_deliveries"
STATUSES = ("pending", "processing", "sent", "failed")
_JOIN = "JOIN alert_channels ch ON ch.id = t.channel_id"
_EXTRA = (", ch.target AS channel_target, ch.secret_enc AS channel_secret_enc, ch.enabled AS channel_enabled, "
          "t.delivery_id::text AS delivery_id_text")


def backoff_for(settings) -> Backoff:
    """The webhook retry curve: exponential from ``MAGPIE_WEBHOOK_BACKOFF_BASE`` to ``..._CAP`` seconds,
    equal jitter (a retry is never due immediately)."""
    base = int(settings.webhook_backoff_base * 1000)
    return Backoff("exponential", base, max(base, int(settings.webhook_backoff_cap * 1000)), 2.0, "equal")


def claim_deliveries(engine: Engine, settings, *, limit: int = 1, now: datetime | None = None) -> list[claims.Claim]:
    """Claim up to ``limit`` due deliveries (pending and due, or with an expired claim and attempts left).

    Returns :class:`magpie.outbox.claims.Claim` objects; ``row`` also has ``channel_target``,
    ``channel_secret_enc``, ``channel_enabled`` and ``delivery_id_text``. The claim is committed on return.
    """
    with engine.begin() as conn:
        return claims.claim(conn, TABLE, limit=limit, claim_seconds=settings.delivery_claim_seconds, now=now,
                            reclaim_expired=True, join=_JOIN, extra_returning=_EXTRA)


def record_delivery(engine: Engine, claim: claims.Claim, *, ok: bool, error: str | None = None,
                    http_status: int | None = None, retry_delay_s: float = 0.0, permanent: bool = False,
                    now: datetime | None = None) -> str | None:
    """Record a claimed delivery's outcome if ``claim.token`` is still current.

    Returns the new status (``sent``, ``pending`` for a scheduled retry, ``failed``) or ``None`` for a stale
    claim (nothing written).
    """
    with engine.begin() as conn:
        return claims.record(conn, TABLE, claim.id, claim.token, ok=ok, error=error, retry_delay_s=retry_delay_s,
                             permanent=permanent, now=now, extra={"last_http_status": http_status})


def deliver_one(engine: Engine, settings, *, now: datetime | None = None, allow_private: bool | None = None,
                backoff: Backoff | None = None, poster=webhook.post) -> str | None:
    """Claim, POST and record one delivery.

    Args:
        engine: PostgreSQL engine.
        settings: :class:`magpie.config.Settings` (``webhook_*``, ``delivery_claim_seconds``, ``encryption_key``).
        now: current time for claims and retry scheduling (``None``: database now).
        allow_private: overrides ``MAGPIE_WEBHOOK_ALLOW_PRIVATE``.
        backoff: retry curve (default :func:`backoff_for`).
        poster: :func:`magpie.alerts.webhook.post`-compatible callable (tests inject faults).
    Returns:
        ``None`` when nothing was due, else ``"sent"``, ``"retry"``, ``"failed"`` or ``"stale"``.
    """
    got = claim_deliveries(engine, settings, now=now)
    if not got:
        with engine.begin() as conn:  # expired claims without attempts left can never be claimed again
            claims.fail_exhausted_expired(conn, TABLE, now=now)
        return None
    c = got[0]
    row = c.row
    allow = settings.webhook_allow_private if allow_private is None else allow_private
    status_code = None
    permanent = False
    if not row["channel_enabled"]:
        ok, permanent, error = False, True, "channel disabled"
    else:
        try:
            secret = get_keyring(settings.encryption_key).decrypt(row["channel_secret_enc"])
            body = row["payload"].encode()
            headers = {
                webhook.DELIVERY_ID_HEADER: row["delivery_id_text"],
                webhook.SIGNATURE_HEADER: webhook.sign(secret, body),
                "X-Magpie-Event": row["event"],
                "X-Magpie-Attempt": str(c.attempts),
            }
            res = poster(row["channel_target"], body, headers, timeout=settings.webhook_timeout, allow_private=allow)
            ok, error, status_code = res.ok, res.error, res.status
        except webhook.WebhookRefused as exc:
            ok, permanent, error = False, True, f"target refused: {exc}"
        except CredentialError as exc:
            ok, permanent, error = False, True, str(exc)
        except Exception as exc:  # noqa: BLE001 - anything else is a retryable failure, never a lost row
            ok, error = False, f"{exc.__class__.__name__}: {exc}"[:500]
    delay = 0.0 if ok else (backoff or backoff_for(settings)).delay(c.attempts) / 1000
    status = record_delivery(engine, c, ok=ok, error=error, http_status=status_code, retry_delay_s=delay,
                             permanent=permanent, now=now)
    if status is None:
        log.warning("delivery %s: claim lost before recording (%s)", row["delivery_id_text"], "sent" if ok else error)
        return "stale"
    if not ok:
        log.info("delivery %s attempt %s/%s failed: %s", row["delivery_id_text"], c.attempts, c.max_attempts, error)
    return {"sent": "sent", "pending": "retry", "failed": "failed"}[status]


def run_delivery_workers(engine: Engine, settings, n: int | None = None, *, now: datetime | None = None,
                         budget_s: float | None = None, stop: threading.Event | None = None,
                         poll_s: float | None = None, allow_private: bool | None = None,
                         poster=webhook.post) -> Counter:
    """Deliver due webhooks with ``n`` parallel workers (default ``MAGPIE_DELIVERY_WORKERS`` = 10).

    Each worker thread claims one row at a time through its own pooled connection. Drain mode
    (``poll_s`` ``None``) returns when nothing is due or after ``budget_s`` (default
    ``MAGPIE_DELIVERY_DRAIN_SECONDS``); polling mode runs until ``stop`` is set.

    Returns a Counter of outcomes (``sent``, ``retry``, ``failed``, ``stale``, ``error``).
    """
    budget = settings.delivery_drain_seconds if budget_s is None and poll_s is None else budget_s
    bo = backoff_for(settings)
    return run_workers(n or settings.delivery_workers,
                       lambda: deliver_one(engine, settings, now=now, allow_private=allow_private, backoff=bo,
                                           poster=poster),
                       budget_s=budget, stop=stop, poll_s=poll_s, name="webhook")


def list_deliveries(engine: Engine, *, status: str | None = None, incident_id: int | None = None,
                    limit: int = 50) -> list[dict]:
    """Newest deliveries first (without payloads), optionally filtered by ``status`` / ``incident_id``."""
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}")
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                """
                SELECT d.id, d.delivery_id::text AS delivery_id, d.incident_id, d.channel_id, c.name AS channel,
                       d.event, d.status, d.attempts, d.max_attempts, d.next_attempt_at, d.claim_expires_at,
                       d.last_http_status, d.last_error, d.created_at, d.sent_at
                FROM alert_deliveries d JOIN alert_channels c ON c.id = d.channel_id
                WHERE (CAST(:s AS text) IS NULL OR d.status = :s)
                  AND (CAST(:i AS bigint) IS NULL OR d.incident_id = :i)
                ORDER BY d.id DESC LIMIT :lim
                """
            ),
            {"s": status, "i": incident_id, "lim": int(limit)},
        )
        return [dict(r) for r in rows.mappings()]


def retry_delivery(engine: Engine, row_id: int, *, now: datetime | None = None) -> bool:
    """Operator action: give a ``failed`` delivery one more attempt, due now (same delivery id).
    Returns False if the row is not ``failed``."""
    with engine.begin() as conn:
        return claims.retry_failed(conn, TABLE, row_id, now=now)
