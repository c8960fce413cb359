"""SQL fragments of the PostgreSQL schedule: the clock, ms <-> timestamptz, scores, and the claim statement.

Every time comes from the database server: ``clock_timestamp()`` truncated to the millisecond, unless a
test clock passes its own "now" (``%(clk)s``, NULL in production). Conversions are exact: a timestamp is
``epoch + n * 1 ms`` and back ``extract(epoch ...) * 1000`` (numeric since PostgreSQL 14).

Row states, and the Redis score each one presents (``score()``):

* due at T: ``due_at = T``, score ``T.00``;
* backoff retry due at T: ``due_at = T``, ``retry``, score ``(T-1).25`` (claimable from T on);
* leased until E: ``lease_expires_at = E``, ``due_at = E + 1 ms`` (claimable once expired), score ``E.50``;
* dead-lettered: ``due_at IS NULL``, ``dead_at`` set, no score.

Claims take rows with ``due_at <= now`` ordered by ``(due_at, rank, shard, route)``, the same order as the
Redis scores (:data:`magpie.queue.pg.models.RANK_SQL`). A lease is live while ``lease_expires_at >= now``.
"""

from __future__ import annotations

from collections.abc import Sequence

NOW = ("COALESCE(%(clk)s::bigint, "
       "(extract(epoch FROM date_trunc('milliseconds', clock_timestamp())) * 1000)::bigint)")
"""Now in Unix ms: the server clock, or the test clock's value."""


def ts(ms_expr: str) -> str:
    """SQL turning a Unix-ms expression into ``timestamptz``."""
    return f"(timestamptz 'epoch' + ({ms_expr}) * interval '1 millisecond')"


def ms(ts_expr: str) -> str:
    """SQL turning a ``timestamptz`` expression into Unix ms (bigint)."""
    return f"(extract(epoch FROM {ts_expr}) * 1000)::bigint"


SCORE_MS = f"({ms('due_at')} - CASE rank WHEN 0 THEN 0.75 WHEN 1 THEN 0.5 ELSE 0 END)"
"""The Redis score of a scheduled row (numeric)."""


def score_text(due_ms: int | None, rank: int | None) -> str | None:
    """The ``'%.2f'`` score of a row from its ``due_at`` (ms) and rank; None when it has none."""
    if due_ms is None:
        return None
    if rank == 0:
        return f"{due_ms - 1}.25"
    if rank == 1:
        return f"{due_ms - 1}.50"
    return f"{due_ms}.00"


def token_ms(lease_score: str) -> int:
    """Expiry ms of a lease token ``'<ms>.50'`` (exact: no float rounding)."""
    return int(str(lease_score).split(".")[0])


CLAIM = f"""
WITH c AS (
  SELECT {NOW} AS now
), cand AS (
  SELECT r.ctid AS row_id, r.route, r.payload, r.shard, r.due_at, r.rank, r.retry, r.lease_token, r.start_mark, r.suspect,
         r.stalls, r.retries, r.leased_at, r.last_heartbeat_at, r.lease_expires_at
  FROM schedule_routes r
  WHERE r.schedule = %(s)s AND r.due_at IS NOT NULL AND r.due_at <= (SELECT {ts('c.now')} FROM c)
    AND NOT EXISTS (SELECT 1 FROM schedule_meta m WHERE m.schedule = %(s)s AND m.paused)
  ORDER BY r.due_at, r.rank, r.shard, r.route
  LIMIT %(n)s
  FOR UPDATE OF r SKIP LOCKED
), x1 AS (
  SELECT cand.*, (lease_token IS NOT NULL) AS stalled,
         (lease_token IS NOT NULL AND start_mark IS NOT NULL AND start_mark = lease_token) AS started
  FROM cand
), x2 AS (
  SELECT x1.*, CASE WHEN started THEN suspect + 1 ELSE suspect END AS q FROM x1
), x AS (
  SELECT x2.*, CASE WHEN started THEN stalls + 1 ELSE stalls END AS st,
         (started AND q > GREATEST(%(max_stalled)s, 2) AND stalls + 1 > %(max_stalled)s) AS dead
  FROM x2
)
UPDATE schedule_routes r SET
  suspect = x.q, stalls = x.st,
  start_mark = CASE WHEN x.started THEN NULL ELSE r.start_mark END,
  last_silent_ms = CASE WHEN x.stalled
                   THEN c.now - {ms('COALESCE(x.last_heartbeat_at, x.leased_at, x.lease_expires_at)')}
                   ELSE r.last_silent_ms END,
  due_at = CASE WHEN x.dead THEN NULL ELSE {ts('c.now + %(lease)s + 1')} END,
  retry = false,
  lease_expires_at = CASE WHEN x.dead THEN NULL ELSE {ts('c.now + %(lease)s')} END,
  lease_token = CASE WHEN x.dead THEN NULL ELSE (c.now + %(lease)s)::text || '.50' END,
  leased_at = CASE WHEN x.dead THEN NULL ELSE {ts('c.now')} END,
  last_heartbeat_at = NULL,
  dead_at = CASE WHEN x.dead THEN {ts('c.now')} END,
  dead_reason = CASE WHEN x.dead THEN jsonb_build_object('reason', 'stalled', 'stalls', x.st, 'claims', x.q,
                                                         'alone', true, 'at', c.now) END
FROM x, c
WHERE r.ctid = x.row_id
RETURNING r.route, x.payload, x.shard, {ms('x.due_at')}, x.rank, x.lease_token, x.stalled, x.dead,
          x.q >= GREATEST(%(max_stalled)s, 2),
          CASE WHEN x.retry THEN x.retries ELSE 0 END, c.now
"""
"""One claim round: reap the expired leases met (stall rule), lease the rest. Params: s, n, lease,
max_stalled, clk. Returns per row: route, payload, shard, previous due_at ms, previous rank, previous lease
token, stalled, dead-lettered, alone, retry attempts, now ms. The claimed rows are joined back by ``ctid``
(locked, so it cannot move), a TID scan whatever the table statistics say."""

LIVE = f"""SELECT {NOW}, count(*) FROM schedule_routes
WHERE schedule = %(s)s AND lease_expires_at >= {ts(NOW)}"""
"""Now (ms) and the live leases of schedule ``s`` (for the ``max_inflight`` cap)."""


def values(cur, rows: Sequence[tuple]) -> str:
    """A ``VALUES`` list literal of ``rows`` (values quoted by psycopg2, ``%`` doubled) for a statement
    executed with parameters."""
    ph = "(" + ", ".join(["%s"] * len(rows[0])) + ")"
    return ",".join(cur.mogrify(ph, row).decode() for row in rows).replace("%", "%%")
