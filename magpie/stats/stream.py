"""Check results through a Redis Stream into PostgreSQL (DESIGN.md: "statistics ingestion").

Check tasks :func:`publish` flat result entries to ``<prefix>stats:results``; a ``stats``-queue task calls
:func:`ingest`, which reads them through the consumer group :data:`GROUP` and applies a batch to
PostgreSQL in one transaction:

* ``check_history`` rows (one per result),
* ``route_health`` (counters, newest result, ``consecutive_failures``; a late, older result never
  overwrites a newer ``last_checked_at``),
* ``stats_ledger`` rows for the applied stream ids.

Entries are acknowledged (``XACK``) only after the commit. An entry whose stream id is already in the
ledger is skipped, so a crash between commit and ``XACK`` replays without duplicates, and two consumers
holding the same entry (one reclaimed it with ``XAUTOCLAIM``) apply it once. Entries that cannot be
applied (malformed, unknown route, trimmed before ingestion, rejected by the database) are written to the
dead-letter stream ``<prefix>stats:dead`` with a reason, in the same Redis ``MULTI`` as their ``XACK``.

Entry fields (all ``str``; ``""`` means ``None``): ``route_id``, ``route_hash``, ``alive`` (``"1"``/``"0"``),
``latency_ms``, ``status``, ``attempts``, ``error``, ``body``, ``anonymity``, ``judge``, ``checked_at_ms``
(Unix time in ms). Build them with :func:`encode_result`.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg2
import redis as redis_lib
import sqlalchemy as sa
from sqlalchemy.engine import Engine

GROUP = "magpie-stats"
"""Consumer group name on the results stream."""

DEAD_MAXLEN = 100_000
"""Approximate cap on the dead-letter stream's length."""

FIELDS = (
    "route_id",
    "route_hash",
    "alive",
    "latency_ms",
    "status",
    "attempts",
    "error",
    "body",
    "anonymity",
    "judge",
    "checked_at_ms",
)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MAX_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z, the last instant Python's datetime holds
_MAX_LATENCY_MS = 1e9
_INT32 = 2**31 - 1
_INT64 = 2**63 - 1


def stream_key(prefix: str) -> str:
    """Key of the results stream: ``f"{prefix}stats:results"``."""
    return f"{prefix}stats:results"


def dead_key(prefix: str) -> str:
    """Key of the dead-letter stream: ``f"{prefix}stats:dead"``."""
    return f"{prefix}stats:dead"


# --------------------------------------------------------------------------------------------- publish


def encode_result(
    *,
    route_id: int,
    route_hash: str | None,
    alive: bool,
    checked_at_ms: int,
    latency_ms: float | None = None,
    status: int | None = None,
    attempts: int = 1,
    error: str | None = None,
    body: str | None = None,
    anonymity: str | None = None,
    judge: str | None = None,
) -> dict[str, str]:
    """Build one stream entry (flat ``str -> str``) from a check result; ``None`` becomes ``""``.

    ``latency_ms`` in milliseconds, ``checked_at_ms`` Unix time in milliseconds.
    """

    def s(v) -> str:
        return "" if v is None else str(v)

    return {
        "route_id": str(int(route_id)),
        "route_hash": s(route_hash),
        "alive": "1" if alive else "0",
        "latency_ms": "" if latency_ms is None else repr(float(latency_ms)),
        "status": s(status),
        "attempts": str(int(attempts)),
        "error": s(error),
        "body": s(body),
        "anonymity": s(anonymity),
        "judge": s(judge),
        "checked_at_ms": str(int(checked_at_ms)),
    }


OVERFLOW_POLICIES = ("block", "drop_new", "evict_oldest")
"""Producer policies when the stream holds ``maxlen`` unconsumed entries (``MAGPIE_STATS_OVERFLOW``)."""

