"""Statistics upkeep: replay floor, ledger retirement, trimming of consumed entries, idle consumers.

The *replay floor* is the lowest stream id that can still be delivered again: the oldest pending entry
of the consumer group, or, with nothing pending, the entry right after the group's last delivered one.
An entry below the floor is acknowledged and can never be re-delivered, so its ``stats_ledger`` row (the
replay protection written with its result) is no longer needed and neither is the entry itself. One old
pending entry therefore holds the floor back (and keeps newer ledger rows) while new results still
commit; ``magpie_statistics_replay_floor_timestamp_seconds`` exports the floor's time so that an operator
sees it stuck.

These functions run from the ``stats_ledger`` maintenance job (:mod:`magpie.stats.ledger`) under
a leader lock; none of them is on the check or ingestion path.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import redis as redis_lib
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.stats import scripts
from magpie.queue.streams import GROUP, id_parts, ledger_id, stream_key, stream_space, tagged_for, text


@dataclass(frozen=True, slots=True)
class ReplayFloor:
    """The lowest stream id that may still be delivered again.

    Attributes:
        stream_id: ``"<ms>-<seq>"``; every entry (and ledger row) with a lower id is settled.
        ms, seq: its two parts as ints (``ms`` is Unix time in ms on the Redis clock).
        source: ``"pending"`` (the oldest pending entry) or ``"delivered"`` (nothing pending: one past
            the last delivered entry).
    """

    stream_id: str
    ms: int
    seq: int
    source: str

    @property
    def timestamp(self) -> float:
        """The floor's time in Unix seconds."""
        return self.ms / 1000.0


def replay_floor(redis: redis_lib.Redis, prefix: str, pairs: list[tuple[str, str]] | None = None,
                 ) -> ReplayFloor | None:
    """Read the consumer group's replay floor (two round trips at most per stream).

    With ``pairs`` (:func:`magpie.queue.partitions.stream_pairs`: one results stream per partition) the
    floor is the lowest of the streams' floors in ledger ids (:func:`magpie.queue.streams.ledger_id`), so
    no stream's replayable entry loses its ledger row; streams with nothing delivered yet hold no ledger
    rows and are left out.

    Returns:
        :class:`ReplayFloor`, or ``None`` when the stream or the group does not exist or nothing was
        ever delivered (then nothing may be retired).
    Raises:
        redis.RedisError: Redis unavailable.
    """
    if pairs is not None:
        floors = [f for f in (_floor(redis, s) for s, _ in pairs) if f is not None]
        return min(floors, key=lambda f: (f.ms, f.seq)) if floors else None
    return _floor(redis, stream_key(prefix, tagged_for(redis)))


def _floor(redis, key: str) -> ReplayFloor | None:
    space = stream_space(key)
    floor = _raw_floor(redis, key)
    if floor is None or not space:
        return floor
    sid = ledger_id(floor.stream_id, space)
    ms, seq = id_parts(sid)
    return ReplayFloor(sid, ms, seq, floor.source)


def _raw_floor(redis, key: str) -> ReplayFloor | None:
    try:
        groups = redis.xinfo_groups(key)
    except redis_lib.ResponseError:  # no such key
        return None
    for g in groups:
        g = {text(k): v for k, v in g.items()}
        if text(g.get("name")) != GROUP:
            continue
        if int(g.get("pending") or 0) > 0:
            summary = redis.xpending(key, GROUP)
            low = summary.get("min")
            if low is not None:
                sid = text(low)
                ms, seq = id_parts(sid)
                return ReplayFloor(sid, ms, seq, "pending")
        last = text(g.get("last-delivered-id") or "0-0")
        ms, seq = id_parts(last)
        if (ms, seq) == (0, 0):
            return None
        return ReplayFloor(f"{ms}-{seq + 1}", ms, seq + 1, "delivered")
    return None


_RETIRE = """
    DELETE FROM stats_ledger WHERE stream_id IN (
        SELECT stream_id FROM stats_ledger
        WHERE (split_part(stream_id, '-', 1)::bigint, split_part(stream_id, '-', 2)::bigint) < (%s, %s)
          AND committed_at < now() - make_interval(secs => %s)
        LIMIT %s
        FOR UPDATE SKIP LOCKED)
"""


