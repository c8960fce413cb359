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

Claiming, recording, retries and listing are the shared machinery of :mod:`magpie.claims`
(:data:`DELIVERIES` is this table's :class:`~magpie.claims.ClaimTable`).

Delivery is at least once. A receiver that accepts a POST and then loses the reply (crash, dropped
connection, timeout) gets the same delivery again, with the same ``X-Magpie-Delivery-ID`` and body:
receivers must deduplicate by that id.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import datetime

from sqlalchemy.engine import Engine

from magpie.alerts import webhook
from magpie.base.backoff import Backoff
from magpie.claims import Claim, ClaimTable, Outcome, retry_curve, run_workers
from magpie.base.crypto import CredentialError, get_keyring

DELIVERIES = ClaimTable(
    "alert_deliveries",
    noun="delivery",
    name_key="delivery_id_text",
    reclaim_expired=True,
    claim_join="JOIN alert_channels ch ON ch.id = t.channel_id",
    claim_returning=", ch.target AS channel_target, ch.secret_enc AS channel_secret_enc, "
                    "ch.enabled AS channel_enabled, t.delivery_id::text AS delivery_id_text",
    list_columns="t.id, t.delivery_id::text AS delivery_id, t.incident_id, t.channel_id, c.name AS channel, "
                 "t.event, t.status, t.attempts, t.max_attempts, t.next_attempt_at, t.claim_expires_at, "
                 "t.last_http_status, t.last_error, t.created_at, t.sent_at",
    list_join="JOIN alert_channels c ON c.id = t.channel_id",
    list_filters={"incident_id": ("t.incident_id", "bigint")},
)
"""The deliveries table's claims: workers re-claim expired claims directly (no housekeeping pass)."""


def backoff_for(settings) -> Backoff:
    """The webhook retry curve: :func:`magpie.claims.retry_curve` from ``MAGPIE_WEBHOOK_BACKOFF_BASE`` to
    ``MAGPIE_WEBHOOK_BACKOFF_CAP`` seconds."""
    return retry_curve(settings.webhook_backoff_base, settings.webhook_backoff_cap)


def claim_deliveries(engine: Engine, settings, *, limit: int = 1, now: datetime | None = None) -> list[Claim]:
    """Claim up to ``limit`` due deliveries (pending and due, or with an expired claim and attempts left).

    Returns :class:`magpie.claims.Claim` objects; ``row`` also has ``channel_target``,
    ``channel_secret_enc``, ``channel_enabled`` and ``delivery_id_text``. The claim is committed on return.
    """
    return DELIVERIES.claim(engine, claim_seconds=settings.delivery_claim_seconds, limit=limit, now=now)


def record_delivery(engine: Engine, claim: Claim, *, ok: bool, error: str | None = None,
                    http_status: int | None = None, retry_delay_s: float = 0.0, permanent: bool = False,
                    now: datetime | None = None) -> str | None:
    """Record a claimed delivery's outcome if ``claim.token`` is still current.

    Returns the new status (``sent``, ``pending`` for a scheduled retry, ``failed``) or ``None`` for a stale
    claim (nothing written).
    """
    outcome = Outcome(ok, error, permanent, {"last_http_status": http_status})
    return DELIVERIES.record(engine, claim, outcome, retry_delay_s=retry_delay_s, now=now)


def _failed(error: str, *, permanent: bool = False) -> Outcome:
    return Outcome(False, error, permanent, {"last_http_status": None})  # no reply: clear the last status


def _post(claim: Claim, settings, allow_private: bool, poster) -> Outcome:
    row = claim.row
    if not row["channel_enabled"]:
        return _failed("channel disabled", permanent=True)
    try:
        secret = get_keyring(settings.encryption_key).decrypt(row["channel_secret_enc"])
        body = row["payload"].encode()
        headers = {
            webhook.DELIVERY_ID_HEADER: row["delivery_id_text"],
            webhook.SIGNATURE_HEADER: webhook.sign(secret, body),
            "X-Magpie-Event": row["event"],
            "X-Magpie-Attempt": str(claim.attempts),
        }
        res = poster(row["channel_target"], body, headers, timeout=settings.webhook_timeout,
                     allow_private=allow_private)
    except webhook.WebhookRefused as exc:
        return _failed(f"target refused: {exc}", permanent=True)
    except CredentialError as exc:
        return _failed(str(exc), permanent=True)
    except Exception as exc:  # noqa: BLE001 - retryable; caught here so that the last HTTP status is cleared
        return _failed(f"{exc.__class__.__name__}: {exc}"[:500])
    return Outcome(res.ok, res.error, extra={"last_http_status": res.status})


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
    allow = settings.webhook_allow_private if allow_private is None else allow_private
    return DELIVERIES.process_one(engine, lambda c: _post(c, settings, allow, poster),
                                  claim_seconds=settings.delivery_claim_seconds,
                                  backoff=backoff or backoff_for(settings), now=now)


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
    """Newest deliveries first (without payloads), optionally filtered by ``status`` / ``incident_id``.

    Raises ``ValueError`` for an unknown status."""
    return DELIVERIES.list_rows(engine, status=status, limit=limit, incident_id=incident_id)


def retry_delivery(engine: Engine, row_id: int, *, now: datetime | None = None) -> bool:
    """Operator action: give a ``failed`` delivery one more attempt, due now (same delivery id).
    Returns False if the row is not ``failed``."""
    return DELIVERIES.retry(engine, row_id, now=now)