# One call appends a batch of entries under the bound. When the batch does not fit, entries the group has
# already consumed (acknowledged, below the replay floor) are trimmed first; only then does the policy
# decide: ``evict_oldest`` trims the oldest unconsumed entries, ``drop_new`` keeps what fits.
# KEYS[1] stream. ARGV[1] maxlen, ARGV[2] policy, ARGV[3] group, ARGV[4] entry count, then per entry:
# field count f, then f field/value pairs flattened (2f values).
# Returns { dropped, trimmed_consumed, id_1, ..., id_n } with '' for a dropped entry.
_FLOOR_LUA = """
local function consumed_floor(key, group)
  local groups = redis.pcall('XINFO', 'GROUPS', key)
  if type(groups) ~= 'table' or groups.err then return nil end
  for _, g in ipairs(groups) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == group then
      if tonumber(f['pending']) > 0 then
        return redis.call('XPENDING', key, group)[2]
      end
      local ms, seq = string.match(f['last-delivered-id'], '^(%d+)-(%d+)$')
      if not ms then return nil end
      return ms .. '-' .. string.format('%d', tonumber(seq) + 1)
    end
  end
  return nil
end
"""

_PUBLISH_LUA = _FLOOR_LUA + """
local key = KEYS[1]
local maxlen, policy, group, n = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local len = redis.call('XLEN', key)
local trimmed = 0
if len + n > maxlen and len > 0 then
  local floor = consumed_floor(key, group)
  if floor then
    trimmed = redis.call('XTRIM', key, 'MINID', floor)
    len = len - trimmed
  end
end
local first, last = 1, n
local dropped = 0
if policy == 'drop_new' then
  local room = math.max(0, maxlen - len)
  if n > room then last = room; dropped = n - room end
else
  if n > maxlen then first = n - maxlen + 1; dropped = n - maxlen end
  local over = len + (last - first + 1) - maxlen
  if over > 0 then
    redis.call('XTRIM', key, 'MAXLEN', maxlen - (last - first + 1))
    dropped = dropped + over
  end
end
local out = { dropped, trimmed }
local pos = 5
for i = 1, n do
  local nf = tonumber(ARGV[pos])
  if i >= first and i <= last then
    local args = { key, '*' }
    for j = pos + 1, pos + 2 * nf do args[#args + 1] = ARGV[j] end
    out[#out + 1] = redis.call('XADD', unpack(args))
  else
    out[#out + 1] = ''
  end
  pos = pos + 1 + 2 * nf
end
return out
"""


def _script(redis: redis_lib.Redis, body: str):
    """A script object on ``redis`` (runs by ``EVALSHA``, loading the script on ``NOSCRIPT``)."""
    return redis.register_script(body)


@dataclass(slots=True)
class PublishReport:
    """What one :func:`publish_entries` call did.

    Attributes:
        ids: per input entry, its new stream id, or ``None`` when the entry was dropped.
        dropped: results lost to the bound: new entries refused (``drop_new``/``block``) plus unconsumed
            old entries evicted (``evict_oldest``). Counted in ``magpie_statistics_dropped_total``.
        trimmed: already consumed (acknowledged) entries removed to make room; not a loss.
        waited_s: seconds spent waiting for room (``block`` only).
    """

    ids: list[str | None]
    dropped: int = 0
    trimmed: int = 0
    waited_s: float = 0.0


def _publish_once(redis, key: str, entries: Sequence[Mapping[str, str]], maxlen: int, policy: str):
    args: list = [int(maxlen), policy, GROUP, len(entries)]
    for entry in entries:
        args.append(len(entry))
        for k, v in entry.items():
            args += [k, v]
    res = _script(redis, _PUBLISH_LUA)(keys=[key], args=args)
    ids = [_s(i) or None for i in res[2:]]
    return ids, int(res[0]), int(res[1])


