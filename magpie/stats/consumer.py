"""The results-stream consumer: read through the consumer group, apply, acknowledge, dead-letter.

A ``stats``-queue task calls :func:`ingest`, which takes a batch through the consumer group
:data:`~magpie.queue.streams.GROUP` (``XREADGROUP``, with ``XAUTOCLAIM`` recovery of entries other consumers
left pending) and applies it to PostgreSQL in one transaction (:mod:`magpie.stats.store`).

Entries are acknowledged (``XACK``) only after the commit; the replay ledger makes a re-delivered entry
apply once. Entries that cannot be applied (malformed, unknown route, trimmed before ingestion, rejected
by the database, delivered too often) are written to the dead-letter stream ``<prefix>stats:dead`` with a
reason (:class:`~magpie.stats.entry.DeadLetter`), in the same Redis ``MULTI`` as their ``XACK``.

A sick database is told from a bad entry (:func:`magpie.stats.store.is_infra_failure`). Only an entry's
own failure dead-letters it: a data error (isolated by applying the batch one entry per transaction),
malformed fields, or more than ``max_deliveries`` deliveries (a consumer crashed while holding it, again
and again). An infrastructure failure (unreachable, read-only, disk full, timeouts, serialization
failures) acknowledges nothing, gives every entry of the batch its delivery back (``XCLAIM ...
RETRYCOUNT``: reading raised the count) and records a shared backoff (:mod:`magpie.stats.infra`) during
which no consumer reads or reclaims anything. The first commit after it clears the state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis as redis_lib
from redis.crc import key_slot
from sqlalchemy.engine import Engine

from magpie.stats import infra
from magpie.stats.entry import (
    ORIGIN_FIELD,
    DeadLetter,
    MalformedEntry,
    StreamEntry,
    dead_letter_fields,
    parse_entry,
)
from magpie.queue.streams import (
    DEAD_MAXLEN, GROUP, dead_key, id_parts, infra_key, ledger_id, stream_key, stream_space, tagged_for, text,
)
from magpie.stats.store import (
    applied_ids,
    apply_results,
    describe_failure,
    is_infra_failure,
    ping_error,
    write_probe_error,
)

_TRIMMED = "entry trimmed from the stream before ingestion"


def ensure_group(redis: redis_lib.Redis, prefix: str, stream: str | None = None) -> None:
    """Create the consumer group (and the stream) if missing; start id ``0`` so nothing published earlier
    is skipped. An existing group is left as it is (``BUSYGROUP`` ignored).

    Args:
        stream: the results stream (default: the untagged ``<prefix>stats:results``; a partitioned schedule
            has one per partition, :func:`magpie.queue.partitions.stream_pairs`).
    Raises:
        redis.RedisError: Redis unavailable, or any other refusal than ``BUSYGROUP``.
    """
    try:
        redis.xgroup_create(stream or stream_key(prefix, tagged_for(redis)), GROUP, id="0", mkstream=True)
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
        infra_error: the database failed for infrastructure reasons (one line), or a backoff recorded
            earlier is still running; None when ingestion ran normally. The taken entries stay pending
            with their delivery counts as before this call.
        skipped: True when nothing was read because the shared backoff was running.
        backoff_s: seconds until the next attempt (0 unless ``infra_error``).
        infra_failures: infrastructure failures in a row, this one included (0 unless ``infra_error``).
        infra_cleared: failures in a row this call's commit ended (0 when none were recorded).
    """

    read: int = 0
    committed: int = 0
    replayed: int = 0
    dead: int = 0
    recovered: int = 0
    exhausted: int = 0
    infra_error: str | None = None
    skipped: bool = False
    backoff_s: float = 0.0
    infra_failures: int = 0
    infra_cleared: int = 0


def _decode_fields(fields) -> dict[str, str]:
    """An entry's fields as ``str`` (:func:`~magpie.queue.streams.text`); None (a deleted entry) is ``{}``."""
    if not fields:
        return {}
    try:  # UTF-8 bytes, as almost always: decoded in two C loops
        return dict(zip(map(bytes.decode, fields.keys()), map(bytes.decode, fields.values())))
    except (TypeError, UnicodeDecodeError):  # str replies (decode_responses), or bad bytes to replace
        return {text(k): text(v) for k, v in fields.items()}


