"""Claimable rows in PostgreSQL: claim with ``SKIP LOCKED`` and a fresh token, record with the token.

The SQL primitives of :mod:`magpie.claims`, each working in the caller's transaction on one table whose
rows carry the columns of :class:`magpie.claims.models.ClaimableRow`: ``status``
(pending/processing/sent/failed), ``attempts``, ``max_attempts``, ``next_attempt_at``, ``claim_token``,
``claim_expires_at``, ``last_error``, ``updated_at`` and ``sent_at``.

Life of a row::

    pending --claim--> processing --record ok--> sent
                           |--record error--> pending (next_attempt_at = now + backoff) | failed
                           '--claim expires--> re-claimed (claim(reclaim_expired=True)) or returned
                                               to pending / failed by housekeeping (:func:`release_expired`)

A claim commits before the caller sends anything, so no row lock is held across network I/O; from then
on the claim token is the only proof of ownership. Every claim writes a new token (``gen_random_uuid()``),
so a worker whose claim expired and was re-claimed can no longer record an outcome (:func:`record`
returns ``None``). ``attempts`` is counted at claim time: a worker that dies mid-send still used an attempt.

Times: every function takes ``now`` (timezone-aware :class:`datetime`, or ``None`` for the database's
``now()``) so tests drive time without sleeping. Durations are seconds (``float``). Table names, joins and
extra columns are trusted SQL written in this code base, never user input.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

_NOW = "COALESCE(CAST(:now AS timestamptz), now())"


def _table(name: str) -> str:
    if not name.isidentifier():
        raise ValueError(f"not a table name: {name!r}")
    return name


@dataclass(frozen=True, slots=True)
class Claim:
    """One claimed row.

    Attributes:
        id: row id.
        token: the claim token (UUID text); pass it to :func:`record`.
        attempts: attempts including this one (1-based).
        max_attempts: the row's attempt limit.
        row: every returned column by name (the table's columns plus any ``extra_returning``).
    """

    id: int
    token: str
    attempts: int
    max_attempts: int
    row: dict


def claim(
    conn: sa.Connection,
    table: str,
    *,
    limit: int = 1,
    claim_seconds: float,
    now: datetime | None = None,
    reclaim_expired: bool = False,
    join: str = "",
    extra_returning: str = "",
) -> list[Claim]:
    """Claim up to ``limit`` due rows of ``table`` in the caller's transaction (commit it before sending).

    Due rows are ``pending`` with ``next_attempt_at <= now``; with ``reclaim_expired`` also ``processing``
    rows whose claim expired and that have attempts left. Rows locked by another claimer are skipped.

    Args:
        conn: a connection inside a transaction.
        table: a table of :class:`~magpie.claims.models.ClaimableRow` rows (``email_outbox``,
            ``alert_deliveries``).
        limit: most rows to claim (>= 1).
        claim_seconds: claim lifetime in seconds.
        now: the current time (``None``: database time).
        reclaim_expired: also take over expired claims.
        join / extra_returning: extra ``FROM`` items (joined by the caller's ``WHERE``-free ``JOIN ... ON``
            written against alias ``t``) and ``RETURNING`` columns; trusted SQL from this package only.
    Returns:
        The claims, oldest due first. Raises ``ValueError`` for a table name that is no identifier.
    """
    t = _table(table)
    expired = (
        f" OR (status = 'processing' AND claim_expires_at <= {_NOW} AND attempts < max_attempts)"
        if reclaim_expired else ""
    )
    sql = f"""
        WITH due AS (
            SELECT id FROM {t}
            WHERE (status = 'pending' AND next_attempt_at <= {_NOW}){expired}
            ORDER BY next_attempt_at, id
            LIMIT :limit
            FOR UPDATE SKIP LOCKED
        ), upd AS (
            UPDATE {t} t
            SET status = 'processing', claim_token = gen_random_uuid(),
                claim_expires_at = {_NOW} + make_interval(secs => :ttl),
                attempts = t.attempts + 1, updated_at = {_NOW}
            FROM due WHERE t.id = due.id
            RETURNING t.*
        )
        SELECT t.*, t.claim_token::text AS claim_token_text{extra_returning}
        FROM upd t {join}
        ORDER BY t.next_attempt_at, t.id
    """
    rows = conn.execute(sa.text(sql), {"now": now, "limit": int(limit), "ttl": float(claim_seconds)})
    out = []
    for r in rows.mappings():
        d = dict(r)
        out.append(Claim(int(d["id"]), d["claim_token_text"], int(d["attempts"]), int(d["max_attempts"]), d))
    return out


def record(
    conn: sa.Connection,
    table: str,
    row_id: int,
    token: str,
    *,
    ok: bool,
    error: str | None = None,
    retry_delay_s: float = 0.0,
    permanent: bool = False,
    now: datetime | None = None,
    extra: dict | None = None,
) -> str | None:
    """Record the outcome of a claimed row, only if ``token`` is still its current claim token.

    Args:
        conn: a connection inside a transaction.
        table / row_id / token: the claim (see :class:`Claim`).
        ok: ``True`` -> ``sent``. ``False`` -> ``pending`` again at ``now + retry_delay_s``, or ``failed``
            when ``permanent`` or the row's attempts reached ``max_attempts``.
        error: text kept in ``last_error`` (truncated to 2000 characters).
        retry_delay_s: seconds until the retry is due.
        now: the current time (``None``: database time).
        extra: more ``column: value`` pairs to write (column names are trusted identifiers).
    Returns:
        The row's new status, or ``None`` when the token is no longer current (a stale claim: nothing
        was written).
    """
    t = _table(table)
    params = {"id": int(row_id), "token": token, "now": now, "err": (error or "")[:2000] or None,
              "delay": max(0.0, float(retry_delay_s)), "perm": bool(permanent)}
    sets = []
    for i, (col, val) in enumerate((extra or {}).items()):
        if not col.isidentifier():
            raise ValueError(f"bad column name {col!r}")
        sets.append(f", {col} = :x{i}")
        params[f"x{i}"] = val
    if ok:
        body = f"status = 'sent', sent_at = {_NOW}, last_error = NULL"
    else:
        body = (
            "status = CASE WHEN :perm OR attempts >= max_attempts THEN 'failed' ELSE 'pending' END, "
            f"next_attempt_at = {_NOW} + make_interval(secs => :delay), last_error = :err"
        )
    sql = f"""
        UPDATE {t} SET {body}, claim_token = NULL, claim_expires_at = NULL, updated_at = {_NOW}{''.join(sets)}
        WHERE id = :id AND status = 'processing' AND claim_token = CAST(:token AS uuid)
        RETURNING status
    """
    row = conn.execute(sa.text(sql), params).first()
    return None if row is None else row[0]


def release_expired(conn: sa.Connection, table: str, *, now: datetime | None = None,
                    limit: int = 1000) -> tuple[int, int]:
    """Housekeeping: end expired claims of ``table``.

    A row with attempts left goes back to ``pending`` (due now); a row whose ``attempts`` reached
    ``max_attempts`` becomes ``failed`` with ``last_error`` saying its last claim expired.

    Returns:
        ``(returned_to_pending, failed)`` counts. Rows currently locked by a claimer are skipped.
    """
    t = _table(table)
    sql = f"""
        WITH exp AS (
            SELECT id FROM {t}
            WHERE status = 'processing' AND claim_expires_at <= {_NOW}
            ORDER BY claim_expires_at LIMIT :limit
            FOR UPDATE SKIP LOCKED
        )
        UPDATE {t} t SET
            status = CASE WHEN t.attempts >= t.max_attempts THEN 'failed' ELSE 'pending' END,
            next_attempt_at = {_NOW},
            last_error = CASE WHEN t.attempts >= t.max_attempts
                              THEN 'claim expired on the final attempt; outcome unknown'
                              ELSE COALESCE(t.last_error, 'claim expired') END,
            claim_token = NULL, claim_expires_at = NULL, updated_at = {_NOW}
        FROM exp WHERE t.id = exp.id
        RETURNING t.status
    """
    statuses = [r[0] for r in conn.execute(sa.text(sql), {"now": now, "limit": int(limit)})]
    return statuses.count("pending"), statuses.count("failed")


def fail_exhausted_expired(conn: sa.Connection, table: str, *, now: datetime | None = None,
                           limit: int = 1000) -> int:
    """Mark ``failed`` the expired claims that have no attempts left (they can never be re-claimed).

    Used where expired claims are re-claimed directly (:func:`claim` with ``reclaim_expired``). Returns
    how many rows were failed.
    """
    t = _table(table)
    sql = f"""
        WITH exp AS (
            SELECT id FROM {t}
            WHERE status = 'processing' AND claim_expires_at <= {_NOW} AND attempts >= max_attempts
            LIMIT :limit FOR UPDATE SKIP LOCKED
        )
        UPDATE {t} t SET status = 'failed', claim_token = NULL, claim_expires_at = NULL,
            last_error = 'claim expired on the final attempt; outcome unknown', updated_at = {_NOW}
        FROM exp WHERE t.id = exp.id
    """
    return conn.execute(sa.text(sql), {"now": now, "limit": int(limit)}).rowcount


def retry_failed(conn: sa.Connection, table: str, row_id: int, *, extra_attempts: int = 1,
                 now: datetime | None = None) -> bool:
    """Operator action: make a ``failed`` row ``pending`` again (due now) with ``extra_attempts`` more
    attempts allowed. Returns ``False`` if the row does not exist or is not ``failed``."""
    t = _table(table)
    sql = f"""
        UPDATE {t} SET status = 'pending', next_attempt_at = {_NOW},
            max_attempts = GREATEST(max_attempts, attempts + :n), updated_at = {_NOW}
        WHERE id = :id AND status = 'failed'
    """
    params = {"id": int(row_id), "n": max(1, int(extra_attempts)), "now": now}
    return conn.execute(sa.text(sql), params).rowcount == 1
