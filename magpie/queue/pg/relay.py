"""Relay of the PostgreSQL schedule's results outbox to the Redis results stream, exactly once.

A completion on PostgreSQL writes each completed lease's result into ``schedule_results`` in the same
transaction that completes the lease, so a result exists iff its lease completed. Right after the commit
(and at any later completion, which relays the oldest pending rows first) :func:`relay` moves rows to the
stream: one Lua script appends the entries under the stream bound (``room_for`` of ``lua/stats_floor.lua``)
and records each outbox id in a Redis set in the same atomic step; then the rows are deleted. A crash
after the append and before the delete leaves rows whose ids the set already holds: the next relay deletes
them without appending again. The set's ids are removed after the delete commits (they also expire).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from magpie.queue.completion import StreamTarget
from magpie.queue.scripts import LUA_DIR

RELAYED_TTL_S = 7 * 86400
"""Seconds a relayed outbox id is remembered (far longer than any crash between append and delete)."""

_BODY = """
-- KEYS[1] stream, KEYS[2] set of relayed outbox ids. ARGV[1] maxlen, ARGV[2] policy, ARGV[3] group,
-- ARGV[4] ttl s, ARGV[5] n, then per entry: outbox id, field count f, f field/value pairs.
-- Returns { dropped, trimmed, full, id_1..id_n } ('' dropped, '=' relayed before).
local key, seen = KEYS[1], KEYS[2]
local maxlen, policy, group, ttl, n = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local items, fresh, pos = {}, 0, 6
for i = 1, n do
  local oid, nf = ARGV[pos], tonumber(ARGV[pos + 1])
  local old = redis.call('SISMEMBER', seen, oid) == 1
  items[i] = { oid = oid, at = pos + 2, nf = nf, old = old }
  if not old then fresh = fresh + 1 end
  pos = pos + 2 + 2 * nf
end
local first, last, dropped, trimmed, full = 1, fresh, 0, 0, false
if fresh > 0 then first, last, dropped, trimmed, full = room_for(key, group, maxlen, fresh, policy) end
if full then return { 0, trimmed, 1 } end
local out, k = { dropped, trimmed, 0 }, 0
for i = 1, n do
  local it = items[i]
  local id = '='
  if not it.old then
    k = k + 1
    id = ''
    if k >= first and k <= last then
      local args = { key, '*' }
      for j = it.at, it.at + 2 * it.nf - 1 do args[#args + 1] = ARGV[j] end
      id = redis.call('XADD', unpack(args))
    end
    redis.call('SADD', seen, it.oid)
  end
  out[#out + 1] = id
end
redis.call('EXPIRE', seen, ttl)
return out
"""


@functools.cache
def _script_text() -> str:
    return (LUA_DIR / "stats_floor.lua").read_text(encoding="utf-8") + "\n" + _BODY


@dataclass
class RelayReport:
    """What one :func:`relay` did: rows ``relayed`` (deleted from the outbox), ``dropped`` to the bound,
    consumed entries ``trimmed``, ``full`` (``refuse`` policy and no room: rows wait), and the stream id of
    each appended outbox id (``stream_ids``; None when dropped)."""

    relayed: int = 0
    dropped: int = 0
    trimmed: int = 0
    full: bool = False
    stream_ids: dict[int, str | None] = field(default_factory=dict)


def relayed_key(queue) -> str:
    """Redis set of outbox ids already appended to the stream, under the schedule's hash tag."""
    return queue.keys.base + "pg_results_relayed"


def relay(queue, stream: StreamTarget, ids=None, limit: int = 1000) -> RelayReport:
    """Move up to ``limit`` pending outbox rows of ``queue`` (a :class:`~magpie.queue.pg.PgSchedule`) for
    ``stream`` to the Redis stream, oldest first (rows another relay holds are skipped).

    Args:
        ids: outbox ids the caller just wrote; reported in ``stream_ids`` when relayed in this call.
    Raises ``redis.RedisError`` (rows stay in the outbox for the next relay) and psycopg2 errors.
    """
    rep = RelayReport()
    policy = "refuse" if stream.policy == "block" else stream.policy
    with queue.tx() as cur:
        cur.execute("SELECT id, fields FROM schedule_results WHERE schedule = %s AND stream = %s "
                    "ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED", (queue.name, stream.key, int(limit)))
        rows = cur.fetchall()
        if not rows:
            return rep
        args: list = [stream.maxlen, policy, stream.group, RELAYED_TTL_S, len(rows)]
        for oid, fields in rows:
            fields = fields if isinstance(fields, dict) else json.loads(fields)
            args += [oid, len(fields)]
            for k, v in fields.items():
                args += [k, v]
        script = queue.r.register_script(_script_text())
        raw = script(keys=[stream.key, relayed_key(queue)], args=args)
        rep.dropped, rep.trimmed, rep.full = int(raw[0]), int(raw[1]), bool(int(raw[2]))
        if rep.full:
            return rep
        for (oid, _), sid in zip(rows, raw[3:]):
            sid = sid.decode() if isinstance(sid, bytes) else str(sid)
            if sid != "=":
                rep.stream_ids[oid] = sid or None
        done = [oid for oid, _ in rows]
        cur.execute("DELETE FROM schedule_results WHERE id = ANY(%s)", (done,))
        rep.relayed = len(done)
    queue.r.srem(relayed_key(queue), *done)
    return rep


def pending(queue) -> int:
    """Outbox rows of ``queue`` not relayed yet (a health and metrics figure)."""
    with queue.tx() as cur:
        cur.execute("SELECT count(*) FROM schedule_results WHERE schedule = %s", (queue.name,))
        return int(cur.fetchone()[0])