def publish_entries(
    redis: redis_lib.Redis,
    prefix: str,
    entries: list[dict[str, str]],
    maxlen: int,
    *,
    overflow: str = "evict_oldest",
    block_timeout: float = 2.0,
    poll_interval: float = 0.05,
) -> PublishReport:
    """Append result entries to the stream under a bound on its unconsumed entries.

    One script call (one round trip) per attempt. The bound counts unconsumed entries: when a batch does
    not fit, entries the consumer group already acknowledged are trimmed first (``XTRIM MINID`` at the
    replay floor, see :func:`magpie.stats.upkeep.replay_floor`); only then does ``overflow`` decide:

    * ``evict_oldest``: trim the oldest unconsumed entries (exact ``MAXLEN``); a pending one among them
      is dead-lettered by :func:`ingest` as "trimmed".
    * ``drop_new``: store what fits, drop the rest of the batch.
    * ``block``: store what fits, retry the rest every ``poll_interval`` seconds for up to
      ``block_timeout`` seconds (ingestion makes room), then drop what still does not fit.

    Drops are added to the Redis counter read by the metrics exporter
    (``magpie_statistics_dropped_total{policy}``) in a second round trip, only when something was dropped.

    Args:
        redis: client (``decode_responses`` either way).
        prefix: key prefix (``MAGPIE_REDIS_PREFIX``).
        entries: flat ``str -> str`` dicts (see the module docstring / :func:`encode_result`).
        maxlen: most unconsumed entries the stream holds (``MAGPIE_STATS_STREAM_MAXLEN``).
        overflow: ``evict_oldest``, ``drop_new`` or ``block`` (``MAGPIE_STATS_OVERFLOW``).
        block_timeout: seconds (``MAGPIE_STATS_BLOCK_TIMEOUT``); ``block`` only.
    Returns:
        :class:`PublishReport`.
    Raises:
        ValueError: unknown ``overflow`` or ``maxlen < 1``.
        redis.RedisError: Redis unreachable or rejecting the command.
    """
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if maxlen < 1:
        raise ValueError("maxlen must be at least 1")
    report = PublishReport(ids=[])
    if not entries:
        return report
    key = stream_key(prefix)
    policy = "evict_oldest" if overflow == "evict_oldest" else "drop_new"
    ids, dropped, trimmed = _publish_once(redis, key, entries, maxlen, policy)
    report.trimmed += trimmed
    if overflow == "block" and dropped:
        start = time.monotonic()
        deadline = start + block_timeout
        while dropped and time.monotonic() < deadline:
            time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))
            todo = [i for i, sid in enumerate(ids) if sid is None]
            more, dropped, trimmed = _publish_once(redis, key, [entries[i] for i in todo], maxlen, policy)
            report.trimmed += trimmed
            for i, sid in zip(todo, more):
                ids[i] = sid
        report.waited_s = time.monotonic() - start
    report.ids = ids
    report.dropped = dropped
    if dropped:
        from magpie.metrics import count_stats_drops

        count_stats_drops(redis, prefix, overflow, dropped)
    return report


def publish(
    redis: redis_lib.Redis,
    prefix: str,
    entries: list[dict[str, str]],
    maxlen: int,
    *,
    overflow: str = "evict_oldest",
    block_timeout: float = 2.0,
) -> list[str]:
    """Append result entries to the stream (see :func:`publish_entries` for the bound and policies).

    Args:
        redis: client (``decode_responses`` either way).
        prefix: key prefix (``MAGPIE_REDIS_PREFIX``).
        entries: flat ``str -> str`` dicts (see module docstring / :func:`encode_result`).
        maxlen: most unconsumed entries kept (``MAGPIE_STATS_STREAM_MAXLEN``); consumed entries are
            trimmed to make room first.
        overflow: ``evict_oldest`` (default), ``drop_new`` or ``block`` (``MAGPIE_STATS_OVERFLOW``).
        block_timeout: seconds a ``block`` producer waits for room.
    Returns:
        The stream ids of the entries stored, in input order (dropped entries are left out).
    Raises:
        redis.RedisError: Redis unreachable or rejecting the command.
    """
    rep = publish_entries(redis, prefix, entries, maxlen, overflow=overflow, block_timeout=block_timeout)
    return [i for i in rep.ids if i is not None]


def publish_with_settings(redis: redis_lib.Redis, settings, entries: list[dict[str, str]]) -> PublishReport:
    """:func:`publish_entries` with the bound and policy of :class:`magpie.config.Settings`
    (``MAGPIE_STATS_STREAM_MAXLEN``, ``MAGPIE_STATS_OVERFLOW``, ``MAGPIE_STATS_BLOCK_TIMEOUT``)."""
    return publish_entries(
        redis,
        settings.redis_prefix,
        entries,
        settings.stats_stream_maxlen,
        overflow=settings.stats_overflow,
        block_timeout=settings.stats_block_timeout,
    )