def retire_ledger(
    engine: Engine,
    floor: ReplayFloor,
    *,
    batch: int = 5000,
    max_batches: int = 200,
    min_age_s: float = 3600.0,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
) -> dict:
    """Delete ``stats_ledger`` rows below ``floor``, ``batch`` rows per transaction.

    Args:
        engine: engine on the magpie database.
        floor: from :func:`replay_floor`, read *before* this call (the floor only moves up, so a floor
            read earlier is always safe).
        batch: rows per transaction; max_batches: most transactions this call.
        min_age_s: seconds; rows committed more recently than this are kept even below the floor
            (``MAGPIE_STATS_LEDGER_MIN_AGE``).
        deadline: ``time.monotonic()`` value after which no new batch starts.
        cancel: stop before the next batch once set (leadership lost).
    Returns:
        ``{"deleted": int, "batches": int, "complete": bool}``; ``complete`` is False when a limit
        stopped the call with rows possibly left.
    Raises:
        sqlalchemy.exc.DBAPIError: database failure (batches already committed stay committed).
    """
    deleted = batches = 0
    while True:
        if (
            batches >= max_batches
            or (cancel is not None and cancel.is_set())
            or (deadline is not None and time.monotonic() >= deadline)
        ):
            return {"deleted": deleted, "batches": batches, "complete": False}
        with engine.begin() as conn:
            n = conn.exec_driver_sql(_RETIRE, (floor.ms, floor.seq, float(min_age_s), int(batch))).rowcount
        batches += 1
        deleted += n
        if n < batch:
            return {"deleted": deleted, "batches": batches, "complete": True}


def trim_consumed(redis: redis_lib.Redis, prefix: str, pairs: list[tuple[str, str]] | None = None) -> int:
    """Remove the stream entries below the replay floor (all acknowledged) in one atomic script
    (``lua/stats_trim.lua``).

    Keeps the stream's length equal to its backlog (undelivered plus pending entries), so the completion's
    bound (:class:`magpie.queue.completion.StreamTarget`) measures unconsumed results only.

    With ``pairs`` every listed results stream is trimmed (one script call each: single-slot).

    Returns:
        Entries removed (0 when the stream or group is missing).
    Raises:
        redis.RedisError: Redis unavailable.
    """
    keys = [s for s, _ in pairs] if pairs is not None else [stream_key(prefix, tagged_for(redis))]
    return sum(int(scripts.TRIM(redis, [key], [GROUP])) for key in keys)


def cleanup_consumers(redis: redis_lib.Redis, prefix: str, idle_ms: int,
                      pairs: list[tuple[str, str]] | None = None) -> list[str]:
    """Delete consumers idle for at least ``idle_ms`` that hold no pending entry.

    A consumer that still has pending entries is never deleted (deleting it would drop them from the
    pending list, and they would never be delivered again); its entries are reclaimed by
    :func:`magpie.stats.consumer.ingest` (``XAUTOCLAIM``), after which it is empty and goes on a later pass.
    The pending check and the deletion run in one script, so there is no race with a late read.

    Args:
        idle_ms: milliseconds since the consumer's last interaction (``XINFO CONSUMERS`` ``idle``).
        pairs: every results stream to clean (one group per stream); default: the untagged one.
    Returns:
        Names of the deleted consumers (a name deleted from several streams once).
    Raises:
        redis.RedisError: Redis unavailable.
    """
    if pairs is not None:
        gone: list[str] = []
        for key, _ in pairs:
            gone += [n for n in _cleanup(redis, prefix, key, idle_ms) if n not in gone]
        return gone
    return _cleanup(redis, prefix, stream_key(prefix, tagged_for(redis)), idle_ms)


def _cleanup(redis, prefix: str, key: str, idle_ms: int) -> list[str]:
    try:
        consumers = redis.xinfo_consumers(key, GROUP)
    except redis_lib.ResponseError:  # no stream or no group
        return []
    names = [
        text(c["name"])
        for c in consumers
        if int(c.get("pending") or 0) == 0 and int(c.get("idle") or 0) >= idle_ms
    ]
    return delete_empty_consumers(redis, prefix, names, key)


def delete_empty_consumers(redis: redis_lib.Redis, prefix: str, names: list[str],
                           stream: str | None = None) -> list[str]:
    """Delete each named consumer of the group that holds no pending entry *at this instant* (one script,
    ``lua/stats_drop_consumers.lua``: the check and the deletion are atomic, so a list read earlier can be
    stale without harm).

    Returns:
        Names of the deleted consumers.
    Raises:
        redis.RedisError: Redis unavailable (or the group missing).
    """
    if not names:
        return []
    res = scripts.DROP_CONSUMERS(redis, [stream or stream_key(prefix, tagged_for(redis))], [GROUP, *names])
    return [text(n) for n in res]


def ledger_rows(engine: Engine) -> int:
    """Rows currently in ``stats_ledger`` (for status output and tests)."""
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM stats_ledger")).scalar_one())


__all__ = [
    "ReplayFloor",
    "cleanup_consumers",
    "delete_empty_consumers",
    "ledger_rows",
    "replay_floor",
    "retire_ledger",
    "trim_consumed",
]