def _read(redis, key: str, consumer: str, batch: int, block_ms: int, min_idle_ms: int, recover: bool = True):
    """Collect up to ``batch`` distinct entries: own pending, then idle pending of others, then new.

    ``recover=False`` skips the first two steps. Each step raises the delivery count of what it takes.
    Returns ``(taken: {stream id: fields}, dead: [DeadLetter], recovered: int)``."""
    taken: dict[str, dict[str, str]] = {}
    dead: list[DeadLetter] = []
    # 1. Entries delivered to this consumer earlier and never acknowledged (e.g. PostgreSQL was down).
    resp = redis.xreadgroup(GROUP, consumer, {key: "0"}, count=batch) if recover else None
    for _, entries in resp or []:
        for sid, fields in entries:
            taken[text(sid)] = _decode_fields(fields)
    # 2. Entries another (dead or stuck) consumer has held longer than min_idle_ms.
    cursor = "0-0"
    scans = 0
    while recover and len(taken) < batch and scans < 10:
        scans += 1
        nxt, claimed, *rest = redis.xautoclaim(
            key, GROUP, consumer, min_idle_time=min_idle_ms, start_id=cursor, count=batch - len(taken)
        )
        for sid, fields in claimed:
            sid = text(sid)
            if sid not in taken:
                taken[sid] = _decode_fields(fields)
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
            for sid, fields in entries:
                sid = text(sid)
                if sid not in taken:
                    taken[sid] = _decode_fields(fields)
    return taken, dead, recovered


def _delivery_counts(redis, key: str, consumer: str, ids: list[str]) -> dict[str, int]:
    """Delivery counts (this delivery included) of pending entries now owned by ``consumer``."""
    if not ids:
        return {}
    wanted = set(ids)
    lo, hi = min(ids, key=id_parts), max(ids, key=id_parts)
    out: dict[str, int] = {}
    while True:  # page through the consumer's pending entries in [lo, hi]
        page = 2 * len(ids) + 10
        rows = redis.xpending_range(key, GROUP, min=lo, max=hi, count=page, consumername=consumer)
        for row in rows:
            sid = text(row["message_id"])
            if sid in wanted:
                out[sid] = int(row["times_delivered"])
        if len(rows) < page or len(out) == len(wanted):
            return out
        ms, seq = id_parts(text(rows[-1]["message_id"]))
        lo = f"{ms}-{seq + 1}"


