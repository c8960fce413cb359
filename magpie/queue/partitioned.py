"""The partitioned Redis schedule (``MAGPIE_SCHEDULE_PARTITIONS`` > 1): one :class:`RouteQueue` per partition.

Every route lives in exactly one partition (:func:`magpie.queue.partitions.partition_of` its hash), each
partition under its own hash tag, so every script call names keys of one tag only (single-slot on a Redis
Cluster). :class:`PartitionedSchedule` implements the whole :class:`~magpie.queue.provider.ScheduleProvider`:

* per-lease calls go to the partition named by the lease's shard key (``<prefix>{p3}:proxy_queue:7``), so a
  lease taken before a repartition still ends where it was taken; per-route calls go to the route's
  partition (during a repartition: the new layout's partition, then the old one);
* batch calls group leases by partition (one script call per partition) and put the per-item codes back in
  the caller's order; ``complete_with_results`` appends each partition's results to that partition's
  results stream (:func:`~magpie.queue.partitions.results_stream_key`);
* :meth:`PartitionedSchedule.pop` claims fairly: the starting partition rotates from call to call, the count
  is split evenly, and what a partition could not fill is asked of the partitions that filled their share
  (they may have more due work). Due order holds within a partition; across partitions it is approximate
  (docs/design.md, invariant 7). A ``max_inflight`` cap is deployment-wide: the live leases of every
  partition are summed first and each partition's ``pop.lua`` is capped at its own live count plus its
  share, atomically; two claimers at once can overshoot the cap by at most what they asked together of
  different partitions in the same instant (promote claims under its budget, see :mod:`magpie.pipeline.promote`).

Deployment-wide side state (engine capacity, promote's budget, leader locks, the interval job's state, the
rebuild marker, the partition layout record) lives in ONE place: the ``{default}`` tag, as on one partition.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

import redis

from magpie.base import redisconn
from magpie.errors import Refusal
from magpie.queue.completion import Completion, StreamTarget
from magpie.queue.keys import QueueKeys
from magpie.queue.lease import Lease
from magpie.queue.lease import text as _s
from magpie.queue.partitions import (
    DEFAULT, check_partition_layout, is_tagged, layout_key, partition_names, partition_of, repartition_key,
    results_stream_key,
)
from magpie.queue.refusals import COMPLETED, GONE, LEASE_LOST, QueueError, is_refusal
from magpie.queue.routequeue import RouteQueue


def reader(client: redis.Redis, settings):
    """The schedule for reads only (the dashboard, the metrics exporter): no layout check, nothing written.
    A :class:`RouteQueue` for one partition, else a :class:`PartitionedSchedule` (seeing both layouts while
    a repartition runs). ``settings``: a :class:`magpie.config.Settings`."""
    n = int(getattr(settings, "schedule_partitions", 1) or 1)
    mig = {_s(k): _s(v) for k, v in client.hgetall(repartition_key(settings.redis_prefix)).items()}
    old = int(mig["from"]) if mig.get("to") and int(mig["to"]) == n else None
    kw = dict(interval_ms=int(settings.check_interval * 1000), lease_ms=int(settings.lease_seconds * 1000),
              max_stalled=settings.max_stalled)
    if n == 1 and not old:
        return RouteQueue(client, QueueKeys(settings.redis_prefix, settings.queue_shards), **kw)
    return PartitionedSchedule(client, settings.redis_prefix, settings.queue_shards, n, old_partitions=old, **kw)


def run_scripts(client: redis.Redis, calls: list[tuple[object, list, list]], raise_errors: bool = True) -> list:
    """Run ``calls`` (``(redis-py Script, KEYS, ARGV)``) in one pipelined round trip by ``EVALSHA``.

    One call runs as the script object does. Several skip redis-py's per-pipeline ``SCRIPT EXISTS`` round
    trip: a call answered ``NOSCRIPT`` (Redis restarted or flushed its script cache) did not run, so its
    script is loaded and that call alone is sent again. Returns the replies in order; raises the first
    other error (after every reply is in: the calls that ran are not repeated), or with ``raise_errors``
    False returns it in its place."""
    if len(calls) == 1 and raise_errors:
        script, keys, args = calls[0]
        return [script(keys=keys, args=args)]
    pipe = client.pipeline(transaction=False)
    for script, keys, args in calls:
        pipe.evalsha(script.sha, len(keys), *keys, *args)
    replies = pipe.execute(raise_on_error=False)
    again = [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)]
    for i in again:
        script, keys, args = calls[i]
        try:
            replies[i] = script(keys=keys, args=args)  # loads it, then runs it
        except redis.exceptions.RedisError as exc:
            replies[i] = exc
    for r in replies:
        if isinstance(r, Exception) and raise_errors:
            raise r
    return replies


def tag_of(key: str) -> str | None:
    """The hash tag of a key (``"p3"`` of ``"x{p3}:proxy_queue:1"``), or None."""
    i = key.find("{")
    j = key.find("}", i + 1)
    return key[i + 1:j] if i >= 0 and j > i + 1 else None


class PartitionedSchedule:
    """A schedule over ``partitions`` :class:`RouteQueue` partitions sharing ``prefix`` and ``shards``.

    Args:
        client: redis-py client.
        prefix: the deployment's key prefix; shards: shards per partition (1..128).
        partitions: the partition count (1..1024) of the layout routes belong to.
        old_partitions: while a repartition runs, the count routes are moving from (claims and route
            look-ups then see both layouts); None otherwise.
        tagged: results streams carry the partition's tag (default: ``partitions > 1``; a cluster forces it).
        **kw: what :class:`RouteQueue` takes (``interval_ms``, ``lease_ms``, ``max_stalled``, ``log_limit``,
            ``clock``, ``dead_after``, ``dead_factor``, ``priority_share``).
    Raises ``ValueError`` for counts out of range.
    """

    carries_cadence = True
    """Cadences per route, workspace and profile live in each partition (:mod:`magpie.queue.cadence`)."""

    def __init__(self, client: redis.Redis, prefix: str, shards: int = 16, partitions: int = 4, *,
                 old_partitions: int | None = None, tagged: bool | None = None, interval_ms: int = 60_000,
                 **kw):
        self.r = client
        self._prefix = prefix
        self.partitions = int(partitions)
        self.names = partition_names(self.partitions)
        self.old_names = partition_names(old_partitions) if old_partitions else None
        every = list(self.names) + [n for n in (self.old_names or []) if n not in self.names]
        self.tagged = is_tagged(self.partitions) if tagged is None else bool(tagged)
        self.parts: list[RouteQueue] = [RouteQueue(client, QueueKeys(prefix, shards, name), interval_ms=interval_ms,
                                                   **kw) for name in every]
        self.by_name = {q.keys.name: q for q in self.parts}
        self.side = QueueKeys(prefix, shards, DEFAULT)
        self.interval_ms = int(interval_ms)
        self.lease_ms = self.parts[0].lease_ms
        self.clock = self.parts[0].clock
        self.last_pop = {"allowed": 0, "paused": False, "dead_lettered": 0}
        self._turn = 0

    @classmethod
    def from_settings(cls, settings, client: redis.Redis | None = None) -> "PartitionedSchedule":
        """Build from a :class:`magpie.config.ScheduleSettings` (or a whole Settings). Raises
        :class:`QueueError` ``layout_mismatch`` (:func:`check_partition_layout`, and each partition's shard
        count check)."""
        sched = getattr(settings, "schedule", settings)
        client = client or redisconn.connect(sched.redis_url)
        n = int(getattr(sched, "partitions", 1) or 1)
        old = check_partition_layout(client, sched.prefix, n)
        q = cls(client, sched.prefix, sched.shards, n, old_partitions=old,
                tagged=is_tagged(n, redisconn.is_cluster(client)), interval_ms=sched.interval_ms,
                lease_ms=sched.lease_ms, max_stalled=sched.max_stalled, dead_after=sched.dead_after,
                dead_factor=sched.dead_factor, priority_share=sched.priority_share,
                wait_replicas=sched.wait_replicas, wait_timeout_ms=sched.wait_timeout_ms)
        q.check_layout()
        return q

    # -- routing ---------------------------------------------------------------------------------------
    def partition(self, member: str) -> RouteQueue:
        """The partition a route belongs to in the current layout."""
        return self.by_name[self.names[partition_of(member, self.partitions)]]

    def _homes(self, member: str) -> list[RouteQueue]:
        home = self.partition(member)
        if not self.old_names:
            return [home]
        old = self.by_name[self.old_names[partition_of(member, len(self.old_names))]]
        return [home] if old is home else [home, old]

    def _where(self, member: str) -> RouteQueue:
        """The partition holding ``member`` now (during a repartition: new layout first, then old)."""
        homes = self._homes(member)
        if len(homes) == 1:
            return homes[0]
        for q in homes:
            pipe = self.r.pipeline(transaction=False)
            pipe.zscore(q.keys.shard_of(member), member)
            pipe.zscore(q.keys.dead, member)
            if any(v is not None for v in pipe.execute()):
                return q
        return homes[0]

    def _where_many(self, members: Sequence[str]) -> list[RouteQueue]:
        """:meth:`_where` of each member, in one round trip while a repartition runs (none otherwise)."""
        homes = [self._homes(m) for m in members]
        if all(len(h) == 1 for h in homes):
            return [h[0] for h in homes]
        pipe = self.r.pipeline(transaction=False)
        for m, h in zip(members, homes):
            for q in h:
                pipe.zscore(q.keys.shard_of(m), m)
                pipe.zscore(q.keys.dead, m)
        res = iter(pipe.execute())
        out = []
        for h in homes:
            found = [q for q in h if any([next(res) is not None, next(res) is not None])]
            out.append(found[0] if found else h[0])
        return out

    def holder(self, member: str) -> RouteQueue:
        """The partition (a :class:`RouteQueue`) holding ``member`` now; its home partition when stored nowhere."""
        return self._where(member)

    def _of_lease(self, lease: Lease) -> RouteQueue:
        q = self.by_name.get(tag_of(lease.shard) or "")
        return q if q is not None else self.partition(lease.member)

    def _grouped(self, leases: Sequence[Lease]) -> list[tuple[RouteQueue, list[int]]]:
        groups: dict[str, tuple[RouteQueue, list[int]]] = {}
        for i, le in enumerate(leases):
            q = self._of_lease(le)
            groups.setdefault(q.keys.name, (q, []))[1].append(i)
        return list(groups.values())

    def _each_code(self, leases, call) -> list[int]:
        out = [0] * len(leases)
        for q, idx in self._grouped(leases):
            for i, c in zip(idx, call(q, [leases[i] for i in idx])):
                out[i] = c
        return out

    # -- beside the schedule ---------------------------------------------------------------------------
    @property
    def redis(self) -> redis.Redis:
        """The Redis holding the schedule and what lives beside it."""
        return self.r

    @property
    def prefix(self) -> str:
        """The deployment's key prefix (``MAGPIE_REDIS_PREFIX``)."""
        return self._prefix

    @property
    def shards(self) -> int:
        """Shards per partition (``PROXY_QUEUE_SHARDS``)."""
        return self.side.shards

    @property
    def respread_units(self) -> int:
        """Shard walks of a whole respread: partitions x shards (:meth:`respread_batch` numbers them)."""
        return len(self.parts) * self.side.shards

    def side_key(self, name: str) -> str:
        """Key ``name`` of deployment-wide side state, always under ``{default}``: ``<prefix>{default}:<name>``."""
        return self.side.base + name

    def shard_of(self, member: str) -> str:
        """The shard key of a route in its partition (its :attr:`Lease.shard`)."""
        return self._where(member).keys.shard_of(member)

    def capacity_registry(self):
        """The one :class:`~magpie.queue.capacity.CapacityRegistry` of the deployment (``{default}`` tag)."""
        from magpie.queue.capacity import CapacityRegistry

        return CapacityRegistry(self.r, self.side)

    def check_layout(self) -> None:
        """Each partition's shard-count check (:meth:`RouteQueue.check_layout`)."""
        for q in self.parts:
            q.check_layout()

    def migrate_payloads(self, cipher, *, encrypt: bool, batch: int = 500, retries: int = 2,
                         progress: Callable[[dict], object] | None = None) -> dict:
        """:meth:`RouteQueue.migrate_payloads` over every partition; the counts summed."""
        total: dict = {}
        for q in self.parts:
            for k, v in q.migrate_payloads(cipher, encrypt=encrypt, batch=batch, retries=retries,
                                           progress=progress).items():
                total[k] = total.get(k, 0) + v if isinstance(v, (int, float)) else v
        return total

    # -- worker in hand --------------------------------------------------------------------------------
    def pop(self, count: int = 1, max_inflight: int = 0, lease_ms: int | None = None) -> list[Lease]:
        """Claim up to ``count`` due routes over every partition (see the module docstring for fairness
        and the cap). :attr:`last_pop`: ``allowed`` summed, ``paused`` True when every partition asked was
        paused, ``dead_lettered`` summed."""
        parts = self.parts
        k = len(parts)
        start = self._turn % k
        self._turn += 1
        order = parts[start:] + parts[:start]
        count = int(count)
        live: dict[str, int] = {}
        if max_inflight and max_inflight > 0:
            now = self.server_time_ms()
            pipe = self.r.pipeline(transaction=False)
            for q in order:
                pipe.zcount(q.keys.leased, f"({now}", "+inf")
            live = {q.keys.name: int(n) for q, n in zip(order, pipe.execute())}
            count = min(count, max(0, int(max_inflight) - sum(live.values())))
        self.last_pop = {"allowed": 0, "paused": False, "dead_lettered": 0}
        if count <= 0:
            return []
        share = [count // k + (1 if i < count % k else 0) for i in range(k)]
        got: list[Lease] = []
        asked = [(q, n) for q, n in zip(order, share) if n > 0]
        full, paused = [], []
        lanes = self._lanes(count, [n for _, n in asked])
        calls = [(q.scripts.pop, q.core_keys(), q.pop_args(n, live.get(q.keys.name, 0) + n if live else 0,
                                                           lease_ms, lane))
                 for (q, n), lane in zip(asked, lanes)]
        before = time.time() * 1000
        replies = run_scripts(self.r, calls)
        after = time.time() * 1000
        for (q, n), raw in zip(asked, replies):
            leases = q.pop_leases(raw, before, after)
            self._tally(q)
            paused.append(q.last_pop["paused"])
            got += leases
            if len(leases) >= n:
                full.append(q)
        untried = [q for q, n in zip(order, share) if n == 0]
        granted = {q.keys.name: lane for (q, n), lane in zip(asked, lanes)}
        lane_left = self._lane_quota(count) - sum(int((granted[q.keys.name] or 0) * n) for q, n in asked
                                                  if q in full)
        for q in full + untried:  # leftovers: partitions that filled their share, then those not asked
            left = count - len(got)
            if left <= 0:
                break
            cap = live.get(q.keys.name, 0) + sum(1 for le in got if self._of_lease(le) is q) + left if live else 0
            lane = None if lanes[0] is None else (max(0, lane_left) + 0.5) / left
            leases = q.pop_leases_now(left, cap, lease_ms, None if lane is None else min(1.0, lane))
            self._tally(q)
            paused.append(q.last_pop["paused"])
            got += leases
        self.last_pop["paused"] = bool(paused) and all(paused)
        return got

    def _lane_quota(self, count: int) -> int:
        return int(count * self.parts[0].priority_share)

    def _lanes(self, count: int, asked: list[int]) -> list[float | None]:
        """The priority share each partition's claim gets, so that the lanes take ``floor(count * share)``
        of the whole claim (as on one partition), not the sum of per-partition floors."""
        share = self.parts[0].priority_share
        if share <= 0:
            return [None] * len(asked)
        lane = [int(n * share) for n in asked]
        extra = int(count * share) - sum(lane)
        for i, n in enumerate(asked):
            if extra <= 0:
                break
            if lane[i] < n:
                lane[i] += 1
                extra -= 1
        return [min(1.0, (x + 0.5) / n) for x, n in zip(lane, asked)]

    def _tally(self, q: RouteQueue) -> None:
        self.last_pop["allowed"] += q.last_pop["allowed"]
        self.last_pop["dead_lettered"] += q.last_pop["dead_lettered"]

    def mark_started(self, leases: Sequence[Lease]) -> list[Lease]:
        """:meth:`RouteQueue.mark_started` per partition; the already-marked leases in the caller's order."""
        again = set()
        for q, idx in self._grouped(leases):
            again |= {id(le) for le in q.mark_started([leases[i] for i in idx])}
        return [le for le in leases if id(le) in again]

    def unmark_started(self, leases: Sequence[Lease]) -> int:
        """:meth:`RouteQueue.unmark_started` per partition; the marks withdrawn, summed."""
        return sum(q.unmark_started([leases[i] for i in idx]) for q, idx in self._grouped(leases))

    def report_crash(self, lease: Lease, needed: int = 2) -> int:
        """:meth:`RouteQueue.report_crash` in the lease's partition."""
        return self._of_lease(lease).report_crash(lease, needed)

    def renew(self, lease: Lease, lease_ms: int | None = None) -> Lease:
        """:meth:`RouteQueue.renew` in the lease's partition."""
        return self._of_lease(lease).renew(lease, lease_ms)

    def renew_many(self, leases: Sequence[Lease], lease_ms: int | None = None) -> list[int]:
        """:meth:`RouteQueue.renew_many` over every partition in one round trip (one ``renew.lua`` per lease);
        one code per lease in order (1, ``LEASE_LOST``, ``GONE``); refused leases get their token fired."""
        if not leases:
            return []
        calls = []
        for le in leases:
            q = self._of_lease(le)
            calls.append((q.scripts.renew, q.core_keys() + [le.shard],
                          [q._now(), le.member, le.lease_score, int(lease_ms or q.lease_ms)]))
        out = []
        for le, res in zip(leases, run_scripts(self.r, calls, raise_errors=False)):
            if isinstance(res, Exception) or is_refusal(res):
                le.cancel()
                out.append(LEASE_LOST if isinstance(res, Exception) else res)
            else:
                le.lease_score = _s(res)
                out.append(COMPLETED)
        return out

    def release(self, leases: Sequence[Lease]) -> list[int]:
        """:meth:`RouteQueue.release` grouped by partition; one code per lease in order."""
        return self._each_code(leases, lambda q, ls: q.release(ls))

    def complete(self, leases: Sequence[Lease], interval_ms: int | None = None) -> list[int]:
        """:meth:`RouteQueue.complete` grouped by partition; one code per lease in order."""
        return self.complete_with_results(leases, None, None, interval_ms).codes

    def stream_of(self, q: RouteQueue, stream: StreamTarget) -> StreamTarget:
        """``stream`` re-aimed at partition ``q``'s results stream (same group, bound and policy) when it is
        the deployment's results stream; a stream of the caller's own choosing is kept as it is (shared by
        every partition: single-slot on a cluster only for the deployment's streams)."""
        if stream.key not in (results_stream_key(self._prefix, DEFAULT, False),
                              results_stream_key(self._prefix, DEFAULT, True)):
            return stream
        return StreamTarget(results_stream_key(self._prefix, q.keys.name, self.tagged), stream.group,
                            stream.maxlen, stream.policy)

    def complete_with_results(self, leases: Sequence[Lease], results: Sequence[dict[str, str] | None] | None,
                              stream: StreamTarget | None, interval_ms: int | None = None,
                              desired: Sequence[str | None] | None = None) -> Completion:
        """:meth:`RouteQueue.complete_with_results` per partition, each partition's results appended to its
        own stream (the bound applies per stream). Atomic per partition; ``full`` when any partition's
        stream refused (the partitions before it in this call did complete: their codes are kept, the
        refused partitions' codes are 0 = not done)."""
        out = Completion(codes=[0] * len(leases), ids=[None] * len(leases))
        if not leases:
            return Completion()
        groups = self._grouped(leases)
        calls = []  # one round trip, one script call per partition
        for q, idx in groups:
            keys, args = q.complete_call([leases[i] for i in idx],
                                         None if results is None else [results[i] for i in idx],
                                         None if stream is None else self.stream_of(q, stream), interval_ms,
                                         None if desired is None else [desired[i] for i in idx])
            calls.append((q.scripts.complete, keys, args))
        for (q, idx), raw in zip(groups, run_scripts(self.r, calls)):
            part = q.completion_of([leases[i] for i in idx], raw)
            out.dropped += part.dropped
            out.trimmed += part.trimmed
            if part.full:
                out.full = True
                continue
            for j, i in enumerate(idx):
                out.codes[i], out.ids[i] = part.codes[j], part.ids[j]
        if out.full and not any(out.codes):
            out.codes, out.ids = [], []
        return out

    def complete_one(self, lease: Lease) -> None:
        """:meth:`RouteQueue.complete_one` in the lease's partition."""
        self._of_lease(lease).complete_one(lease)

    def complete_with_payload(self, lease: Lease, desired_payload: str, interval_ms: int | None = None) -> str:
        """:meth:`RouteQueue.complete_with_payload` in the lease's partition."""
        return self._of_lease(lease).complete_with_payload(lease, desired_payload, interval_ms)

    def retry(self, lease: Lease, delay_ms: int) -> int:
        """:meth:`RouteQueue.retry` in the lease's partition."""
        return self._of_lease(lease).retry(lease, delay_ms)

    def progress(self, lease: Lease, value: str) -> None:
        """:meth:`RouteQueue.progress` in the lease's partition."""
        self._of_lease(lease).progress(lease, value)

    def log(self, lease: Lease, line: str) -> int:
        """:meth:`RouteQueue.log` in the lease's partition."""
        return self._of_lease(lease).log(lease, line)

    def remove(self, lease: Lease) -> None:
        """:meth:`RouteQueue.remove` in the lease's partition."""
        self._of_lease(lease).remove(lease)

    # -- import and time -------------------------------------------------------------------------------
    def schedule(self, items: Iterable[tuple[str, str]], total: int | None = None, start_index: int = 0,
                 batch: int = 500) -> dict[str, int]:
        """:meth:`RouteQueue.schedule` with each pair sent to its partition; a route keeps its place in the
        whole spread (route i of ``total`` is due at now + i * interval / total whichever partition holds
        it). During a repartition a route still stored in its old partition is merged there."""
        items = list(items)
        total = total or len(items) or 1
        groups: dict[str, tuple[list[tuple[str, str]], list[int]]] = {}
        where = self._where_many([h for h, _ in items])
        for j, (h, p) in enumerate(items):
            rows, slots = groups.setdefault(where[j].keys.name, ([], []))
            rows.append((h, p))
            slots.append(start_index + j)
        pipe = self.r.pipeline(transaction=False)  # every partition's calls in one round trip
        for name, (rows, slots) in groups.items():
            self.by_name[name].schedule_calls(pipe, rows, total=total, batch=batch, slots=slots)
        return RouteQueue.schedule_counts(pipe.execute())

    def enqueue_at(self, member: str, at_ms: int) -> int:
        """:meth:`RouteQueue.enqueue_at` in the route's partition."""
        return self._where(member).enqueue_at(member, at_ms)

    def enqueue_in(self, member: str, delay_ms: int = 0) -> int:
        """:meth:`RouteQueue.enqueue_in` in the route's partition."""
        return self._where(member).enqueue_in(member, delay_ms)

    def respread(self, interval_ms: int | None = None, batch: int = 1000) -> dict[str, int]:
        """Re-spread every unleased route of every partition evenly across ``interval_ms`` (one numbering
        over all partitions, :meth:`respread_batch`). Returns ``{"moved", "leased", "missing"}``."""
        interval = int(interval_ms or self.interval_ms)
        total = self.route_count()
        counts = {"moved": 0, "leased": 0, "missing": 0}
        placed = 0
        for unit in range(self.respread_units):
            cursor = "0"
            while True:
                step = self.respread_batch(unit, cursor, count=batch, placed=placed, total=total,
                                           interval_ms=interval)
                counts["moved"] += step["moved"]
                counts["leased"] += step["leased"]
                placed, cursor = step["placed"], step["cursor"]
                if cursor == "0":
                    break
        return counts

    def respread_batch(self, shard: int, cursor: str = "0", *, count: int = 1000, placed: int = 0,
                       total: int = 1, interval_ms: int | None = None, progress_key: str | None = None,
                       run: str | None = None) -> dict:
        """:meth:`RouteQueue.respread_batch` of shard walk number ``shard`` (0..:attr:`respread_units`-1:
        partition ``shard // shards``, its shard ``shard % shards``).

        The progress hash lives under ``{default}``, another slot than the partition's, so it is not
        written inside the batch's script: the run is checked before the batch and the progress written
        after it (a crash in between re-runs the batch, which places the same routes at the same times)."""
        q = self.parts[int(shard) // self.side.shards]
        if progress_key:
            if _s(self.r.hget(progress_key, "run") or b"") != (run or ""):
                return {"cursor": str(cursor), "moved": 0, "leased": 0, "placed": int(placed), "superseded": True}
        step = q.respread_batch(int(shard) % self.side.shards, cursor, count=count, placed=placed, total=total,
                                interval_ms=interval_ms)
        if progress_key:
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(progress_key, mapping={"cursor": step["cursor"], "placed": step["placed"]})
            pipe.hincrby(progress_key, "moved", step["moved"])
            pipe.hincrby(progress_key, "held", step["leased"])
            if step["cursor"] == "0":
                pipe.hincrby(progress_key, "shard", 1)
            pipe.execute()
        return step

    # -- cadence ---------------------------------------------------------------------------------------
    def set_route_interval(self, member: str, interval_ms: int | None) -> dict:
        """:meth:`RouteQueue.set_route_interval` in the route's partition."""
        return self._where(member).set_route_interval(member, interval_ms)

    def set_workspace_cadence(self, workspace_id: int, *, interval_ms: int = 0, dead_after: int = 0,
                              dead_factor: int = 0, progress=None) -> dict:
        """:func:`magpie.queue.cadence.set_workspace_cadence`: the setting written in every partition first,
        then each partition's routes walked (resumable per partition)."""
        from magpie.queue.cadence import set_workspace_cadence

        return set_workspace_cadence(self, workspace_id, interval_ms=interval_ms, dead_after=dead_after,
                                     dead_factor=dead_factor, progress=progress)

    def set_profile_cadence(self, workspace_id: int, *, interval_ms: int = 0, dead_after: int = 0,
                            dead_factor: int = 0, progress=None) -> dict:
        """:func:`magpie.queue.cadence.set_profile_cadence`: the setting written in every partition first,
        then each partition's routes walked (resumable per partition)."""
        from magpie.queue.cadence import set_profile_cadence

        return set_profile_cadence(self, workspace_id, interval_ms=interval_ms, dead_after=dead_after,
                                   dead_factor=dead_factor, progress=progress)

    # -- operator --------------------------------------------------------------------------------------
    def _pick(self, partition: int | None) -> list[RouteQueue]:
        if partition is None:
            return self.parts
        if not 0 <= int(partition) < len(self.names):
            raise ValueError(f"--partition must be within 0..{len(self.names) - 1}, got {partition}")
        return [self.by_name[self.names[int(partition)]]]

    def pause(self, partition: int | None = None) -> None:
        """Stop claiming in every partition (or partition number ``partition`` only)."""
        for q in self._pick(partition):
            q.pause()

    def resume(self, partition: int | None = None) -> None:
        """Claim again in every partition (or partition number ``partition`` only)."""
        for q in self._pick(partition):
            q.resume()

    def is_paused(self, partition: int | None = None) -> bool:
        """True while every partition (or partition number ``partition``) is paused."""
        pipe = self.r.pipeline(transaction=False)
        for q in self._pick(partition):
            pipe.exists(q.keys.paused)
        return all(pipe.execute())

    def drain(self, batch: int = 1000, progress=None) -> dict[str, int]:
        """:meth:`RouteQueue.drain` of every partition; counts summed, ``progress(done, total)`` over all."""
        out = {"due": 0, "waiting": 0, "leased_spared": 0}
        total = self.route_count() if progress is not None else 0
        for q in self.parts:
            base = sum(out.values())
            cb = None if progress is None else (lambda d, t, base=base: progress(base + d, max(total, base + d)))
            for k, v in q.drain(batch, cb).items():
                out[k] += v
        return out

    def obliterate(self, force: bool = False, batch: int = 1000) -> tuple[str, int]:
        """:meth:`RouteQueue.obliterate` partition by partition: ``("more", deleted)`` until every partition
        is gone, then the partition layout record goes too and ``("done", deleted)``.

        The first call checks every partition (``not_paused`` unless all are paused, ``active_leases``
        while a live lease is out unless ``force``) and records the run under ``{default}``
        (``obliterating``); a partition obliterated by an earlier call of the run is skipped (its pause
        key went with it)."""
        marker = self.side_key("obliterating")
        if not self.r.exists(marker):
            if not self.is_paused():
                raise QueueError(Refusal.NOT_PAUSED)
            if not force:
                now = self.server_time_ms()
                pipe = self.r.pipeline(transaction=False)
                for q in self.parts:
                    pipe.zcount(q.keys.leased, f"({now}", "+inf")
                if any(int(n) for n in pipe.execute()):
                    raise QueueError(Refusal.ACTIVE_LEASES)
            self.r.set(marker, "1")
        deleted = 0
        for q in self.parts:
            if not self.r.exists(q.keys.paused):
                continue  # done earlier in this run
            if deleted >= batch:
                return "more", deleted  # ``batch`` routes per call, over all partitions
            status, n = q.obliterate(True, batch - deleted)
            deleted += n
            if status != "done":
                return "more", deleted
        self.r.delete(layout_key(self._prefix), marker)
        return "done", deleted

    def remove_route(self, member: str, force: bool = False, expected: str | None = None) -> None:
        """:meth:`RouteQueue.remove_route` in the route's partition."""
        self._where(member).remove_route(member, force, expected)

    def update(self, member: str, payload: str, expected: str, force: bool = False) -> None:
        """:meth:`RouteQueue.update` in the route's partition."""
        self._where(member).update(member, payload, expected, force)

    def dead_letters(self, limit: int = 100) -> list[dict]:
        """Dead letters of every partition, oldest first (at most ``limit``)."""
        rows = [d for q in self.parts for d in q.dead_letters(limit)]
        return sorted(rows, key=lambda d: (d["dead_at_ms"], d["member"]))[:limit]

    def reprocess(self, member: str) -> int:
        """:meth:`RouteQueue.reprocess` in the route's partition."""
        return self._where(member).reprocess(member)

    # -- reads -----------------------------------------------------------------------------------------
    def server_time_ms(self) -> int:
        """Now in Unix ms on the Redis server clock (or the test clock)."""
        return self.parts[0].server_time_ms()

    def score(self, member: str) -> str | None:
        """:meth:`RouteQueue.score` where the route is."""
        return self._where(member).score(member)

    def payload(self, member: str) -> str | None:
        """:meth:`RouteQueue.payload` where the route is."""
        return self._where(member).payload(member)

    def payloads(self, members: Sequence[str]) -> list[str | None]:
        """Stored payload texts of ``members`` in order (None where missing): one ``GET`` each, pipelined
        (an ``MGET`` cannot span partitions on a cluster)."""
        if not members:
            return []
        pipe = self.r.pipeline(transaction=False)
        for m in members:
            pipe.get(self._where(m).keys.payload(m))
        return [None if v is None else _s(v) for v in pipe.execute()]

    def inspect(self, member: str) -> dict:
        """:meth:`RouteQueue.inspect` where the route is, plus ``"partition"`` (its name)."""
        q = self._where(member)
        return {**q.inspect(member), "partition": q.keys.name}

    def status(self) -> dict:
        """``{"now_ms", "paused", "shards": [...every partition's...], "partitions": [{"partition", "name",
        "paused", "scheduled", "leased", "expired_leases", "due_now", "dead", ...}], "totals": {...}}``;
        ``paused`` is True while every partition is."""
        now = self.server_time_ms()
        from magpie.queue import reads

        parts, shards = [], []
        for i, q in enumerate(self.parts):
            st = reads.status(self.r, q.keys, now)
            shards += st["shards"]
            parts.append({"partition": i, "name": q.keys.name, "paused": st["paused"], **st["totals"]})
        totals = {
            key: sum(p[key] for p in parts) for key in ("scheduled", "leased", "expired_leases", "due_now", "dead")}
        totals["next_due_ms"] = min((p["next_due_ms"] for p in parts if p["next_due_ms"]), default=None)
        totals["oldest_lateness_s"] = max((p["oldest_lateness_s"] for p in parts), default=0.0)
        return {"now_ms": now, "paused": all(p["paused"] for p in parts), "shards": shards, "partitions": parts,
                "totals": totals}

    def dead_count(self) -> int:
        """Dead-lettered routes in every partition."""
        pipe = self.r.pipeline(transaction=False)
        for q in self.parts:
            pipe.zcard(q.keys.dead)
        return sum(int(n) for n in pipe.execute())

    def in_flight(self, limit: int = 100) -> list[dict]:
        """Outstanding leases of every partition, soonest expiry first (at most ``limit``)."""
        rows = [d for q in self.parts for d in q.in_flight(limit)]
        return sorted(rows, key=lambda d: float(d["lease_score"]))[:limit]

    def route_count(self) -> int:
        """Routes in every shard of every partition (dead letters are not)."""
        pipe = self.r.pipeline(transaction=False)
        for q in self.parts:
            for shard in q.keys.all_shards():
                pipe.zcard(shard)
        return sum(int(n) for n in pipe.execute())


__all__ = ["PartitionedSchedule", "check_partition_layout", "tag_of", "COMPLETED", "GONE", "LEASE_LOST"]
