"""Repartition: move routes from one partition layout to another (``magpie queue repartition --to N``).

Per route, three single-tag steps (so they also run on a Redis Cluster, where no script spans two tags):

1. **stage** in the new partition: payload and side state (stall counts, retries, progress, cadence,
   dead-letter reason, logs) are written, and the route is recorded in the partition's ``repartition_staged``
   hash, but it is in none of the partition's sorted sets, so no claim can see it;
2. **fenced delete** in the old partition: the route (and all its state) is deleted only if its score, its
   dead-letter time and its payload are still what step 1 copied; a claim, completion, import or operator
   change in between makes the delete refuse and the staged copy is withdrawn (the route is tried again on a
   later pass);
3. **activate** in the new partition: the route enters its shard (``ZADD NX``: an import that placed it
   meanwhile keeps its place), the dead set and the priority lane as it was.

Between steps 2 and 3 the route is in no shard: it is claimed by nobody (never twice). A crash there leaves
a staged record, which the next run settles first: activated if the old partition no longer has the route,
withdrawn if it does.

Fencing: a route under a **live lease is never moved**; the pass skips it and a later pass (after its
holder completes or releases it) moves it. A lease therefore always ends in the partition that granted it
(lease calls find their partition from the lease's shard key). A lease that **expired** (its holder gone) is
moved as a route due now; that stall is not counted (the start mark is not carried).

Progress lives in the ``{default}`` tag (``<prefix>{default}:repartition``): the source partition, shard and
``ZSCAN`` cursor, and the counts. Rerunning continues where it stopped. The partition count record
(:func:`~magpie.queue.partitions.layout_key`) says the new count from the start, so processes started with the
old ``MAGPIE_SCHEDULE_PARTITIONS`` are refused; processes with the new count claim from both layouts until
the run ends. Routes are imported into their old partition while they are still there.
"""

from __future__ import annotations

import time
from typing import Callable

import redis

from magpie.errors import Refusal
from magpie.queue.keys import QueueKeys
from magpie.queue.lease import text as _s
from magpie.queue.partitions import layout_key, partition_names, partition_of, repartition_key
from magpie.queue.refusals import QueueError
from magpie.queue.scripts import LUA_DIR

STAGED = "repartition_staged"
"""Per partition: route -> ``<source name>|<score>|<dead score>|<priority score>`` of routes staged there."""

_STAGE = """
-- KEYS: core, dst shard, staged hash. ARGV: member, payload prefix, logs prefix, payload, record,
-- then name/value pairs: s:<field> stalls, r retries, g progress, c:<field> cadence, i dead info, l:<n> log.
local shard, staged, m = KEYS[NCORE + 1], KEYS[NCORE + 2], ARGV[1]
if redis.call('ZSCORE', shard, m) or redis.call('ZSCORE', K_DEAD, m) then return 0 end
if redis.call('HEXISTS', staged, m) == 0 and redis.call('EXISTS', ARGV[2] .. m) == 1 then return 0 end
redis.call('SET', ARGV[2] .. m, ARGV[4])
redis.call('DEL', ARGV[3] .. m)
for i = 6, #ARGV, 2 do
  local k, v = ARGV[i], ARGV[i + 1]
  local kind, f = string.sub(k, 1, 1), string.sub(k, 3)
  if kind == 's' then redis.call('HSET', K_STALLS, f, v)
  elseif kind == 'r' then redis.call('HSET', K_RETRIES, m, v)
  elseif kind == 'g' then redis.call('HSET', K_PROGRESS, m, v)
  elseif kind == 'c' then redis.call('HSET', K_CADENCE, f, v)
  elseif kind == 'i' then redis.call('HSET', K_DEAD_INFO, m, v)
  elseif kind == 'l' then redis.call('RPUSH', ARGV[3] .. m, v) end
end
redis.call('HSET', staged, m, ARGV[5])
return 1
"""

_FENCED_DELETE = """
-- KEYS: core, src shard. ARGV: member, payload prefix, logs prefix, score ('' none), dead score ('' none),
-- payload, clock override. 1 deleted, 0 changed since the copy (nothing deleted).
local shard, m = KEYS[NCORE + 1], ARGV[1]
local sc = redis.call('ZSCORE', shard, m)
local dead = redis.call('ZSCORE', K_DEAD, m)
local function same(a, b) if b == '' then return a == false or a == nil end return a and tonumber(a) == tonumber(b) end
if not same(sc, ARGV[4]) or not same(dead, ARGV[5]) then return 0 end
if redis.call('GET', ARGV[2] .. m) ~= ARGV[6] then return 0 end
if sc and is_lease(tonumber(sc)) and tonumber(sc) > clock(ARGV[7]) then return 0 end
redis.call('ZREM', shard, m)
redis.call('DEL', ARGV[2] .. m)
forget(m, ARGV[3])
unlease({ m })
return 1
"""