def _give_deliveries_back(redis, key: str, consumer: str, ids: list[str]) -> None:
    """Undo the delivery this call made of ``ids`` (still pending under ``consumer``): an entry that
    failed only because the database did must not come closer to its delivery limit. One ``XPENDING``
    and one pipelined ``XCLAIM <id...> RETRYCOUNT n-1 JUSTID`` per distinct count."""
    counts = _delivery_counts(redis, key, consumer, ids)
    by_count: dict[int, list[str]] = {}
    for sid, n in counts.items():
        by_count.setdefault(max(0, n - 1), []).append(sid)
    if not by_count:
        return
    pipe = redis.pipeline(transaction=False)
    for n, sids in by_count.items():
        pipe.xclaim(key, GROUP, consumer, 0, sids, retrycount=n, justid=True)
    pipe.execute()


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
    backoff_s: float = infra.DEFAULT_BACKOFF_S,
    backoff_cap_s: float = infra.DEFAULT_BACKOFF_CAP_S,
    geo=None,
    stream: str | None = None,
    dead_stream: str | None = None,
    probe: bool = True,
) -> IngestReport:
    """Apply one batch of stream entries to PostgreSQL, then acknowledge them.

    Order: this consumer's own unacknowledged entries, then entries idle longer than ``min_idle_ms`` in
    other consumers' pending lists (``XAUTOCLAIM``), then new entries (``XREADGROUP >``), up to
    ``batch`` in all. One PostgreSQL transaction writes history, health and ledger rows; after the
    commit one Redis ``MULTI`` writes dead letters and acknowledges every entry taken.

    While the shared infrastructure backoff runs (:mod:`magpie.stats.infra`), nothing is read; once it is
    over, a trial write that touches no row must succeed before anything is read. A database that does
    not answer ``SELECT 1`` (or fails the trial) is an infrastructure failure before anything is read; one
    that answers but fails the batch for infrastructure reasons leaves the batch pending with its delivery
    counts given back; either way the backoff starts or grows and the report says so (nothing raised).

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
            applied again, unless the ledger shows it applied (then it is acknowledged as a replay);
            ``None`` disables the limit. Deliveries that met an infrastructure failure do not count.
        backoff_s / backoff_cap_s: seconds of the first / longest backoff after an infrastructure
            failure (``MAGPIE_STATS_INFRA_BACKOFF`` / ``MAGPIE_STATS_INFRA_BACKOFF_CAP``); 0 retries on
            every call.
        geo: a :class:`magpie.enrich.geo.GeoDatabases` enriching exit addresses as they are written
            (see :func:`~magpie.stats.store.apply_results`); None leaves them to the enrichment job.
        stream / dead_stream: the results stream read and the dead-letter stream written (default: the
            untagged pair; a partitioned schedule has a pair per partition,
            :func:`magpie.queue.partitions.stream_pairs`, each ingested by its own call).
        probe: ask ``SELECT 1`` before anything is read (False: a batch right after a committed one, whose
            database answered a moment ago; a failure is still caught by the batch's own transaction and
            its deliveries given back). The trial write after a backoff is made either way.
    Returns:
        :class:`IngestReport`.
    Raises:
        redis.RedisError: Redis unavailable. If this happens after the commit, the entries stay pending
            and are skipped as replays next time.
        Exception: anything that is neither a data error nor an infrastructure failure (a bug); nothing
            is acknowledged and the delivery counts stay raised, so a crash loop ends in the dead-letter
            stream after ``max_deliveries``.
    """
    key = stream or stream_key(prefix, tagged_for(redis))
    dkey = dead_stream or dead_key(prefix, tagged_for(redis))
    space = stream_space(key)  # a partition's stream ids live in their own ledger space
    ensure_group(redis, prefix, key)
    report = IngestReport()
    wait_ms, failures = infra.check(redis, prefix)
    if wait_ms > 0:  # the database refused writes lately: read (and so re-deliver) nothing until the trial
        report.skipped, report.backoff_s, report.infra_failures = True, wait_ms / 1000, failures
        report.infra_error = f"database refusing writes ({failures} failure(s) in a row); backing off"
        return report
    if failures:  # backoff over: a trial write that touches no row, before any delivery is spent
        down = write_probe_error(engine)
        if down is None:
            report.infra_cleared = infra.clear(redis, prefix)
    else:
        down = ping_error(engine) if probe else None
    if down is not None:  # nothing read, no delivery count raised
        return _infra_failure(report, redis, prefix, down, backoff_s, backoff_cap_s)

    taken, dead, recovered = _read(redis, key, consumer, batch, block_ms, min_idle_ms)
    report.read, report.recovered = len(taken), recovered
    settled: set[str] = set()  # taken entries that need no database: dead letters, known replays
    try:
        exhausted: dict[str, int] = {}
        if max_deliveries is not None and recovered:
            counts = _delivery_counts(redis, key, consumer, list(taken)[:recovered])
            exhausted = {sid: n for sid, n in counts.items() if n > max_deliveries and taken.get(sid)}
        if exhausted:
            ledger = {sid: ledger_id(taken[sid].get(ORIGIN_FIELD) or sid, space) for sid in exhausted}
            done = applied_ids(engine, list(ledger.values()))
            for sid, n in exhausted.items():
                settled.add(sid)
                if ledger[sid] in done:  # applied before, its acknowledgement was lost: a replay
                    report.replayed += 1
                    continue
                reason = f"delivered {n} times without acknowledgement (limit {max_deliveries})"
                dead.append(DeadLetter(sid, reason, taken[sid]))
                report.exhausted += 1

        entries: list[StreamEntry] = []
        for sid, fields in taken.items():
            if sid in settled:
                continue
            if not fields:
                dead.append(DeadLetter(sid, _TRIMMED, {}))
                settled.add(sid)
                continue
            try:
                entries.append(parse_entry(sid, fields, space))
            except MalformedEntry as exc:
                dead.append(DeadLetter(sid, f"malformed: {exc}", fields))
                settled.add(sid)

        if entries:
            committed, replayed, rejected = apply_results(engine, entries, geo)
            report.committed, report.replayed = committed, report.replayed + replayed
            if committed:  # the check-latency histogram counts stored results (never the check path)
                from magpie.base.counters import record_check_latency

                gone = {d.stream_id for d in rejected}
                stored = [e.result.latency_ms for e in entries if e.stream_id not in gone]
                record_check_latency(redis, prefix, stored[:committed])
            dead.extend(rejected)
    except Exception as exc:
        if not is_infra_failure(exc):
            raise
        _give_deliveries_back(redis, key, consumer, [sid for sid in taken if sid not in settled])
        final = [d for d in dead if d.stream_id in settled or d.stream_id not in taken]
        _settle(redis, prefix, consumer, key, final, sorted(settled, key=id_parts), dead_maxlen, dkey=dkey)
        report.committed, report.dead = 0, len(final)
        return _infra_failure(report, redis, prefix, describe_failure(exc), backoff_s, backoff_cap_s)

    report.dead = len(dead)
    if taken or dead:
        cleared = _settle(redis, prefix, consumer, key, dead, list(taken), dead_maxlen, wrote=bool(entries),
                          dkey=dkey)
        report.infra_cleared = max(report.infra_cleared, cleared)
    return report


