"""One claimable table as a work queue: claim a row, attempt it, record the outcome on a retry curve.

:class:`ClaimTable` binds the primitives of :mod:`magpie.claims.rows` to one table and adds what every
user of claims needs around them: the worker step (:meth:`ClaimTable.process_one`), the housekeeping loop
that ends expired claims, and the operator's list, counts and retry of failed rows. The email outbox
(:mod:`magpie.outbox.service`) and webhook deliveries (:mod:`magpie.alerts.delivery`) each define one.

Outcome labels of a step: ``"sent"``, ``"retry"`` (scheduled again on the curve), ``"failed"`` (attempts
used up, or a permanent refusal) and ``"stale"`` (the claim expired and was taken over before the outcome
could be recorded: nothing was written).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.base.backoff import Backoff
from magpie.claims import rows
from magpie.claims.models import STATUSES
from magpie.claims.rows import Claim

log = logging.getLogger(__name__)

_LABELS = {"sent": "sent", "pending": "retry", "failed": "failed"}


def retry_curve(base_s: float, cap_s: float) -> Backoff:
    """The retry curve of claimed rows: exponential (factor 2) from ``base_s`` up to ``cap_s``, equal
    jitter, so a retry is never due immediately.

    Args:
        base_s: first delay in seconds. cap_s: longest delay in seconds (``base_s`` if lower).
    Returns:
        A :class:`~magpie.base.backoff.Backoff` (its delays are milliseconds).
    Raises:
        ValueError: ``base_s`` is below one millisecond.
    """
    base = int(base_s * 1000)
    return Backoff("exponential", base, max(base, int(cap_s * 1000)), 2.0, "equal")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one attempt at a claimed row came to.

    Attributes:
        ok: delivered.
        error: why not (kept in ``last_error``, at most 2000 characters).
        permanent: retrying cannot help; the row fails at once whatever attempts remain.
        extra: more ``column: value`` pairs written with the outcome (e.g. ``last_http_status``).
    """

    ok: bool
    error: str | None = None
    permanent: bool = False
    extra: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class ClaimTable:
    """One table of :class:`~magpie.claims.models.ClaimableRow` rows: how they are claimed and listed.

    Attributes:
        table: the table name.
        noun: what one row is called in log lines (``"outbox row"``, ``"delivery"``).
        list_columns: select list of :meth:`list_rows`, written against alias ``t`` (and the aliases of
            ``list_join``).
        name_key: key of :attr:`Claim.row` naming a row in log lines.
        reclaim_expired: workers take over expired claims directly (:func:`rows.claim` with
            ``reclaim_expired``); expired claims without attempts left are then failed by
            :meth:`process_one` whenever nothing is due.
        claim_join / claim_returning: extra ``FROM`` items and ``RETURNING`` columns of a claim (alias ``t``).
        list_join: ``JOIN`` clauses of :meth:`list_rows`.
        list_filters: filter name -> ``(SQL expression, SQL type)`` that :meth:`list_rows` accepts.
    Every SQL fragment is trusted text written in this code base.
    """

    table: str
    noun: str
    list_columns: str
    name_key: str = "id"
    reclaim_expired: bool = False
    claim_join: str = ""
    claim_returning: str = ""
    list_join: str = ""
    list_filters: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    # -- the worker side ------------------------------------------------------------------------------

    def claim(self, engine: Engine, *, claim_seconds: float, limit: int = 1,
              now: datetime | None = None) -> list[Claim]:
        """Claim up to ``limit`` due rows and commit (see :func:`magpie.claims.rows.claim`).

        Args:
            claim_seconds: claim lifetime in seconds. now: the current time (``None``: database time).
        Returns:
            The claims, oldest due first; each ``row`` also has the ``claim_returning`` columns.
        """
        with engine.begin() as conn:
            return rows.claim(conn, self.table, limit=limit, claim_seconds=claim_seconds, now=now,
                              reclaim_expired=self.reclaim_expired, join=self.claim_join,
                              extra_returning=self.claim_returning)

    def record(self, engine: Engine, claim: Claim, outcome: Outcome, *, retry_delay_s: float = 0.0,
               now: datetime | None = None) -> str | None:
        """Record ``outcome`` of ``claim`` if its token is still current (:func:`magpie.claims.rows.record`).

        Args:
            retry_delay_s: seconds until a failed, non-permanent row is due again.
        Returns:
            The new status (``sent``, ``pending`` for a scheduled retry, ``failed``), or ``None`` for a
            stale claim (nothing written).
        """
        with engine.begin() as conn:
            return rows.record(conn, self.table, claim.id, claim.token, ok=outcome.ok, error=outcome.error,
                               retry_delay_s=retry_delay_s, permanent=outcome.permanent, now=now,
                               extra=dict(outcome.extra) or None)

    def process_one(self, engine: Engine, attempt: Callable[[Claim], Outcome], *, claim_seconds: float,
                    backoff: Backoff, now: datetime | None = None) -> str | None:
        """One worker step: claim one due row, ``attempt`` it, record the outcome on ``backoff``.

        Args:
            engine: PostgreSQL engine (two short transactions; nothing is held while ``attempt`` runs).
            attempt: sends the claimed row and says how it went. An exception it raises counts as a
                retryable failure (``"<ExceptionClass>: <message>"``, cut to 500 characters).
            claim_seconds: claim lifetime in seconds.
            backoff: retry curve over the row's attempt number (:func:`retry_curve`).
            now: the current time for claiming and scheduling (``None``: database time).
        Returns:
            ``None`` when nothing was due, else ``"sent"``, ``"retry"``, ``"failed"`` or ``"stale"``.
        """
        got = self.claim(engine, claim_seconds=claim_seconds, now=now)
        if not got:
            if self.reclaim_expired:  # expired claims without attempts left can never be claimed again
                with engine.begin() as conn:
                    rows.fail_exhausted_expired(conn, self.table, now=now)
            return None
        c = got[0]
        try:
            outcome = attempt(c)
        except Exception as exc:  # noqa: BLE001 - an unexpected failure is retried, never a lost row
            outcome = Outcome(False, f"{exc.__class__.__name__}: {exc}"[:500])
        delay = 0.0 if outcome.ok else backoff.delay(c.attempts) / 1000
        status = self.record(engine, c, outcome, retry_delay_s=delay, now=now)
        name = c.row.get(self.name_key, c.id)
        if status is None:
            log.warning("%s %s: claim lost before recording (%s)", self.noun, name,
                        "sent" if outcome.ok else outcome.error)
            return "stale"
        if not outcome.ok:
            log.info("%s %s attempt %s/%s failed: %s", self.noun, name, c.attempts, c.max_attempts,
                     outcome.error)
        return _LABELS[status]

    def release_expired(self, engine: Engine, *, now: datetime | None = None, batch: int = 1000,
                        cancel: threading.Event | None = None) -> tuple[int, int]:
        """Housekeeping: end every expired claim, ``batch`` rows per transaction, until none is left or
        ``cancel`` is set (see :func:`magpie.claims.rows.release_expired`).

        Returns:
            ``(returned_to_pending, failed)`` counts.
        """
        returned = failed = 0
        while not (cancel and cancel.is_set()):
            with engine.begin() as conn:
                r, f = rows.release_expired(conn, self.table, now=now, limit=batch)
            returned, failed = returned + r, failed + f
            if r + f < batch:
                break
        return returned, failed

    # -- the operator side ----------------------------------------------------------------------------

    def list_rows(self, engine: Engine, *, status: str | None = None, limit: int = 50,
                  **filters: object) -> list[dict]:
        """Newest rows first, optionally of one ``status`` and matching ``filters``.

        Args:
            status: one of :data:`~magpie.claims.models.STATUSES`, or ``None`` for all.
            limit: most rows returned.
            filters: ``name=value`` for names of :attr:`list_filters`; a ``None`` value does not filter.
        Returns:
            One dict per row with the :attr:`list_columns` as keys.
        Raises:
            ValueError: unknown status. TypeError: unknown filter name.
        """
        if status is not None and status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}")
        where = ["(CAST(:status AS text) IS NULL OR t.status = :status)"]
        params: dict = {"status": status, "lim": int(limit)}
        for name, value in filters.items():
            if name not in self.list_filters:
                raise TypeError(f"{self.table} rows cannot be filtered by {name!r}")
            expr, sql_type = self.list_filters[name]
            where.append(f"(CAST(:f_{name} AS {sql_type}) IS NULL OR {expr} = :f_{name})")
            params[f"f_{name}"] = value
        sql = (f"SELECT {self.list_columns} FROM {self.table} t {self.list_join} "
               f"WHERE {' AND '.join(where)} ORDER BY t.id DESC LIMIT :lim")
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.text(sql), params).mappings()]

    def counts(self, engine: Engine) -> dict[str, int]:
        """Rows per status, every status present (0 when none)."""
        with engine.connect() as conn:
            sql = f"SELECT status, count(*) FROM {self.table} GROUP BY status"
            got = dict(conn.execute(sa.text(sql)).all())
        return {s: int(got.get(s, 0)) for s in STATUSES}

    def retry(self, engine: Engine, row_id: int, *, now: datetime | None = None) -> bool:
        """Operator action: give the ``failed`` row ``row_id`` one more attempt, due now.

        Returns ``False`` if the row does not exist or is not ``failed``.
        """
        with engine.begin() as conn:
            return rows.retry_failed(conn, self.table, row_id, now=now)