def ensure_group(redis: redis_lib.Redis, prefix: str) -> None:
    """Create the consumer group (and the stream) if missing; start id ``0`` so nothing published earlier
    is skipped. An existing group is left as it is (``BUSYGROUP`` ignored)."""
    try:
        redis.xgroup_create(stream_key(prefix), GROUP, id="0", mkstream=True)
    except redis_lib.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


# ---------------------------------------------------------------------------------------------- parse


class MalformedEntry(ValueError):
    """A stream entry's fields are missing or unusable; the message is the dead-letter reason."""


@dataclass(slots=True)
class CheckResult:
    """A parsed, validated stream entry."""

    stream_id: str
    route_id: int
    route_hash: str | None
    alive: bool
    checked_at: datetime
    latency_ms: float | None
    status: int | None
    attempts: int
    error: str | None
    body: str | None
    anonymity: str | None
    judge: str | None
    fields: dict[str, str]

    @property
    def order(self) -> tuple[datetime, int, int]:
        ms, _, seq = self.stream_id.partition("-")
        return (self.checked_at, int(ms), int(seq or 0))


def _s(v) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _int(fields: Mapping[str, str], name: str, lo: int, hi: int, *, required: bool, default=None):
    raw = fields.get(name)
    if raw is None and required:
        raise MalformedEntry(f"missing field {name!r}")
    raw = (raw or "").strip()
    if raw == "":
        if required:
            raise MalformedEntry(f"empty field {name!r}")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise MalformedEntry(f"field {name!r} is not an integer: {raw[:40]!r}") from None
    if not lo <= value <= hi:
        raise MalformedEntry(f"field {name!r} out of range [{lo}, {hi}]: {value}")
    return value


def _text(fields: Mapping[str, str], name: str) -> str | None:
    raw = fields.get(name) or ""
    return raw.replace("\x00", "") or None  # PostgreSQL text cannot hold NUL


def parse_entry(stream_id: str, fields: Mapping[str, str]) -> CheckResult:
    """Validate one entry's decoded fields.

    Raises:
        MalformedEntry: a required field (``route_id``, ``alive``, ``checked_at_ms``) is missing or
            garbage, or an optional numeric field is not a number in the column's range.
    """
    route_id = _int(fields, "route_id", 1, _INT64, required=True)
    alive_raw = fields.get("alive")
    if alive_raw not in ("1", "0"):
        raise MalformedEntry(f"field 'alive' must be '1' or '0', got {alive_raw!r}")
    checked_at_ms = _int(fields, "checked_at_ms", 0, _MAX_MS, required=True)
    latency_raw = (fields.get("latency_ms") or "").strip()
    latency: float | None = None
    if latency_raw:
        try:
            latency = float(latency_raw)
        except ValueError:
            raise MalformedEntry(f"field 'latency_ms' is not a number: {latency_raw[:40]!r}") from None
        if not math.isfinite(latency) or not 0 <= latency <= _MAX_LATENCY_MS:
            raise MalformedEntry(
                f"field 'latency_ms' out of range [0, {_MAX_LATENCY_MS:g}]: {latency_raw[:40]}"
            )
        latency = round(latency, 3)
    return CheckResult(
        stream_id=stream_id,
        route_id=route_id,
        route_hash=(fields.get("route_hash") or "").strip() or None,
        alive=alive_raw == "1",
        checked_at=_EPOCH + timedelta(milliseconds=checked_at_ms),
        latency_ms=latency,
        status=_int(fields, "status", -_INT32 - 1, _INT32, required=False),
        attempts=_int(fields, "attempts", 0, 32767, required=False, default=0),
        error=_text(fields, "error"),
        body=_text(fields, "body"),
        anonymity=_text(fields, "anonymity"),
        judge=_text(fields, "judge"),
        fields=dict(fields),
    )


# --------------------------------------------------------------------------------------------- ingest


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


@dataclass(slots=True)
class _Dead:
    stream_id: str
    reason: str
    fields: dict[str, str]
    ack: bool = True  # XAUTOCLAIM already dropped trimmed entries from the PEL