def _settle(redis, prefix: str, consumer: str, key: str, dead: list[DeadLetter], taken: list[str],
            dead_maxlen: int, *, wrote: bool = False, dkey: str | None = None) -> int:
    """One ``MULTI``: write ``dead`` to the dead-letter stream ``dkey``, acknowledge ``taken`` and the dead
    letters that need it, and, after a commit (``wrote``), clear the infrastructure state. Returns the
    failures in a row the cleared state held (0 when none). A partition's tagged streams take the
    infrastructure state's clearing in a second step on a cluster when it lives in another slot."""
    now_ms = int(time.time() * 1000)
    pipe = redis.pipeline(transaction=True)
    dkey = dkey or dead_key(prefix, tagged_for(redis))
    for d in dead:
        pipe.xadd(dkey, dead_letter_fields(d, consumer, now_ms), maxlen=dead_maxlen, approximate=True)
    seen = set(taken)
    ack = list(taken) + [d.stream_id for d in dead if d.ack and d.stream_id not in seen]
    if ack:
        pipe.xack(key, GROUP, *ack)
    ikey = infra_key(prefix, tagged_for(redis))
    apart = tagged_for(redis) and key_slot(ikey.encode()) != key_slot(key.encode())  # a MULTI is one slot
    if wrote and not apart:
        pipe.hget(ikey, "failures")
        pipe.delete(ikey)
    res = pipe.execute()
    if wrote and apart:
        pipe = redis.pipeline(transaction=True)
        pipe.hget(ikey, "failures")
        pipe.delete(ikey)
        res = pipe.execute()
    if not wrote:
        return 0
    try:
        return int(res[-2] or 0)
    except ValueError:
        return 0


def _infra_failure(report: IngestReport, redis, prefix: str, error: str, backoff_s: float,
                   backoff_cap_s: float) -> IngestReport:
    """Record an infrastructure failure in the shared state and say so in ``report``."""
    wait_ms, failures = infra.record_failure(redis, prefix, error, backoff_s=backoff_s,
                                             backoff_cap_s=backoff_cap_s)
    report.infra_error, report.backoff_s, report.infra_failures = error, wait_ms / 1000, failures
    return report


__all__ = ["IngestReport", "ensure_group", "ingest"]
