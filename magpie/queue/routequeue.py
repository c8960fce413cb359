"""Python face of the route schedule: thin, typed wrappers over the fenced Lua scripts in ``lua/``.

The lease score a claim returns (``expiry_ms + 0.5``, a string so the ``.5`` survives) is the fencing
token: renew, complete, complete-with-payload, retry, progress, log and remove take effect only while
the stored score still equals it (the invariants of docs/design.md). A refused call changes nothing, raises a
typed :class:`QueueError` (:mod:`magpie.queue.refusals` maps the script's code) and fires the lease's
cancellation token, so the running check stops at its next attempt boundary. Scores travel as strings
end to end; Python never rounds them.

It is the one Python face of every schedule script (worker, import, time and operator planes), kept in one
module so each script's wrapper stands beside the others; reads live in :mod:`magpie.queue.reads`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Iterable, Sequence

import redis

from magpie.base import redisconn
from magpie.errors import Refusal
from magpie.queue import reads
from magpie.queue.completion import Completion, StreamTarget
from magpie.queue.keys import QueueKeys
from magpie.queue.lease import Lease
from magpie.queue.lease import text as _s
from magpie.queue.refusals import COMPLETED, GONE, LEASE_LOST, REMOVED, QueueError, is_refusal, refusal
from magpie.queue.scripts import Scripts

log = logging.getLogger(__name__)


_MARK = """
local again, set, seen = {}, {}, {}
local n = #ARGV / 2
for lo = 1, n, 1000 do
  local hi = math.min(lo + 999, n)
  local members, fields = {}, {}
  for i = lo, hi do
    members[#members + 1] = ARGV[2 * i - 1]
    fields[#fields + 1] = ARGV[2 * i - 1] .. '#s'
  end
  local held = redis.call('ZMSCORE', KEYS[2], unpack(members))
  local marks = redis.call('HMGET', KEYS[1], unpack(fields))
  for j = 1, hi - lo + 1 do
    local i, member = lo + j - 1, members[j]
    local token = tonumber(ARGV[2 * i])
    local mark = marks[j]
    if seen[member] or tonumber(held[j] or '-1') ~= token or (mark and tonumber(mark) == token) then
      again[#again + 1] = i
    else
      seen[member] = true
      set[#set + 1] = fields[j]
      set[#set + 1] = ARGV[2 * i]
    end
  end
end
for i = 1, #set, 1000 do redis.call('HSET', KEYS[1], unpack(set, i, math.min(i + 999, #set))) end
return again
"""

_UNMARK = """#!lua flags=allow-oom
local n = 0
for i = 1, #ARGV, 2 do
  local mark = redis.call('HGET', KEYS[1], ARGV[i])
  if mark and tonumber(mark) == tonumber(ARGV[i + 1]) then n = n + redis.call('HDEL', KEYS[1], ARGV[i]) end
end
return n
"""


class RouteQueue:
    """The recurring route schedule of one deployment.

    Args:
        client: a redis-py client.
        keys: the :class:`QueueKeys` naming the schedule.
        interval_ms: check interval in ms (next due = max(previous due, now) + interval).
        lease_ms: lease length in ms given by a claim or a renewal.
        max_stalled: a route re-claimed after lease expiry more than this many times in a row is
            dead-lettered (``MAGPIE_MAX_STALLED``).
        log_limit: lines kept per route log.
        clock: tests only: a callable giving "now" in Unix ms passed to the scripts instead of the
            Redis server clock (``TIME``), which production always uses.
        dead_after / dead_factor: the default dead-route policy (``MAGPIE_DEAD_BACKOFF_AFTER`` /
            ``MAGPIE_DEAD_BACKOFF_FACTOR``): after ``dead_after`` dead checks in a row (0 = off) a route
            waits ``dead_factor`` x its interval until a check finds it alive.
        priority_share: fraction 0..1 of each claim the priority lane (new imports, check-now) may take
            ahead of the due backlog (``MAGPIE_PRIORITY_SHARE``; 0 = no lane, claims in due order only).
    """

    carries_cadence = True
    """Per-route, workspace and profile cadences are served (:mod:`magpie.queue.cadence`)."""

    def __init__(self, client: redis.Redis, keys: QueueKeys, interval_ms: int, lease_ms: int = 300_000,
                 max_stalled: int = 3, log_limit: int = 100, clock: Callable[[], int] | None = None,
                 dead_after: int = 0, dead_factor: int = 1, priority_share: float = 0.0,
                 wait_replicas: int = 0, wait_timeout_ms: int = 100):
        self.dead_after = int(dead_after)
        self.dead_factor = max(1, int(dead_factor))
        if not 0.0 <= float(priority_share) <= 1.0:
            raise ValueError(f"priority_share must be within 0..1, got {priority_share!r}")
        self.priority_share = float(priority_share)
        self.r = client
        self.keys = keys
        self.interval_ms = int(interval_ms)
        self.lease_ms = int(lease_ms)
        self.max_stalled = int(max_stalled)
        self.log_limit = int(log_limit)
        self.clock = clock
        self.scripts = Scripts(client)
        self._mark = client.register_script(_MARK)
        self._unmark = client.register_script(_UNMARK)  # deletes only: runs on a full Redis (allow-oom)
        self._core = keys.core()
        self.last_pop = {"paused": False, "dead_lettered": 0, "allowed": 0}
        self.wait_replicas = int(wait_replicas)  # MAGPIE_REDIS_WAIT_REPLICAS: WAIT after claims and completions
        self.wait_timeout_ms = int(wait_timeout_ms)  # (see _durable)
        self.wait_short = 0
        self.last_wait: int | None = None
        self._wait_warned = -math.inf

    @classmethod
    def from_settings(cls, settings, client: redis.Redis | None = None) -> "RouteQueue":
        """Build from a :class:`magpie.config.ScheduleSettings` (or a whole Settings, whose ``schedule``
        slice is used): one partition. Raises :class:`QueueError` ``layout_mismatch`` (see :meth:`check_layout`,
        and the partition count recorded in Redis); ``ValueError`` when the schedule is partitioned
        (``MAGPIE_SCHEDULE_PARTITIONS`` > 1, or a repartition under way): :func:`create_provider` builds
        that one (a :class:`magpie.queue.partitioned.PartitionedSchedule`)."""
        sched = getattr(settings, "schedule", settings)
        client = client or redisconn.connect(sched.redis_url)
        from magpie.queue.partitions import check_partition_layout

        n = int(getattr(sched, "partitions", 1) or 1)
        if n > 1 or check_partition_layout(client, sched.prefix, 1):  # N > 1, or a repartition to 1 runs
            raise ValueError("a partitioned schedule (MAGPIE_SCHEDULE_PARTITIONS > 1, or a repartition under "
                             "way) is built by magpie.queue.provider.create_provider")
        q = cls(client, QueueKeys(sched.prefix, sched.shards), interval_ms=sched.interval_ms,
                lease_ms=sched.lease_ms, max_stalled=sched.max_stalled,
                dead_after=sched.dead_after, dead_factor=sched.dead_factor,
                priority_share=sched.priority_share, wait_replicas=sched.wait_replicas,
                wait_timeout_ms=sched.wait_timeout_ms)
        q.check_layout()
        return q

    # -- beside the schedule: what every provider keeps in this Redis -------------------------------
    @property
    def redis(self) -> redis.Redis:
        """The Redis holding what lives beside the schedule (here: the schedule itself too)."""
        return self.r

    @property
    def prefix(self) -> str:
        """The deployment's key prefix (``MAGPIE_REDIS_PREFIX``)."""
        return self.keys.prefix

    @property
    def shards(self) -> int:
        """The shard count (``PROXY_QUEUE_SHARDS``)."""
        return self.keys.shards

    def side_key(self, name: str) -> str:
        """Key ``name`` under the schedule's hash tag in :attr:`redis`."""
        return self.keys.base + name

    def shard_of(self, member: str) -> str:
        """The shard label of a route (its :attr:`Lease.shard`)."""
        return self.keys.shard_of(member)

    def capacity_registry(self):
        """The :class:`magpie.queue.capacity.CapacityRegistry` of this schedule's check engines."""
        from magpie.queue.capacity import CapacityRegistry

        return CapacityRegistry(self.r, self.keys)

    def migrate_payloads(self, cipher, *, encrypt: bool, batch: int = 500, retries: int = 2,
                         progress: Callable[[dict], object] | None = None) -> dict:
        """Rewrite every stored payload with its credentials sealed or in plaintext
        (:func:`magpie.queue.migrate.migrate_payloads`, whose arguments, reply and errors it has)."""
        from magpie.queue.migrate import migrate_payloads

        return migrate_payloads(self, cipher, encrypt=encrypt, batch=batch, retries=retries,
                                progress=progress)

    def check_layout(self) -> None:
        """Record this schedule's shard count on first use; refuse a different one later.

        Raises :class:`QueueError` ``layout_mismatch`` naming ``PROXY_QUEUE_SHARDS`` when the setting
        differs from the count the stored schedule was built with (routes in the other shards would
        never be claimed). Obliterating the schedule clears the record.
        """
        want = str(self.keys.shards)
        have = self.r.get(self.keys.layout)
        if have is None:  # a read first: a full Redis (maxmemory) still serves a known layout
            self.r.set(self.keys.layout, want, nx=True)
            have = self.r.get(self.keys.layout)
        have = _s(have or want)
        if have != want:
            raise QueueError(Refusal.LAYOUT_MISMATCH, detail=(
                f"schedule has {have} shards, PROXY_QUEUE_SHARDS={want}; "
                f"keep {have}, or rebuild after `magpie queue obliterate`"))

    def _now(self) -> int:
        return int(self.clock()) if self.clock else 0

    def _durable(self, script, keys: list, args: list):
        """Run a claim or completion script; with :attr:`wait_replicas` > 0 follow it by ``WAIT
        <wait_replicas> <wait_timeout_ms>`` on the same connection (one round trip, a pipeline on the
        master serving the schedule's slot). :attr:`last_wait` is then the replicas that confirmed the
        write (short of ``wait_replicas``: the write may be lost by a failover; :attr:`wait_short` counts
        such calls), None when no WAIT ran (off, or the slot was moving: the call went the cluster's way).
        Raises what the script raises."""
        self.last_wait = None
        if self.wait_replicas <= 0:
            return script(keys=keys, args=args)
        r = self.r
        if redisconn.is_cluster(r):
            r = r.get_node_from_key(keys[0]).redis_connection  # that master alone, one connection
        try:
            return self._wait_after(r, script, keys, args)
        except (redis.ConnectionError, redis.TimeoutError):
            if redisconn.is_cluster(self.r):  # that master may be gone: learn the slot map again
                redisconn.refresh_slots(self.r)
            raise  # the script may have run: the caller retries as after any lost reply

    def _wait_after(self, r, script, keys: list, args: list):
        for attempt in (0, 1):
            pipe = r.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)  # no SCRIPT EXISTS round trip
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            try:
                raw, acked = pipe.execute()
                break
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                r.script_load(script.script)  # NOSCRIPT: nothing ran; load it and send again
            except (redis.exceptions.MovedError, redis.exceptions.AskError, redis.exceptions.TryAgainError,
                    redis.exceptions.ClusterDownError):
                return script(keys=keys, args=args)  # the slot moves: nothing ran there; redis-py follows
        self.last_wait = int(acked)
        if self.last_wait < self.wait_replicas:
            self.wait_short += 1
            now = time.monotonic()
            if now - self._wait_warned >= 60:  # at most one line a minute per process
                self._wait_warned = now
                log.warning("WAIT %d: only %d replica(s) confirmed a claim or completion within %d ms (%d such "
                            "calls so far); a failover now may lose it", self.wait_replicas, self.last_wait,
                            self.wait_timeout_ms, self.wait_short)
        return raw

    def _one(self, script, shard: str, args: list, client=None):
        return script(keys=self._core + [shard], args=args, client=client)

    # -- worker in hand ------------------------------------------------------------------------------
    def pop(self, count: int = 1, max_inflight: int = 0, lease_ms: int | None = None) -> list[Lease]:
        """Claim up to ``count`` due routes in due-time order across shards (``pop.lua``).

        ``max_inflight`` > 0 caps outstanding live leases. Claims nothing while paused. Expired leases
        are re-claimed here (``stalled=True``) or dead-lettered past ``max_stalled``. Returns the leases;
        :attr:`last_pop` tells whether the queue was paused and how many routes were dead-lettered.
        """
        before = time.time() * 1000
        raw = self._durable(self.scripts.pop, self._core, self.pop_args(count, max_inflight, lease_ms))
        return self.pop_leases(raw, before, time.time() * 1000)

    def pop_leases_now(self, count: int, max_inflight: int = 0, lease_ms: int | None = None,
                       share: float | None = None) -> list[Lease]:
        """:meth:`pop` with the priority lane's share of this call given (:meth:`pop_args`)."""
        before = time.time() * 1000
        raw = self._durable(self.scripts.pop, self._core, self.pop_args(count, max_inflight, lease_ms, share))
        return self.pop_leases(raw, before, time.time() * 1000)

    def pop_args(self, count: int, max_inflight: int = 0, lease_ms: int | None = None,
                 share: float | None = None) -> list:
        """ARGV of one ``pop.lua`` call (KEYS are :meth:`core_keys`): for callers that pipeline claims.
        ``share``: the priority lane's share of this call instead of :attr:`priority_share`."""
        k = self.keys
        share = self.priority_share if share is None else share
        return [self._now(), int(count), int(lease_ms or self.lease_ms), k.payload_prefix, int(max_inflight),
                self.max_stalled, repr(share), k.shard(0)[:-1], k.shards]

    def core_keys(self) -> list[str]:
        """The eleven schedule keys every script receives first (:meth:`QueueKeys.core`)."""
        return self._core

    def pop_leases(self, raw, before: float, after: float) -> list[Lease]:
        """The leases of one ``pop.lua`` reply ``raw`` sent between local times ``before`` and ``after``
        (Unix ms); sets :attr:`last_pop`."""
        offset = float(_s(raw[0])) - (before + after) / 2
        self.last_pop = {"allowed": int(raw[1]), "paused": bool(int(raw[2])), "dead_lettered": int(raw[3])}
        lease_s = _s(raw[4])
        if raw[5:] and isinstance(raw[5][0], bytes):
            return [Lease(m.decode(), p.decode(), prev.decode(), lease_s, shard.decode(), bool(f & 1), f >> 2,
                          offset, bool(f & 2)) for m, p, prev, shard, f in raw[5:]]
        return [Lease(m, p, prev, lease_s, shard, bool(f & 1), f >> 2, offset, bool(f & 2))
                for m, p, prev, shard, f in raw[5:]]

    def mark_started(self, leases: Sequence[Lease]) -> list[Lease]:
        """Record that ``leases`` started checking (``<member>#s`` -> lease score, one script call).

        Only a lease with this mark counts as evidence against its route when it expires (``pop.lua``);
        a completion, release or retry clears it. The mark is fenced on the lease index: a lease no longer
        held (expired and claimed again) writes nothing, so a stale holder cannot overwrite the new
        holder's evidence. Returns the leases not to start: those no longer held, and those that already
        carried their own mark (a process that died started them before: Celery hands a message whose
        process died before taking it to another process; their expiry counts the stall once).
        Raises redis errors only.
        """
        if not leases:
            return []
        args: list = []
        for le in leases:
            args += [le.member, le.lease_score]
        return [leases[int(i) - 1] for i in self._mark(keys=[self.keys.stalls, self.keys.leased], args=args)]

    def unmark_started(self, leases: Sequence[Lease]) -> int:
        """Withdraw the ``<member>#s`` mark of each lease whose mark is still its own lease score.

        For a check that ended without a completion Redis took (Redis refused the write, e.g. at
        ``maxmemory``): its expiry must count no stall. The script only deletes (flag ``allow-oom``), so a
        full Redis still runs it. Returns the marks withdrawn; raises redis errors only.
        """
        if not leases:
            return 0
        args = []
        for le in leases:
            args += [f"{le.member}#s", le.lease_score]
        return int(self._unmark(keys=[self.keys.stalls], args=args))

    def _fenced(self, lease: Lease, res):
        if is_refusal(res):
            if res in (LEASE_LOST, GONE):
                lease.cancel()
            raise refusal(res, lease.member)
        return res

    def renew(self, lease: Lease, lease_ms: int | None = None) -> Lease:
        """Extend ``lease`` (``renew.lua``); returns it with its new ``lease_score``.

        Raises :class:`LeaseLost` (stale holder) or :class:`QueueError` ``gone``; both cancel the lease.
        """
        res = self._one(self.scripts.renew, lease.shard,
                        [self._now(), lease.member, lease.lease_score, int(lease_ms or self.lease_ms)])
        lease.lease_score = _s(self._fenced(lease, res))
        return lease

    def renew_many(self, leases: Sequence[Lease], lease_ms: int | None = None) -> list[int]:
        """Extend many leases in one round trip (``renew.lua`` per lease, pipelined).

        Returns one code per lease: 1 renewed (its ``lease_score`` updated), ``LEASE_LOST``, ``GONE``;
        refused leases get their cancellation token fired.
        """
        if not leases:
            return []
        redisconn.load_scripts(self.r, [self.scripts.renew])
        pipe = self.r.pipeline(transaction=False)
        ms = int(lease_ms or self.lease_ms)
        for le in leases:
            self._one(self.scripts.renew, le.shard, [self._now(), le.member, le.lease_score, ms], client=pipe)
        out = []
        for le, res in zip(leases, pipe.execute(raise_on_error=False)):
            if is_refusal(res):
                le.cancel()
                out.append(res)
            elif isinstance(res, Exception):
                out.append(LEASE_LOST)
                le.cancel()
            else:
                le.lease_score = _s(res)
                out.append(COMPLETED)
        return out

    def release(self, leases: Sequence[Lease]) -> list[int]:
        """Hand leases back unchecked (``release.lua``): each route is claimable again at once, with its
        previous due time, and no stall is counted. Returns one code per lease: 1 released,
        ``LEASE_LOST`` or ``GONE`` (:class:`magpie.errors.Refusal` codes)."""
        codes: list[int] = []
        for i in range(0, len(leases), 500):  # bounded script calls, whatever the caller hands back
            chunk = leases[i: i + 500]
            args: list = [self._now()]
            for le in chunk:
                args += [le.member, le.lease_score, le.previous_score]
            codes += [int(x) for x in self.scripts.release(keys=self._core + [le.shard for le in chunk], args=args)]
        for le in leases:
            le.cancel()
        return codes

    def report_crash(self, lease: Lease, needed: int = 2) -> int:
        """Record that ``lease``'s quarantined check crashed the isolated process it ran in while this
        holder lived (``crashed.lua``): after ``needed`` such crashes in a row the route is dead-lettered
        (reason ``crashed``), else it is claimable again at once, still in quarantine.

        Returns 2 dead-lettered, 1 requeued, or ``LEASE_LOST`` / ``GONE`` (nothing changed). Raises
        ``redis.RedisError`` when Redis is unreachable.
        """
        code = int(self.scripts.crashed(keys=self._core + [lease.shard],
                                        args=[self._now(), lease.member, lease.lease_score, int(needed)]))
        lease.cancel()
        return code

    def complete(self, leases: Sequence[Lease], interval_ms: int | None = None) -> list[int]:
        """Finish the cycles of ``leases`` in one script call (``complete.lua``); writes no payload.

        Returns one code per lease: 1 completed, ``LEASE_LOST`` (stale; nothing changed), ``GONE``.
        Refused leases get their cancellation token fired.
        """
        return self.complete_with_results(leases, None, None, interval_ms).codes

    def complete_with_results(self, leases: Sequence[Lease], results: Sequence[dict[str, str] | None] | None,
                              stream: StreamTarget | None, interval_ms: int | None = None,
                              desired: Sequence[str | None] | None = None) -> Completion:
        """Complete ``leases``, apply the holders' ownership changes and append ``results[i]`` (stream entry
        fields, or None) of each completed lease to ``stream``, all in one atomic script call
        (``complete.lua``; see :mod:`magpie.queue.completion`).

        ``desired[i]`` (optional): the holder's desired payload for lease ``i`` (JSON of any encoding; only
        its ``"w"`` list is read): only the workspace ids added or removed between ``lease.payload`` and it
        are applied to the payload as stored now; with no workspace left the route is removed (code
        ``REMOVED``, no result appended). Returns a :class:`Completion`; refused leases get their
        cancellation token fired. With ``stream.policy == "refuse"`` and no room, nothing changes and
        ``full`` is True.
        """
        if not leases:
            return Completion()
        keys, args = self.complete_call(leases, results, stream, interval_ms, desired)
        return self.completion_of(leases, self._durable(self.scripts.complete, keys, args))

    def complete_call(self, leases: Sequence[Lease], results, stream: StreamTarget | None,
                      interval_ms: int | None = None, desired=None) -> tuple[list, list]:
        """``(KEYS, ARGV)`` of the ``complete.lua`` call :meth:`complete_with_results` makes (for callers that
        pipeline completions of several schedules; :meth:`completion_of` reads the reply)."""
        k = self.keys
        args: list = [self._now(), int(interval_ms or self.interval_ms), stream.policy if stream else "",
                      stream.maxlen if stream else 0, stream.group if stream else "", k.payload_prefix,
                      k.logs_prefix, self.dead_after, self.dead_factor]
        for i, le in enumerate(leases):
            entry = results[i] if results is not None else None
            fields = entry if stream is not None else None
            want = desired[i] if desired is not None else None
            alive = -1 if not entry or "alive" not in entry else (1 if str(entry["alive"]) == "1" else 0)
            args += [le.member, le.lease_score, le.previous_score, alive]
            args += [0] if want is None else [2, le.payload, want]
            args.append(len(fields) if fields else 0)
            if fields:
                for key, v in fields.items():
                    args += [key, v]
        keys = self._core + ([stream.key] if stream else []) + [le.shard for le in leases]
        return keys, args

    def completion_of(self, leases: Sequence[Lease], raw) -> Completion:
        """The :class:`Completion` of ``complete.lua`` reply ``raw`` for ``leases``; fires the cancellation
        token of each refused lease."""
        n = len(leases)
        out = Completion(dropped=int(raw[0]), trimmed=int(raw[1]), full=bool(int(raw[2])))
        if out.full:
            return out
        out.codes = [int(x) for x in raw[3: 3 + n]]
        out.ids = [_s(x) or None for x in raw[3 + n: 3 + 2 * n]]
        for le, c in zip(leases, out.codes):
            if c not in (COMPLETED, REMOVED):
                le.cancel()
        return out

    def complete_one(self, lease: Lease) -> None:
        """Complete a single lease; raises :class:`LeaseLost` / :class:`QueueError` when refused."""
        code = self.complete([lease])[0]
        if code != COMPLETED:
            raise refusal(code, lease.member)

    def complete_with_payload(self, lease: Lease, desired_payload: str, interval_ms: int | None = None) -> str:
        """Complete ``lease`` and apply the worker's ownership change (:meth:`complete_with_results`).

        Only the workspace ids added or removed between ``lease.payload`` (the original snapshot) and
        ``desired_payload`` are applied to the payload as stored now: workspaces added concurrently by
        an import and the current credentials stay. Returns ``"completed"`` or ``"removed"`` (no
        workspace left). Raises :class:`LeaseLost`, :class:`QueueError` ``gone`` or ``bad_payload``.
        """
        comp = self.complete_with_results([lease], None, None, interval_ms, desired=[desired_payload])
        code = comp.codes[0]
        if code not in (COMPLETED, REMOVED):
            raise refusal(code, lease.member)
        return "removed" if code == REMOVED else "completed"

    def retry(self, lease: Lease, delay_ms: int) -> int:
        """End the cycle early and re-check after ``delay_ms`` (``retry.lua``), e.g. on the Backoff curve
        when the judge is unreachable. Returns the route's retry count; raises :class:`LeaseLost`/gone."""
        res = self._one(self.scripts.retry, lease.shard, [self._now(), lease.member, lease.lease_score,
                                                          int(delay_ms)])
        return int(self._fenced(lease, int(res)))

    def progress(self, lease: Lease, value: str) -> None:
        """Record progress text for a leased route (fenced). Raises :class:`LeaseLost` / gone."""
        self._fenced(lease, int(self._one(self.scripts.progress, lease.shard,
                                          [lease.member, lease.lease_score, value])))

    def log(self, lease: Lease, line: str) -> int:
        """Append ``line`` to the route's log (fenced, trimmed to ``log_limit``); returns its length."""
        return int(self._fenced(lease, int(self._one(self.scripts.log, lease.shard, [
            self.keys.logs_prefix, lease.member, lease.lease_score, line, self.log_limit]))))

    def remove(self, lease: Lease) -> None:
        """Delete a leased route (``remove.lua``), fenced on the lease score and the original payload.

        Raises :class:`LeaseLost`, :class:`QueueError` ``gone`` or ``payload_changed`` (a concurrent
        import changed the payload after the claim; nothing is removed).
        """
        k = self.keys
        res = int(self._one(self.scripts.remove, lease.shard, [
            k.payload_prefix, k.logs_prefix, lease.member, lease.lease_score, lease.payload]))
        self._fenced(lease, res)

    # -- import and time controls --------------------------------------------------------------------
    def schedule(self, items: Iterable[tuple[str, str]], total: int | None = None, start_index: int = 0,
                 batch: int = 500, slots: Sequence[int] | None = None) -> dict[str, int]:
        """Add routes to the schedule (``schedule.lua``), first due times spread over the interval.

        Args:
            items: ``(route_hash, payload_text)`` pairs; payload text as :meth:`Payload.encode` makes it.
            total: number of routes the spread is computed over (default: ``len(items)``).
            start_index: index of the first item within that spread (for chunked imports).
            slots: each item's own index within the spread instead (the partitioned schedule's share of a
                whole import); ``start_index`` is then ignored.
        Route i of ``total`` becomes due at now + i * interval / total. A route already stored keeps its
        due time; only the new payload's workspace ids are merged into the stored one. With
        :attr:`priority_share` > 0 new routes join the priority lane, claimed ahead of the due backlog.
        Returns ``{"new": n, "merged": n, "unchanged": n}``.
        """
        pipe = self.r.pipeline(transaction=False)
        self.schedule_calls(pipe, items, total, start_index, batch, slots)
        return self.schedule_counts(pipe.execute())

    def schedule_calls(self, pipe, items: Iterable[tuple[str, str]], total: int | None = None,
                       start_index: int = 0, batch: int = 500, slots: Sequence[int] | None = None) -> int:
        """Queue the ``schedule.lua`` calls of :meth:`schedule` on pipeline ``pipe``; returns how many (their
        replies go to :meth:`schedule_counts`)."""
        items = list(items)
        total = total or len(items) or 1
        step = self.interval_ms / total
        k = self.keys
        calls = 0
        redisconn.load_scripts(self.r, [self.scripts.schedule])  # a cluster pipeline loads none
        for off in range(0, len(items), batch):
            chunk = items[off: off + batch]
            args: list = [self._now(), k.payload_prefix, "1" if self.priority_share > 0 else "0"]
            for j, (h, payload) in enumerate(chunk):
                slot = slots[off + j] if slots is not None else start_index + off + j
                args += [h, payload, int(slot * step)]
            self.scripts.schedule(keys=self._core + [k.shard_of(h) for h, _ in chunk], args=args, client=pipe)
            calls += 1
        return calls

    @staticmethod
    def schedule_counts(replies) -> dict[str, int]:
        """``{"new", "merged", "unchanged"}`` summed over ``schedule.lua`` replies."""
        counts = {"new": 0, "merged": 0, "unchanged": 0}
        for res in replies:
            for name, v in zip(("new", "merged", "unchanged"), res):
                counts[name] += int(v)
        return counts

    def _at(self, member: str, mode: str, value: int) -> int:
        res = self._one(self.scripts.enqueue_at, self.keys.shard_of(member),
                        [self._now(), member, mode, int(value), "1" if self.priority_share > 0 else "0"])
        if is_refusal(res):
            raise refusal(res, member)
        return int(float(_s(res)))

    def enqueue_at(self, member: str, at_ms: int) -> int:
        """Check route ``member`` at Unix ms ``at_ms`` instead of its current due time; the route keeps one
        schedule entry and resumes its cadence after that check. Returns the due time (ms).
        An expired lease (its holder vanished) ends here. Raises :class:`QueueError` ``gone``, ``leased`` (a
        live lease: a check is running now) or ``dead``."""
        return self._at(member, "at", at_ms)

    def enqueue_in(self, member: str, delay_ms: int = 0) -> int:
        """Like :meth:`enqueue_at`, ``delay_ms`` from now on the Redis clock; ``enqueue_in(h, 0)`` = check now."""
        return self._at(member, "in", delay_ms)

    def respread(self, interval_ms: int | None = None, batch: int = 1000) -> dict[str, int]:
        """Re-spread every unleased route evenly across ``interval_ms`` (default: this queue's interval).

        Shard by shard, ``batch`` routes per :meth:`respread_batch` call, so memory stays bounded by one
        batch whatever the schedule's size. Run it under the ``respread`` leader lock (``magpie queue
        respread`` does). Leased routes keep their lease; their completion then applies the new interval.
        Returns ``{"moved", "leased", "missing"}`` (``missing`` is always 0: the walk sees only members).
        """
        interval = int(interval_ms or self.interval_ms)
        total = self.route_count()
        counts = {"moved": 0, "leased": 0, "missing": 0}
        placed = 0
        for n in range(self.keys.shards):
            cursor = "0"
            while True:
                step = self.respread_batch(n, cursor, count=batch, placed=placed, total=total,
                                           interval_ms=interval)
                counts["moved"] += step["moved"]
                counts["leased"] += step["leased"]
                placed, cursor = step["placed"], step["cursor"]
                if cursor == "0":
                    break
        return counts

    def route_count(self) -> int:
        """Routes in every shard (scheduled and leased; dead letters are not in the shards)."""
        pipe = self.r.pipeline(transaction=False)
        for shard in self.keys.all_shards():
            pipe.zcard(shard)
        return sum(int(n) for n in pipe.execute())

    def respread_batch(self, shard: int, cursor: str = "0", *, count: int = 1000, placed: int = 0,
                       total: int = 1, interval_ms: int | None = None, progress_key: str | None = None,
                       run: str | None = None) -> dict:
        """Move one bounded batch of shard number ``shard`` (``lua/respread_batch.lua``).

        Route number ``p`` of a respread (counted over every shard, leased ones included) becomes due at
        now + ``(p mod total) * interval_ms / total``; leased routes keep their lease.

        Args:
            shard: shard number, 0..shards-1.
            cursor: the shard's walk cursor (``"0"`` starts it; the previous reply's ``cursor`` goes on).
            count: routes per batch (a ZSCAN COUNT hint: a small shard may come whole).
            placed: routes numbered before this batch; total: routes of the whole respread.
            interval_ms: spread width in ms (default: this queue's interval).
            progress_key / run: a hash holding the run's progress; when given, the batch runs only while
                its ``run`` field equals ``run`` and records ``cursor``, ``placed``, ``moved``, ``leased``
                and ``shard`` (+1 at the shard's end) there atomically with the move.
        Returns:
            ``{"cursor": str ("0": shard done), "moved": int, "leased": int, "placed": int,
            "superseded": bool}``; ``superseded`` True (nothing changed) when ``run`` no longer matches.
        """
        keys = self._core + [self.keys.shard(int(shard))] + ([progress_key] if progress_key else [])
        args = [self._now(), str(cursor), int(count), int(placed), max(1, int(total)),
                int(interval_ms or self.interval_ms), run or ""]
        reply = self.scripts.respread_batch(keys=keys, args=args)
        if _s(reply[0]) == "superseded":
            return {"cursor": str(cursor), "moved": 0, "leased": 0, "placed": int(placed), "superseded": True}
        return {"cursor": _s(reply[0]), "moved": int(reply[1]), "leased": int(reply[2]), "placed": int(reply[3]),
                "superseded": False}

    # -- cadence (magpie.queue.cadence) ---------------------------------------------------------------
    def set_route_interval(self, member: str, interval_ms: int | None) -> dict:
        """Give one route its own interval, or clear it with None
        (:func:`magpie.queue.cadence.set_route_interval`, whose reply and errors it has)."""
        from magpie.queue.cadence import set_route_interval

        return set_route_interval(self, member, interval_ms)

    def set_workspace_cadence(self, workspace_id: int, *, interval_ms: int = 0, dead_after: int = 0,
                              dead_factor: int = 0, progress=None) -> dict:
        """Set or clear a workspace's interval and dead-route policy and walk its routes
        (:func:`magpie.queue.cadence.set_workspace_cadence`, whose arguments, reply and errors it has)."""
        from magpie.queue.cadence import set_workspace_cadence

        return set_workspace_cadence(self, workspace_id, interval_ms=interval_ms, dead_after=dead_after,
                                     dead_factor=dead_factor, progress=progress)

    def set_profile_cadence(self, workspace_id: int, *, interval_ms: int = 0, dead_after: int = 0,
                            dead_factor: int = 0, progress=None) -> dict:
        """Set or clear the interval and dead-route policy of a workspace's check profile and walk its
        routes (:func:`magpie.queue.cadence.set_profile_cadence`, whose arguments, reply and errors it has)."""
        from magpie.queue.cadence import set_profile_cadence

        return set_profile_cadence(self, workspace_id, interval_ms=interval_ms, dead_after=dead_after,
                                   dead_factor=dead_factor, progress=progress)

    # -- operator plane -------------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop claiming: once this returns, no ``pop`` claims anything. Leases already out may finish."""
        self.r.set(self.keys.paused, "1")

    def resume(self) -> None:
        self.r.delete(self.keys.paused)

    def is_paused(self) -> bool:
        return bool(self.r.exists(self.keys.paused))

    def drain(self, batch: int = 1000, progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
        """Unschedule and delete every route that is due or waiting, sparing leased ones.

        ``progress`` is called after each script call with ``(routes looked at, routes at the start)``.
        Returns ``{"due": n, "waiting": n, "leased_spared": n}``.
        """
        k = self.keys
        out = {"due": 0, "waiting": 0, "leased_spared": 0}
        total = self.route_count() if progress is not None else 0
        for shard in k.all_shards():
            offset = 0
            while True:
                due, waiting, leased, more = self._one(self.scripts.drain, shard, [
                    self._now(), k.payload_prefix, k.logs_prefix, int(batch), offset])
                out["due"] += int(due)
                out["waiting"] += int(waiting)
                out["leased_spared"] += int(leased)
                offset += int(leased)
                if progress is not None:
                    done = sum(out.values())
                    progress(done, max(total, done))
                if not int(more):
                    break
        return out

    def obliterate(self, force: bool = False, batch: int = 1000) -> tuple[str, int]:
        """Delete the whole schedule keyspace, at most ``batch`` routes per call.

        Returns ``("more", deleted)`` until a call returns ``("done", deleted)``. Raises
        :class:`QueueError` ``not_paused`` unless paused, ``active_leases`` while leases are live unless
        ``force``.
        """
        k = self.keys
        res = self.scripts.obliterate(keys=self._core + [k.layout] + k.all_shards(), args=[
            self._now(), k.payload_prefix, k.logs_prefix, int(batch), "1" if force else "0"])
        if is_refusal(res):
            raise refusal(res)
        status, deleted = res
        return _s(status), int(deleted)

    def remove_route(self, member: str, force: bool = False, expected: str | None = None) -> None:
        """Operator removal of one route (``admin_remove.lua``).

        Args:
            member: the route hash. force: remove even under a live lease.
            expected: the payload text the caller read (:meth:`payload`); when given, the removal is
                refused if the stored payload differs (a concurrent import or update). None skips that fence.
        Raises :class:`QueueError` ``gone``; ``active_leases`` while a live lease is out unless ``force``;
        ``payload_changed`` (nothing removed).
        """
        k = self.keys
        res = int(self._one(self.scripts.admin_remove, k.shard_of(member), [
            self._now(), k.payload_prefix, k.logs_prefix, member, "1" if force else "0",
            "" if expected is None else expected]))
        if is_refusal(res):
            raise refusal(res, member)

    def update(self, member: str, payload: str, expected: str, force: bool = False) -> None:
        """Operator replacement of a route's payload (``update.lua``); the schedule is untouched.

        Args:
            member: the route hash. payload: the new payload text (:meth:`Payload.encode`).
            expected: the payload text the caller built ``payload`` from (:meth:`payload`).
            force: update even under a live lease.
        Raises :class:`QueueError` ``gone``; ``payload_changed`` when the stored payload is no longer
        ``expected`` (an import added a workspace since the read); ``active_leases`` under a live lease
        unless ``force``. A refusal changes nothing.
        """
        res = int(self._one(self.scripts.update, self.keys.shard_of(member), [
            self._now(), self.keys.payload_prefix, member, payload, expected, "1" if force else "0"]))
        if is_refusal(res):
            raise refusal(res, member)

    def dead_letters(self, limit: int = 100) -> list[dict]:
        """Dead-lettered routes, oldest first: ``[{"member", "dead_at_ms", "reason", "stalls"}]``."""
        return reads.dead_letters(self.r, self.keys, limit)

    def reprocess(self, member: str) -> int:
        """Put a dead-lettered route back, due now, stall count reset. Returns its due time (ms).
        Raises :class:`QueueError` ``not_dead`` or ``gone``."""
        res = self._one(self.scripts.reprocess, self.keys.shard_of(member),
                        [self._now(), member, self.keys.payload_prefix])
        if is_refusal(res):
            raise refusal(res, member)
        return int(float(_s(res)))

    # -- reads (magpie.queue.reads) ----------------------------------------------------------------
    def server_time_ms(self) -> int:
        """Now in Unix ms: the Redis server clock (or the test clock)."""
        return int(self.clock()) if self.clock else reads.server_time_ms(self.r)

    def score(self, member: str) -> str | None:
        """Current score of a route as a '%.2f' string, or None when not scheduled."""
        v = self.r.zscore(self.keys.shard_of(member), member)
        return None if v is None else f"{v:.2f}"

    def payload(self, member: str) -> str | None:
        """The stored payload text of a route, or None."""
        v = self.r.get(self.keys.payload(member))
        return None if v is None else _s(v)

    def payloads(self, members: Sequence[str]) -> list[str | None]:
        """The stored payload texts of ``members`` in order (None where missing): one ``MGET``."""
        if not members:
            return []
        return [None if v is None else _s(v) for v in self.r.mget([self.keys.payload(m) for m in members])]

    def dead_count(self) -> int:
        """How many routes are dead-lettered (one ``ZCARD``)."""
        return int(self.r.zcard(self.keys.dead))

    def in_flight(self, limit: int = 100) -> list[dict]:
        """Outstanding leases, soonest expiry first: ``[{"member", "lease_score", "expires_in_s",
        "silent_seconds"}]`` (seconds; negative ``expires_in_s``: expired, not yet re-claimed). Silence is
        estimated as the time since the lease was last given or renewed with :attr:`lease_ms`."""
        now = self.server_time_ms()
        out = []
        for m, sc in self.r.zrange(self.keys.leased, 0, int(limit) - 1, withscores=True):
            exp = sc - 0.5
            out.append({"member": _s(m), "lease_score": f"{sc:.2f}",
                        "expires_in_s": round((exp - now) / 1000, 3),
                        "silent_seconds": round(max(0.0, now - (exp - self.lease_ms)) / 1000, 3)})
        return out

    def inspect(self, member: str) -> dict:
        """Everything known about one route now (:func:`magpie.queue.reads.inspect`)."""
        return reads.inspect(self.r, self.keys, member, self.server_time_ms())

    def status(self) -> dict:
        """Per-shard counts now (:func:`magpie.queue.reads.status`)."""
        return reads.status(self.r, self.keys, self.server_time_ms())
