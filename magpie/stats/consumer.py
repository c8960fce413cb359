"""The results-stream consumer: read through the consumer group, apply, acknowledge, dead-letter.

A ``stats``-queue task calls :func:`ingest`, which takes a batch through the consumer group
:data:`~magpie.stats.keys.GROUP` (``XREADGROUP``, with ``XAUTOCLAIM`` recovery of entries other consumers
left pending) and applies it to PostgreSQL in one transaction (:mod:`magpie.stats.store`).

Entries are acknowledged (``XACK``) only after the commit; the replay ledger makes a re-delivered entry
apply once. Entries that cannot be applied (malformed, unknown route, trimmed before ingestion, rejected
by the database, delivered too often) are written to the dead-letter stream ``<prefix>stats:dead`` with a
reason (:class:`~magpie.stats.entry.DeadLetter`), in the same Redis ``MULTI`` as their ``XACK``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis as redis_lib
from sqlalchemy.engine import Engine

from magpie.stats.entry import DeadLetter, MalformedEntry, StreamEntry, dead_letter_fields, parse_entry
from magpie.stats.keys import DEAD_MAXLEN, GROUP, dead_key, id_parts, stream_key, text
from magpie.stats.store import apply_results, database_answers

_TRIMMED = "entry trimmed from the stream before ingestion"


def ensure_group(redis: redis_lib.Redis, prefix: str) -> None:
    """Create the consumer group (and the stream) if missing; start id ``0`` so nothing published earlier
    is skipped. An existing group is left as it is (``BUSYGROUP`` ignored).

    Raises:
        redis.RedisError: Redis unavailable, or any other refusal than ``BUSYGROUP``.
    """
    try:
        redis.xgroup_create(stream_key(prefix), GROUP, id="0", mkstream=True)
    except redis_lib.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


@dataclass(slots=True)
class IngestReport:
    """What one :func:`ingest` call did.

    Attributes:
        read: distinct entries taken this call (own pending + reclaimed + new).
        committed: results applied to PostgreSQL and acknowledged.
        replayed: entries already in the ledger (applied before, ack had been lost); acknowledged.
        dead: entries written to the dead-letter stream (malformed, unknown route, trimmed, rejected).
        recovered: of ``read``, entries that were pending before this call (own or reclaimed).
        exhausted: of ``dead``, entries dead-lettered for exceeding ``max_deliveries``.
    """

    read: int = 0
    committed: int = 0
    replayed: int = 0
    dead: int = 0
    recovered: int = 0
    exhausted: int = 0


def _decode_entries(raw) -> list[tuple[str, dict[str, str]]]:
    return [(text(sid), {text(k): text(v) for k, v in (fields or {}).items()}) for sid, fields in raw]


def _read(redis, key: str, consumer: str, batch: int, block_ms: int, min_idle_ms: int, recover: bool = True):
    """Collect up to ``batch`` distinct entries: own pending, then idle pending of others, then new.

    ``recover=False`` skips the first two steps (each re-delivery raises an entry's delivery count).
    Returns ``(taken: {stream id: fields}, dead: [DeadLetter], recovered: int)``."""
    taken: dict[str, dict[str, str]] = {}
    dead: list[DeadLetter] = []
    # 1. Entries delivered to this consumer earlier and never acknowledged (e.g. PostgreSQL was down).
    resp = redis.xreadgroup(GROUP, consumer, {key: "0"}, count=batch) if recover else None
    for _, entries in resp or []:
        for sid, fields in _decode_entries(entries):
            taken[sid] = fields
    # 2. Entries another (dead or stuck) consumer has held longer than min_idle_ms.
    cursor = "0-0"
    scans = 0
    while recover and len(taken) < batch and scans < 10:
        scans += 1
        nxt, claimed, *rest = redis.xautoclaim(
            key, GROUP, consumer, min_idle_time=min_idle_ms, start_id=cursor, count=batch - len(taken)
        )
        for sid, fields in _decode_entries(claimed):
            taken.setdefault(sid, fields)
        for sid in rest[0] if rest else []:
            dead.append(DeadLetter(text(sid), _TRIMMED, {}, ack=False))
        cursor = text(nxt)
        if cursor == "0-0":
            break
    recovered = len(taken)
    # 3. New entries; wait for them (up to block_ms) only when there is nothing else to do.
    if len(taken) < batch:
        block = block_ms if block_ms > 0 and not taken and not dead else None
        resp = redis.xreadgroup(GROUP, consumer, {key: ">"}, count=batch - len(taken), block=block)
        for _, entries in resp or []:
            for sid, fields in _decode_entries(entries):
                taken.setdefault(sid, fields)
    return taken, dead, recovered


def _delivery_counts(redis, key: str, consumer: str, ids: list[str]) -> dict[str, int]:
    """Delivery counts (this delivery included) of pending entries now owned by ``consumer``."""
    if not ids:
        return {}
    lo, hi = min(ids, key=id_parts), max(ids, key=id_parts)
    rows = redis.xpending_range(key, GROUP, min=lo, max=hi, count=2 * len(ids) + 10, consumername=consumer)
    wanted = set(ids)
    out: dict[str, int] = {}
    for row in rows:
        sid = text(row["message_id"])
        if sid in wanted:
            out[sid] = int(row["times_delivered"])
    return out


def ingest(
    redis: redis_lib.Redis,
    engine: Engine,
    prefix: str,
    consumer: str,
    batch: int = 500,
    block_ms: int = 0,
    min_idle_ms: int = 60_000,
    *,
    dead_maxlen: int = DEAD_MAXLEN,
    max_deliveries: int | None = 5,
) -> IngestReport:
    """Apply one batch of stream entries to PostgreSQL, then acknowledge them.

    Order: this consumer's own unacknowledged entries, then entries idle longer than ``min_idle_ms`` in
    other consumers' pending lists (``XAUTOCLAIM``), then new entries (``XREADGROUP >``), up to
    ``batch`` in all. One PostgreSQL transaction writes history, health and ledger rows; after the
    commit one Redis ``MULTI`` writes dead letters and acknowledges every entry taken.

    Args:
        redis: client on the schedule's Redis.
        engine: engine on the magpie database (psycopg2).
        prefix: key prefix.
        consumer: this consumer's name, unique per process (e.g. ``f"{hostname}:{pid}"``); reusing a
            name in two concurrent callers makes them re-read each other's pending entries (still
            applied once, thanks to the ledger).
        batch: most entries handled per call.
        block_ms: when nothing is pending, wait up to this many ms for new entries; ``0`` never blocks.
        min_idle_ms: a pending entry of another consumer is reclaimed after this many ms idle. Keep it
            well above the time one ingest takes, or live consumers steal from each other (harmless
            but wasteful).
        dead_maxlen: approximate cap on the dead-letter stream.
        max_deliveries: an entry already delivered this many times without acknowledgement (the pending
            entry's delivery count, ``MAGPIE_STATS_MAX_DELIVERIES``) is dead-lettered instead of being
            applied again; ``None`` disables the limit. Re-deliveries are only made while PostgreSQL
            answers a ping, so an outage does not use up deliveries.
    Returns:
        :class:`IngestReport`.
    Raises:
        sqlalchemy.exc.OperationalError / DBAPIError: PostgreSQL unavailable or the transaction failed
            (deadlock, serialization). Nothing is acknowledged; the entries stay pending under
            ``consumer`` and the next call retries them.
        redis.RedisError: Redis unavailable. If this happens after the commit, the entries stay pending
            and are skipped as replays next time.
    """
    key = stream_key(prefix)
    ensure_group(redis, prefix)
    # Re-delivering pending entries while PostgreSQL is down would only raise their delivery counts.
    recover = database_answers(engine)
    taken, dead, recovered = _read(redis, key, consumer, batch, block_ms, min_idle_ms, recover)
    report = IngestReport(read=len(taken), recovered=recovered)

    exhausted: set[str] = set()
    if max_deliveries is not None and recovered:
        counts = _delivery_counts(redis, key, consumer, list(taken)[:recovered])
        for sid, n in counts.items():
            if n > max_deliveries and taken.get(sid):
                exhausted.add(sid)
                reason = f"delivered {n} times without acknowledgement (limit {max_deliveries})"
                dead.append(DeadLetter(sid, reason, taken[sid]))
        report.exhausted = len(exhausted)

    entries: list[StreamEntry] = []
    for sid, fields in taken.items():
        if sid in exhausted:
            continue
        if not fields:
            dead.append(DeadLetter(sid, _TRIMMED, {}))
            continue
        try:
            entries.append(parse_entry(sid, fields))
        except MalformedEntry as exc:
            dead.append(DeadLetter(sid, f"malformed: {exc}", fields))

    if entries:
        committed, replayed, rejected = apply_results(engine, entries)
        report.committed, report.replayed = committed, replayed
        dead.extend(rejected)
    report.dead = len(dead)

    if taken or dead:
        now_ms = int(time.time() * 1000)
        pipe = redis.pipeline(transaction=True)
        dkey = dead_key(prefix)
        for d in dead:
            pipe.xadd(dkey, dead_letter_fields(d, consumer, now_ms), maxlen=dead_maxlen, approximate=True)
        ack = list(taken) + [d.stream_id for d in dead if d.ack and d.stream_id not in taken]
        if ack:
            pipe.xack(key, GROUP, *ack)
        pipe.execute()
    return report


__all__ = ["IngestReport", "ensure_group", "ingest"]