_ACTIVATE = """
-- KEYS: core, dst shard, staged hash. ARGV: member, score ('' none), dead score, priority score.
local shard, staged, m = KEYS[NCORE + 1], KEYS[NCORE + 2], ARGV[1]
if redis.call('HDEL', staged, m) == 0 then return 0 end
if ARGV[2] ~= '' then
  redis.call('ZADD', shard, 'NX', ARGV[2], m)
  lower_head(shard, tonumber(redis.call('ZSCORE', shard, m)))
end
if ARGV[3] ~= '' then redis.call('ZADD', K_DEAD, 'NX', ARGV[3], m) end
if ARGV[4] ~= '' then redis.call('ZADD', K_PRIORITY, 'NX', ARGV[4], m) end
return 1
"""

_UNSTAGE = """
-- KEYS: core, dst shard, staged hash. ARGV: member, payload prefix, logs prefix. Withdraw a staged copy.
local shard, staged, m = KEYS[NCORE + 1], KEYS[NCORE + 2], ARGV[1]
if redis.call('HDEL', staged, m) == 0 then return 0 end
if redis.call('ZSCORE', shard, m) or redis.call('ZSCORE', K_DEAD, m) then return 1 end
redis.call('DEL', ARGV[2] .. m)
forget(m, ARGV[3])
return 1
"""


def _lib() -> str:
    return (LUA_DIR / "lib.lua").read_text(encoding="utf-8")