def _decode_entries(raw) -> list[tuple[str, dict[str, str]]]:
    return [(_s(sid), {_s(k): _s(v) for k, v in (fields or {}).items()}) for sid, fields in raw]


def _read(redis, key: str, consumer: str, batch: int, block_ms: int, min_idle_ms: int, recover: bool = True):
    """Collect up to ``batch`` distinct entries: own pending, then idle pending of others, then new.

    ``recover=False`` skips the first two steps (each re-delivery raises an entry's delivery count)."""
    taken: dict[str, dict[str, str]] = {}
    dead: list[_Dead] = []
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
            dead.append(_Dead(_s(sid), "entry trimmed from the stream before ingestion", {}, ack=False))
        cursor = _s(nxt)
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


def _database_answers(engine: Engine) -> bool:
    """True when PostgreSQL answers ``SELECT 1`` (one round trip)."""
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        return True
    except (sa.exc.DBAPIError, OSError):
        return False


def _id_key(sid: str) -> tuple[int, int]:
    ms, _, seq = sid.partition("-")
    return int(ms), int(seq or 0)


def _delivery_counts(redis, key: str, consumer: str, ids: list[str]) -> dict[str, int]:
    """Delivery counts (this delivery included) of pending entries now owned by ``consumer``."""
    if not ids:
        return {}
    lo, hi = min(ids, key=_id_key), max(ids, key=_id_key)
    rows = redis.xpending_range(key, GROUP, min=lo, max=hi, count=2 * len(ids) + 10, consumername=consumer)
    wanted = set(ids)
    out: dict[str, int] = {}
    for row in rows:
        sid = _s(row["message_id"])
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
    recover = _database_answers(engine)
    taken, dead, recovered = _read(redis, key, consumer, batch, block_ms, min_idle_ms, recover)
    report = IngestReport(read=len(taken), recovered=recovered)

    exhausted: set[str] = set()
    if max_deliveries is not None and recovered:
        counts = _delivery_counts(redis, key, consumer, list(taken)[:recovered])
        for sid, n in counts.items():
            if n > max_deliveries and taken.get(sid):
                exhausted.add(sid)
                dead.append(
                    _Dead(sid, f"delivered {n} times without acknowledgement (limit {max_deliveries})",
                          taken[sid])
                )
        report.exhausted = len(exhausted)

    results: list[CheckResult] = []
    for sid, fields in taken.items():
        if sid in exhausted:
            continue
        if not fields:
            dead.append(_Dead(sid, "entry trimmed from the stream before ingestion", {}))
            continue
        try:
            results.append(parse_entry(sid, fields))
        except MalformedEntry as exc:
            dead.append(_Dead(sid, f"malformed: {exc}", fields))

    if results:
        committed, replayed, rejected = _apply(engine, results)
        report.committed, report.replayed = committed, replayed
        dead.extend(rejected)
    report.dead = len(dead)

    if taken or dead:
        now_ms = str(int(time.time() * 1000))
        pipe = redis.pipeline(transaction=True)
        dkey = dead_key(prefix)
        for d in dead:
            pipe.xadd(
                dkey,
                {
                    "stream_id": d.stream_id,
                    "reason": d.reason,
                    "consumer": consumer,
                    "dead_at_ms": now_ms,
                    "entry": json.dumps(d.fields, separators=(",", ":")),
                },
                maxlen=dead_maxlen,
                approximate=True,
            )
        ack = list(taken) + [d.stream_id for d in dead if d.ack and d.stream_id not in taken]
        if ack:
            pipe.xack(key, GROUP, *ack)
        pipe.execute()
    return report


# ------------------------------------------------------------------------------------------ database

