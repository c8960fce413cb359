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

import time
from typing import Callable, Iterable, Sequence

import redis

from magpie.errors import Refusal
from magpie.queue import reads
from magpie.queue.completion import Completion, StreamTarget
from magpie.queue.keys import QueueKeys
from magpie.queue.lease import Lease
from magpie.queue.lease import text as _s
from magpie.queue.refusals import COMPLETED, GONE, LEASE_LOST, REMOVED, QueueError, is_refusal, refusal
from magpie.queue.scripts import Scripts


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
    """

    def __init__(self, client: redis.Redis, keys: QueueKeys, interval_ms: int, lease_ms: int = 300_000,
                 max_stalled: int = 3, log_limit: int = 100, clock: Callable[[], int] | None = None):
        self.r = client
        self.keys = keys
        self.interval_ms = int(interval_ms)
        self.lease_ms = int(lease_ms)
        self.max_stalled = int(max_stalled)
        self.log_limit = int(log_limit)
        self.clock = clock
        self.scripts = Scripts(client)
        self._unmark = client.register_script(_UNMARK)  # deletes only: runs on a full Redis (allow-oom)
        self._core = keys.core()
        self.last_pop = {"paused": False, "dead_lettered": 0, "allowed": 0}

    @classmethod
    def from_settings(cls, settings, client: redis.Redis | None = None) -> "RouteQueue":
        """Build from a :class:`magpie.config.ScheduleSettings` (or a whole Settings, whose ``schedule``
        slice is used). Raises :class:`QueueError` ``layout_mismatch`` (see :meth:`check_layout`)."""
        sched = getattr(settings, "schedule", settings)
        client = client or redis.Redis.from_url(sched.redis_url)
        q = cls(client, QueueKeys(sched.prefix, sched.shards), interval_ms=sched.interval_ms,
                lease_ms=sched.lease_ms, max_stalled=sched.max_stalled)
        q.check_layout()
        return q

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

    def _one(self, script, shard: str, args: list, client=None):
        return script(keys=self._core + [shard], args=args, client=client)

    # -- worker in hand ------------------------------------------------------------------------------
    def pop(self, count: int = 1, max_inflight: int = 0, lease_ms: int | None = None) -> list[Lease]:
        """Claim up to ``count`` due routes in due-time order across shards (``pop.lua``).

        ``max_inflight`` > 0 caps outstanding live leases. Claims nothing while paused. Expired leases
        are re-claimed here (``stalled=True``) or dead-lettered past ``max_stalled``. Returns the leases;
        :attr:`last_pop` tells whether the queue was paused and how many routes were dead-lettered.
        """
        k = self.keys
        before = time.time() * 1000
        raw = self.scripts.pop(keys=self._core, args=[
            self._now(), int(count), int(lease_ms or self.lease_ms), k.payload_prefix, int(max_inflight),
            self.max_stalled])
        after = time.time() * 1000
        offset = float(_s(raw[0])) - (before + after) / 2
        self.last_pop = {"allowed": int(raw[1]), "paused": bool(int(raw[2])), "dead_lettered": int(raw[3])}
        lease_s = _s(raw[4])
        if raw[5:] and isinstance(raw[5][0], bytes):
            return [Lease(m.decode(), p.decode(), prev.decode(), lease_s, shard.decode(), bool(f & 1), f >> 2,
                          offset, bool(f & 2)) for m, p, prev, shard, f in raw[5:]]
        return [Lease(m, p, prev, lease_s, shard, bool(f & 1), f >> 2, offset, bool(f & 2))
                for m, p, prev, shard, f in raw[5:]]

    def mark_started(self, leases: Sequence[Lease]) -> None:
        """Record that ``leases`` started checking (one ``HSET`` of ``<member>#s`` -> lease score).

        Only a lease with this mark counts as evidence against its route when it expires (``pop.lua``);
        a completion, release or retry clears it. Marking a lost lease is harmless: ``pop.lua`` compares
        the mark with the expired lease's score. Raises redis errors only.
        """
        if leases:
            self.r.hset(self.keys.stalls, mapping={f"{le.member}#s": le.lease_score for le in leases})

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

    def complete(self, leases: Sequence[Lease], interval_ms: int | None = None) -> list[int]:
        """Finish the cycles of ``leases`` in one script call (``complete.lua``); writes no payload.

        Returns one code per lease: 1 completed, ``LEASE_LOST`` (stale; nothing changed), ``GONE``.
        Refused leases get their cancellation token fired.
        """
        return self.complete_with_results(leases, None, None, interval_ms).codes

    def complete_with_results(self, leases: Sequence[Lease], results: Sequence[dict[str, str] | None] | None,
                              stream: StreamTarget | None, interval_ms: int | None = None) -> Completion:
        """Complete ``leases`` and append ``results[i]`` (stream entry fields, or None) of each completed
        lease to ``stream`` in the same atomic script call (see :mod:`magpie.queue.completion`).

        Returns a :class:`Completion`; refused leases get their cancellation token fired. With
        ``stream.policy == "refuse"`` and no room, nothing changes and ``full`` is True.
        """
        if not leases:
            return Completion()
        args: list = [self._now(), int(interval_ms or self.interval_ms), stream.policy if stream else "",
                      stream.maxlen if stream else 0, stream.group if stream else ""]
        for i, le in enumerate(leases):
            fields = results[i] if results is not None and stream is not None else None
            args += [le.member, le.lease_score, le.previous_score, len(fields) if fields else 0]
            if fields:
                for k, v in fields.items():
                    args += [k, v]
        keys = self._core + ([stream.key] if stream else []) + [le.shard for le in leases]
        raw = self.scripts.complete(keys=keys, args=args)
        n = len(leases)
        out = Completion(dropped=int(raw[0]), trimmed=int(raw[1]), full=bool(int(raw[2])))
        if out.full:
            return out
        out.codes = [int(x) for x in raw[3: 3 + n]]
        out.ids = [_s(x) or None for x in raw[3 + n: 3 + 2 * n]]
        for le, c in zip(leases, out.codes):
            if c != COMPLETED:
                le.cancel()
        return out

    def complete_one(self, lease: Lease) -> None:
        """Complete a single lease; raises :class:`LeaseLost` / :class:`QueueError` when refused."""
        code = self.complete([lease])[0]
        if code != COMPLETED:
            raise refusal(code, lease.member)

    def complete_with_payload(self, lease: Lease, desired_payload: str, interval_ms: int | None = None) -> str:
        """Complete ``lease`` and apply the worker's ownership change (``complete_payload.lua``).

        Only the workspace ids added or removed between ``lease.payload`` (the original snapshot) and
        ``desired_payload`` are applied to the payload as stored now: workspaces added concurrently by
        an import and the current credentials stay. Returns ``"completed"`` or ``"removed"`` (no
        workspace left). Raises :class:`LeaseLost`, :class:`QueueError` ``gone`` or ``bad_payload``.
        """
        k = self.keys
        res = self._one(self.scripts.complete_payload, lease.shard, [
            self._now(), int(interval_ms or self.interval_ms), k.payload_prefix, k.logs_prefix, lease.member,
            lease.lease_score, lease.previous_score, lease.payload, desired_payload])
        return "removed" if self._fenced(lease, int(res)) == REMOVED else "completed"

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
                 batch: int = 500) -> dict[str, int]:
        """Add routes to the schedule (``schedule.lua``), first due times spread over the interval.

        Args:
            items: ``(route_hash, payload_text)`` pairs; payload text as :meth:`Payload.encode` makes it.
            total: number of routes the spread is computed over (default: ``len(items)``).
            start_index: index of the first item within that spread (for chunked imports).
        Route i of ``total`` becomes due at now + i * interval / total. A route already stored keeps its
        due time; only the new payload's workspace ids are merged into the stored one.
        Returns ``{"new": n, "merged": n, "unchanged": n}``.
        """
        items = list(items)
        total = total or len(items) or 1
        step = self.interval_ms / total
        k = self.keys
        counts = {"new": 0, "merged": 0, "unchanged": 0}
        pipe = self.r.pipeline(transaction=False)
        for off in range(0, len(items), batch):
            chunk = items[off: off + batch]
            args: list = [self._now(), k.payload_prefix]
            for j, (h, payload) in enumerate(chunk):
                args += [h, payload, int((start_index + off + j) * step)]
            self.scripts.schedule(keys=self._core + [k.shard_of(h) for h, _ in chunk], args=args, client=pipe)
        for res in pipe.execute():
            for name, v in zip(("new", "merged", "unchanged"), res):
                counts[name] += int(v)
        return counts

    def _at(self, member: str, mode: str, value: int) -> int:
        res = self._one(self.scripts.enqueue_at, self.keys.shard_of(member), [self._now(), member, mode, int(value)])
        if is_refusal(res):
            raise refusal(res, member)
        return int(float(_s(res)))

    def enqueue_at(self, member: str, at_ms: int) -> int:
        """Check route ``member`` at Unix ms ``at_ms`` instead of its current due time; the route keeps one
        schedule entry and resumes its cadence after that check. Returns the due time (ms).
        Raises :class:`QueueError` ``gone``, ``leased`` (a check is running now) or ``dead``."""
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

    # -- operator plane -------------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop claiming: once this returns, no ``pop`` claims anything. Leases already out may finish."""
        self.r.set(self.keys.paused, "1")

    def resume(self) -> None:
        self.r.delete(self.keys.paused)

    def is_paused(self) -> bool:
        return bool(self.r.exists(self.keys.paused))

    def drain(self, batch: int = 1000) -> dict[str, int]:
        """Unschedule and delete every route that is due or waiting, sparing leased ones.

        Returns ``{"due": n, "waiting": n, "leased_spared": n}``.
        """
        k = self.keys
        out = {"due": 0, "waiting": 0, "leased_spared": 0}
        for shard in k.all_shards():
            offset = 0
            while True:
                due, waiting, leased, more = self._one(self.scripts.drain, shard, [
                    self._now(), k.payload_prefix, k.logs_prefix, int(batch), offset])
                out["due"] += int(due)
                out["waiting"] += int(waiting)
                out["leased_spared"] += int(leased)
                offset += int(leased)
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

    def remove_route(self, member: str, force: bool = False) -> None:
        """Operator removal of one route. Raises :class:`QueueError` ``gone``, or ``active_leases``
        while a live lease is out unless ``force``."""
        k = self.keys
        res = int(self._one(self.scripts.admin_remove, k.shard_of(member), [
            self._now(), k.payload_prefix, k.logs_prefix, member, "1" if force else "0"]))
        if is_refusal(res):
            raise refusal(res, member)

    def update(self, member: str, payload: str) -> None:
        """Operator replacement of a route's payload; the schedule is untouched. Raises ``gone``."""
        res = int(self.scripts.update(keys=self._core, args=[self.keys.payload_prefix, member, payload]))
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

    def inspect(self, member: str) -> dict:
        """Everything known about one route now (:func:`magpie.queue.reads.inspect`)."""
        return reads.inspect(self.r, self.keys, member, self.server_time_ms())

    def status(self) -> dict:
        """Per-shard counts now (:func:`magpie.queue.reads.status`)."""
        return reads.status(self.r, self.keys, self.server_time_ms())