class Repartitioner:
    """One repartition run from the recorded layout to ``to`` partitions.

    Args:
        client: redis-py client; prefix / shards: the schedule's (``MAGPIE_REDIS_PREFIX``,
            ``PROXY_QUEUE_SHARDS``); to: the new partition count (1..1024).
        batch: routes per ``ZSCAN`` step; clock: tests only (Unix ms instead of the Redis clock).
    Raises :class:`QueueError` ``layout_mismatch`` when a run toward another count is under way.
    """

    def __init__(self, client: redis.Redis, prefix: str, shards: int, to: int, *, batch: int = 500,
                 clock: Callable[[], int] | None = None):
        partition_names(to)  # range check
        self.r, self.prefix, self.shards, self.to, self.batch = client, prefix, int(shards), int(to), int(batch)
        self.clock = clock
        self.key = repartition_key(prefix)
        lib = _lib()
        self._stage = client.register_script(lib + _STAGE)
        self._delete = client.register_script(lib + _FENCED_DELETE)
        self._activate = client.register_script(lib + _ACTIVATE)
        self._unstage = client.register_script(lib + _UNSTAGE)

    # -- state -----------------------------------------------------------------------------------------
    def state(self) -> dict:
        """The stored run: ``{"from", "to", "src", "shard", "cursor", "moved", "leased_skipped",
        "conflicts", "passes", "started_ms"}`` (numbers as int), or ``{}`` when none runs."""
        raw = {_s(k): _s(v) for k, v in self.r.hgetall(self.key).items()}
        return {k: (v if k == "cursor" else int(v)) for k, v in raw.items()}

    def current(self) -> int:
        """The recorded partition count (1 when none is recorded)."""
        v = self.r.get(layout_key(self.prefix))
        return int(_s(v)) if v is not None else 1

    def begin(self) -> dict:
        """Start the run (or find it): records ``from``/``to`` and the new count. Returns :meth:`state`.
        Raises :class:`QueueError` ``layout_mismatch`` when a run toward another count is under way."""
        st = self.state()
        if st:
            if st["to"] != self.to:
                raise QueueError(Refusal.LAYOUT_MISMATCH, detail=(
                    f"a repartition from {st['from']} to {st['to']} partitions is under way; "
                    f"rerun `magpie queue repartition --to {st['to']}` to finish it first"))
            return st
        frm = self.current()
        if frm == self.to:
            return {}
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.key, mapping={"from": frm, "to": self.to, "src": 0, "shard": 0, "cursor": "0", "moved": 0,
                                     "leased_skipped": 0, "conflicts": 0, "passes": 0,
                                     "started_ms": int(time.time() * 1000)})
        pipe.set(layout_key(self.prefix), str(self.to))
        pipe.execute()
        self._copy_settings(frm)
        return self.state()

    def _keys(self, name: str) -> QueueKeys:
        return QueueKeys(self.prefix, self.shards, name)

    def _copy_settings(self, frm: int) -> None:
        """Workspace cadences and the pause go to every new partition (per-partition copies)."""
        olds, news = partition_names(frm), partition_names(self.to)
        ws: dict = {}
        paused = False
        for name in olds:
            k = self._keys(name)
            ws.update(self.r.hgetall(k.ws_cadence))
            paused = paused or bool(self.r.exists(k.paused))
        for name in news:
            k = self._keys(name)
            if ws:
                self.r.hset(k.ws_cadence, mapping=ws)
            if paused:
                self.r.set(k.paused, "1")

    def _now(self) -> int:
        if self.clock:
            return int(self.clock())
        s, us = self.r.time()
        return int(s) * 1000 + int(us) // 1000

    # -- one route -------------------------------------------------------------------------------------
    def move(self, member: str, src: str, dst: str) -> str:
        """Move one route from partition ``src`` to ``dst`` (the three steps of the module docstring).

        Returns ``"moved"``, ``"leased"`` (a live lease: left for a later pass), ``"changed"`` (it changed
        between copy and delete: left for a later pass), ``"merged"`` (``dst`` held it already: the old
        copy's workspaces merged there, the old copy deleted) or ``"gone"``.
        """
        s, d = self._keys(src), self._keys(dst)
        now = self._now()
        pipe = self.r.pipeline(transaction=False)
        pipe.zscore(s.shard_of(member), member)
        pipe.zscore(s.dead, member)
        pipe.get(s.payload(member))
        pipe.hmget(s.stalls, [member, f"{member}#q", f"{member}#s"])
        pipe.hget(s.retries, member)
        pipe.hget(s.progress, member)
        pipe.hmget(s.cadence, [member, f"{member}#r", f"{member}#p", f"{member}#d"])
        pipe.hget(s.dead_info, member)
        pipe.zscore(s.priority, member)
        pipe.lrange(s.logs_prefix + member, 0, -1)
        score, dead, payload, stalls, retries, prog, cad, info, prio, logs = pipe.execute()
        if payload is None or (score is None and dead is None):
            return "gone"
        leased = score is not None and score % 1 == 0.5
        if leased and score > now:
            return "leased"
        payload = _s(payload)
        shown = lambda v: "" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
        new_score = "" if score is None else (str(int(now)) if leased else f"{score:.2f}")
        pairs: list = []
        for f, v in zip([member, f"{member}#q"], stalls[:2]):
            if v is not None:
                pairs += [f"s:{f}", _s(v)]
        if retries is not None:
            pairs += ["r:", _s(retries)]
        if prog is not None:
            pairs += ["g:", _s(prog)]
        for f, v in zip([member, f"{member}#r", f"{member}#p", f"{member}#d"], cad):
            if v is not None:
                pairs += [f"c:{f}", _s(v)]
        if info is not None:
            pairs += ["i:", _s(info)]
        for v in logs:
            pairs += ["l:", _s(v)]
        record = f"{src}|{new_score}|{shown(dead)}|{shown(prio)}"
        dcore, scor = d.core(), s.core()
        staged = d.base + STAGED
        ok = int(self._stage(keys=dcore + [d.shard_of(member), staged],
                             args=[member, d.payload_prefix, d.logs_prefix, payload, record, *pairs]))
        if not ok:  # the new partition holds it already (an import by a process of the old layout)
            from magpie.queue.routequeue import RouteQueue

            RouteQueue(self.r, d, interval_ms=60_000).schedule([(member, payload)])  # merge workspaces
            done = int(self._delete(keys=scor + [s.shard_of(member)], args=[
                member, s.payload_prefix, s.logs_prefix, shown(score), shown(dead), payload, self._clock_arg()]))
            return "merged" if done else "changed"
        done = int(self._delete(keys=scor + [s.shard_of(member)], args=[
            member, s.payload_prefix, s.logs_prefix, shown(score), shown(dead), payload, self._clock_arg()]))
        if not done:
            self._unstage(keys=dcore + [d.shard_of(member), staged], args=[member, d.payload_prefix, d.logs_prefix])
            return "changed"
        self._activate(keys=dcore + [d.shard_of(member), staged], args=[member, new_score, shown(dead), shown(prio)])
        return "moved"

    def _clock_arg(self) -> int:
        return int(self.clock()) if self.clock else 0

    def settle_staged(self) -> int:
        """Finish what a crash left between the steps: each staged route is activated when its old partition
        no longer holds it, else withdrawn. Returns the routes settled."""
        n = 0
        for name in partition_names(self.to):
            d = self._keys(name)
            staged = d.base + STAGED
            for m, rec in self.r.hscan_iter(staged):
                m, rec = _s(m), _s(rec)
                src, score, dead, prio = rec.split("|")
                s = self._keys(src)
                pipe = self.r.pipeline(transaction=False)
                pipe.zscore(s.shard_of(m), m)
                pipe.zscore(s.dead, m)
                still = any(v is not None for v in pipe.execute())
                keys = d.core() + [d.shard_of(m), staged]
                if still:
                    self._unstage(keys=keys, args=[m, d.payload_prefix, d.logs_prefix])
                else:
                    self._activate(keys=keys, args=[m, score, dead, prio])
                n += 1
        return n

    # -- the run ---------------------------------------------------------------------------------------
    def run(self, progress: Callable[[dict], object] | None = None, *, max_passes: int = 1000,
            wait_s: float = 0.5, should_stop: Callable[[], bool] = lambda: False) -> dict:
        """Run (or resume) the repartition until every route is in its new partition.

        Each pass walks every old partition's shards and dead set (``ZSCAN``, :attr:`batch` per step),
        recording its place after each step. A pass that had to skip routes under live leases (or routes
        that changed under it) is followed by another after ``wait_s`` seconds. ``progress(state)`` is
        called after each step. Returns the final :meth:`state` plus ``"done": bool`` (False when
        ``should_stop()`` or ``max_passes`` ended it first; rerunning continues).
        """
        st = self.begin()
        if not st:
            return {"done": True, "from": self.current(), "to": self.to, "moved": 0}
        self.settle_staged()
        olds = partition_names(st["from"])
        news = partition_names(self.to)
        units = self.shards + 1  # the shards, then the dead set
        while st["passes"] < max_passes:
            while st["src"] < len(olds):
                if should_stop():
                    return {**self.state(), "done": False}
                src = olds[st["src"]]
                k = self._keys(src)
                key = k.dead if st["shard"] == self.shards else k.shard(st["shard"])
                cursor, rows = self.r.zscan(key, st["cursor"], count=self.batch)
                moved = skipped = conflicts = 0
                for m, _ in rows:
                    m = _s(m)
                    dst = news[partition_of(m, self.to)]
                    if dst == src:
                        continue
                    got = self.move(m, src, dst)
                    if got in ("moved", "merged"):
                        moved += 1
                    elif got == "leased":
                        skipped += 1
                    elif got == "changed":
                        conflicts += 1
                cursor = str(cursor) if not isinstance(cursor, bytes) else _s(cursor)
                nxt = {"cursor": cursor}
                if cursor == "0":
                    if st["shard"] + 1 >= units:
                        nxt.update(src=st["src"] + 1, shard=0)
                    else:
                        nxt.update(shard=st["shard"] + 1)
                pipe = self.r.pipeline(transaction=True)
                pipe.hset(self.key, mapping=nxt)
                pipe.hincrby(self.key, "moved", moved)
                pipe.hincrby(self.key, "leased_skipped", skipped)
                pipe.hincrby(self.key, "conflicts", conflicts)
                if skipped or conflicts:
                    pipe.hset(self.key, "retry", 1)
                pipe.execute()
                st = self.state()
                if progress is not None:
                    progress({**st, "remaining": self.remaining(olds, news)})
            retry = bool(st.get("retry")) or self.remaining(olds, news) > 0
            if not retry:
                break
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(self.key, mapping={"src": 0, "shard": 0, "cursor": "0", "retry": 0})
            pipe.hincrby(self.key, "passes", 1)
            pipe.execute()
            st = self.state()
            time.sleep(wait_s)  # let the leases we met end
        else:
            return {**self.state(), "done": False}
        final = self.state()
        self.r.delete(self.key)
        return {**final, "done": True, "remaining": 0}

    def remaining(self, olds: list[str], news: list[str]) -> int:
        """Routes (and dead letters) still in the old partitions that are not also new ones. A partition of
        both layouts (4 -> 8 keeps ``p0``..``p3``) is not counted: its leftovers are the routes a pass
        skipped, which the pass records (``retry``)."""
        n = 0
        pipe = self.r.pipeline(transaction=False)
        gone = [name for name in olds if name not in news]
        for name in gone:
            k = self._keys(name)
            for sh in k.all_shards():
                pipe.zcard(sh)
            pipe.zcard(k.dead)
        if gone:
            n = sum(int(x) for x in pipe.execute())
        return n


def repartition(client: redis.Redis, prefix: str, shards: int, to: int, *, batch: int = 500,
                progress: Callable[[dict], object] | None = None, **kw) -> dict:
    """:meth:`Repartitioner.run` toward ``to`` partitions (see :class:`Repartitioner` for the arguments)."""
    return Repartitioner(client, prefix, shards, to, batch=batch).run(progress, **kw)