_ROUTES = "SELECT id, route_hash FROM routes WHERE id = ANY(%s::bigint[]) ORDER BY id FOR KEY SHARE"
_LEDGER = """
    INSERT INTO stats_ledger (stream_id)
    SELECT s FROM unnest(%s::text[]) AS s ORDER BY s
    ON CONFLICT (stream_id) DO NOTHING
    RETURNING stream_id
"""
_HISTORY = """
    INSERT INTO check_history (route_id, checked_at, alive, latency_ms, status, attempts,
                               error, anonymity, body, judge, stream_id)
    SELECT * FROM unnest(%s::bigint[], %s::timestamptz[], %s::boolean[], %s::real[], %s::integer[],
                         %s::smallint[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[])
"""
_HEALTH_ROWS = """
    INSERT INTO route_health (route_id)
    SELECT r FROM unnest(%s::bigint[]) AS r ORDER BY r
    ON CONFLICT (route_id) DO NOTHING
"""
_HEALTH_LOCK = """
    SELECT route_id, last_checked_at, consecutive_failures, last_alive_at
    FROM route_health WHERE route_id = ANY(%s::bigint[]) ORDER BY route_id FOR UPDATE
"""
_HEALTH_UPDATE = """
    UPDATE route_health AS h SET
        checks_total = h.checks_total + u.n,
        alive_total = h.alive_total + u.n_alive,
        consecutive_failures = u.cf,
        last_alive_at = u.last_alive_at,
        last_checked_at = CASE WHEN u.newer THEN u.checked_at ELSE h.last_checked_at END,
        alive = CASE WHEN u.newer THEN u.alive ELSE h.alive END,
        latency_ms = CASE WHEN u.newer THEN u.latency_ms ELSE h.latency_ms END,
        status = CASE WHEN u.newer THEN u.status ELSE h.status END,
        anonymity = CASE WHEN u.newer THEN u.anonymity ELSE h.anonymity END,
        error = CASE WHEN u.newer THEN u.error ELSE h.error END,
        attempts = CASE WHEN u.newer THEN u.attempts ELSE h.attempts END,
        updated_at = now()
    FROM unnest(%s::bigint[], %s::integer[], %s::integer[], %s::integer[], %s::timestamptz[],
                %s::boolean[], %s::timestamptz[], %s::boolean[], %s::real[], %s::integer[], %s::text[],
                %s::text[], %s::smallint[])
         AS u(route_id, n, n_alive, cf, last_alive_at, newer, checked_at, alive, latency_ms, status,
              anonymity, error, attempts)
    WHERE h.route_id = u.route_id
"""


def _is_data_error(exc: sa.exc.DBAPIError) -> bool:
    """True when the database rejected the data (not a connection or concurrency failure)."""
    return not exc.connection_invalidated and isinstance(
        exc.orig, (psycopg2.DataError, psycopg2.IntegrityError)
    )


def _apply(engine: Engine, results: list[CheckResult]) -> tuple[int, int, list[_Dead]]:
    """Apply results in one transaction; if the database rejects the data, isolate the culprits by
    applying one result per transaction. Returns (committed, replayed, dead)."""
    try:
        with engine.begin() as conn:
            return _apply_tx(conn, results)
    except sa.exc.DBAPIError as exc:
        if not _is_data_error(exc):
            raise
    committed = replayed = 0
    dead: list[_Dead] = []
    for r in results:
        try:
            with engine.begin() as conn:
                c, rp, d = _apply_tx(conn, [r])
        except sa.exc.DBAPIError as exc:
            if not _is_data_error(exc):
                raise
            msg = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            dead.append(_Dead(r.stream_id, f"rejected by database: {msg}", r.fields))
            continue
        committed += c
        replayed += rp
        dead.extend(d)
    return committed, replayed, dead


def _apply_tx(conn: sa.Connection, results: Sequence[CheckResult]) -> tuple[int, int, list[_Dead]]:
    # Lock the referenced routes against deletion until commit (no FK race), and check the hash so a
    # result never lands on a different route that reuses an id (e.g. after a database rebuild).
    known: dict[int, str] = dict(
        conn.exec_driver_sql(_ROUTES, (sorted({r.route_id for r in results}),)).all()
    )
    good: list[CheckResult] = []
    dead: list[_Dead] = []
    for r in results:
        stored = known.get(r.route_id)
        if stored is None:
            dead.append(_Dead(r.stream_id, f"route {r.route_id} no longer exists", r.fields))
        elif r.route_hash is not None and r.route_hash != stored:
            dead.append(
                _Dead(r.stream_id, f"route {r.route_id} hash mismatch ({r.route_hash} != {stored})", r.fields)
            )
        else:
            good.append(r)
    if not good:
        return 0, 0, dead

    fresh = set(conn.exec_driver_sql(_LEDGER, (sorted({r.stream_id for r in good}),)).scalars())
    todo = [r for r in good if r.stream_id in fresh]
    replayed = len(good) - len(todo)
    if not todo:
        return 0, replayed, dead

    conn.exec_driver_sql(
        _HISTORY,
        (
            [r.route_id for r in todo],
            [r.checked_at for r in todo],
            [r.alive for r in todo],
            [r.latency_ms for r in todo],
            [r.status for r in todo],
            [r.attempts for r in todo],
            [r.error for r in todo],
            [r.anonymity for r in todo],
            [r.body for r in todo],
            [r.judge for r in todo],
            [r.stream_id for r in todo],
        ),
    )
    _update_health(conn, todo)
    return len(todo), replayed, dead


def _update_health(conn: sa.Connection, results: list[CheckResult]) -> None:
    by_route: dict[int, list[CheckResult]] = defaultdict(list)
    for r in results:
        by_route[r.route_id].append(r)
    route_ids = sorted(by_route)
    conn.exec_driver_sql(_HEALTH_ROWS, (route_ids,))
    rows = conn.exec_driver_sql(_HEALTH_LOCK, (route_ids,)).all()
    state = {rid: (last, cf, last_alive) for rid, last, cf, last_alive in rows}
    cols: tuple[list, ...] = tuple([] for _ in range(13))
    for rid in route_ids:
        rs = sorted(by_route[rid], key=lambda r: r.order)
        last, cf, last_alive = state[rid]
        alive_times = [r.checked_at for r in rs if r.alive]
        if alive_times and (last_alive is None or alive_times[-1] > last_alive):
            last_alive = alive_times[-1]
        # Only results newer than the stored newest one extend (or reset) the failure streak and
        # replace the "current" fields; older, late results only count in the totals.
        newer = [r for r in rs if last is None or r.checked_at > last]
        for r in newer:
            cf = 0 if r.alive else cf + 1
        top = newer[-1] if newer else rs[-1]
        row = (
            rid,
            len(rs),
            len(alive_times),
            cf,
            last_alive,
            bool(newer),
            top.checked_at,
            top.alive,
            top.latency_ms,
            top.status,
            top.anonymity,
            top.error,
            top.attempts,
        )
        for col, v in zip(cols, row):
            col.append(v)
    conn.exec_driver_sql(_HEALTH_UPDATE, cols)


# --------------------------------------------------------------------------------------------- status


def pending_summary(redis: redis_lib.Redis, prefix: str) -> dict:
    """Backlog figures for status output.

    Returns:
        ``{"stream": key, "length": int (entries in the stream), "pending": int (delivered, not yet
        acknowledged), "lag": int | None (entries not yet delivered to the group; None when Redis
        cannot tell, e.g. after deletions), "consumers": int, "last_delivered_id": str | None,
        "dead": int (entries in the dead-letter stream), "group": bool (group exists)}``.
    Raises:
        redis.RedisError: Redis unavailable.
    """
    key = stream_key(prefix)
    pipe = redis.pipeline(transaction=False)
    pipe.xlen(key)
    pipe.xlen(dead_key(prefix))
    length, dead = pipe.execute()
    out = {
        "stream": key,
        "length": int(length),
        "pending": 0,
        "lag": int(length),
        "consumers": 0,
        "last_delivered_id": None,
        "dead": int(dead),
        "group": False,
    }
    if not length and not redis.exists(key):
        return out
    for g in redis.xinfo_groups(key):
        g = {_s(k): v for k, v in g.items()}
        if _s(g.get("name")) != GROUP:
            continue
        lag = g.get("lag")
        out.update(
            pending=int(g.get("pending") or 0),
            lag=None if lag is None else int(lag),
            consumers=int(g.get("consumers") or 0),
            last_delivered_id=_s(g["last-delivered-id"]) if g.get("last-delivered-id") is not None else None,
            group=True,
        )
    return out
