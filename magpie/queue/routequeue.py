"""Python face of the route schedule: thin, typed wrappers over the fenced Lua scripts in ``lua/``.

The lease score a claim returns (``expiry_ms + 0.5``, a string so the ``.5`` survives) is the fencing
token: renew, complete, complete-with-payload, retry, progress, log and remove take effect only while
the stored score still equals it (DESIGN.md invariants 1-7). A refused call changes nothing, raises a
typed :class:`QueueError` and fires the lease's cancellation token, so the running check stops at its
next attempt boundary. Scores travel as strings end to end; Python never rounds them.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import redis

from magpie.queue.keys import QueueKeys
from magpie.queue.scripts import Scripts

COMPLETED, REMOVED = 1, 2
LEASE_LOST, GONE, PAYLOAD_CHANGED, BAD_PAYLOAD, LEASED, DEAD, NOT_DEAD, ACTIVE_LEASE = (
    -1, -2, -3, -4, -5, -6, -7, -8)
REASONS = {
    LEASE_LOST: "lease_lost", GONE: "gone", PAYLOAD_CHANGED: "payload_changed", BAD_PAYLOAD: "bad_payload",
    LEASED: "leased", DEAD: "dead", NOT_DEAD: "not_dead", ACTIVE_LEASE: "active_leases",
}


class QueueError(RuntimeError):
    """A queue call was refused and changed nothing.

    ``code`` is one of: ``lease_lost`` (stale holder), ``gone`` (route removed), ``payload_changed``
    (concurrent import since the claim), ``bad_payload``, ``leased`` (a check is running),
    ``dead`` (dead-lettered), ``not_dead``, ``active_leases`` (live leases block the operation),
    ``not_paused`` (obliterate needs a paused queue).
    """

    def __init__(self, code: str, member: str = ""):
        super().__init__(f"{code}: route {member}" if member else code)
        self.code = code
        self.member = member


class LeaseLost(QueueError):
    """The caller no longer holds the lease (it expired and another holder claimed the route)."""


def _refusal(code: int, member: str) -> QueueError:
    return (LeaseLost if code == LEASE_LOST else QueueError)(REASONS[code], member)


@dataclass(slots=True)
class Lease:
    """One claimed route, as returned by :meth:`RouteQueue.pop`.

    Attributes:
        member: route hash (the sorted-set member).
        payload: the payload text as stored at claim time (the worker's original snapshot).
        previous_score: score before the claim (due ms; ``.25`` a retry due time, ``.5`` an expired lease).
        lease_score: the fencing token, ``'<expiry ms>.50'``.
        shard: shard key the member lives in.
        stalled: True when this claim re-took an expired lease (the previous holder vanished).
        retry_attempts: backoff retries already made for this route (0 for an ordinary cycle).
        server_offset_ms: Redis server clock minus this process's clock at claim time (ms).
    The cancellation token (:meth:`cancel`, :attr:`cancelled`) is process-local and not serialised.
    """

    member: str
    payload: str
    previous_score: str
    lease_score: str
    shard: str
    stalled: bool = False
    retry_attempts: int = 0
    server_offset_ms: float = 0.0
    _token: threading.Event | None = field(default=None, repr=False, compare=False)

    @property
    def expires_at_ms(self) -> float:
        """Lease expiry on the Redis server clock (Unix ms)."""
        return float(self.lease_score) - 0.5

    def remaining_ms(self) -> float:
        """Estimated ms left on the lease, corrected by the server clock offset seen at claim time."""
        return self.expires_at_ms - (time.time() * 1000 + self.server_offset_ms)

    @property
    def cancelled(self) -> bool:
        """True once a fenced call on this lease was refused: the check should stop."""
        return self._token is not None and self._token.is_set()

    @property
    def token(self) -> threading.Event:
        """The cancellation token (an Event, created on first use) for a check to wait on."""
        if self._token is None:
            self._token = threading.Event()
        return self._token

    def cancel(self) -> None:
        self.token.set()

    def to_dict(self) -> dict:
        """JSON-safe dict for a Celery message (without the cancellation token)."""
        return {"member": self.member, "payload": self.payload, "previous_score": self.previous_score,
                "lease_score": self.lease_score, "shard": self.shard, "stalled": self.stalled,
                "retry_attempts": self.retry_attempts, "server_offset_ms": self.server_offset_ms}

    @classmethod
    def from_dict(cls, d: dict) -> "Lease":
        return cls(**d)


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def is_lease_score(score: float | str | None) -> bool:
    """True when ``score`` carries the ``.5`` lease marker."""
    return score is not None and float(score) % 1 == 0.5


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
        self._core = keys.core()
        self.last_pop = {"paused": False, "dead_lettered": 0, "allowed": 0}

    @classmethod
    def from_settings(cls, settings, client: redis.Redis | None = None) -> "RouteQueue":
        """Build from :class:`magpie.config.Settings` (interval and lease in seconds there)."""
        client = client or redis.Redis.from_url(settings.redis_url)
        q = cls(client, QueueKeys(settings.redis_prefix, settings.queue_shards),
                interval_ms=int(settings.check_interval * 1000), lease_ms=int(settings.lease_seconds * 1000),
                max_stalled=getattr(settings, "max_stalled", 3))
        q.check_layout()
        return q

    def check_layout(self) -> None:
        """Record this schedule's shard count on first use; refuse a different one later.

        Raises :class:`QueueError` ``layout_mismatch`` naming ``PROXY_QUEUE_SHARDS`` when the setting
        differs from the count the stored schedule was built with (routes in the other shards would
        never be claimed). Obliterating the schedule clears the record.
        """
        want = str(self.keys.shards)
        self.r.set(self.keys.layout, want, nx=True)
        have = _s(self.r.get(self.keys.layout) or want)
        if have != want:
            raise QueueError("layout_mismatch", f"(schedule has {have} shards, PROXY_QUEUE_SHARDS={want}; "
                                                 f"keep {have}, or rebuild after `magpie queue obliterate`)")

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
            return [Lease(m.decode(), p.decode(), prev.decode(), lease_s, shard.decode(), bool(f & 1), f >> 1,
                          offset) for m, p, prev, shard, f in raw[5:]]
        return [Lease(m, p, prev, lease_s, shard, bool(f & 1), f >> 1, offset) for m, p, prev, shard, f in raw[5:]]

    def _fenced(self, lease: Lease, res):
        if isinstance(res, int) and res < 0:
            if res in (LEASE_LOST, GONE):
                lease.cancel()
            raise _refusal(res, lease.member)
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

        Returns one code per lease: 1 renewed (its ``lease_score`` updated), -1 lease lost, -2 gone;
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
            if isinstance(res, int) and res < 0:
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
        previous due time, and no stall is counted. Returns one code per lease: 1 released, -1 lease
        lost, -2 gone."""
        if not leases:
            return []
        args: list = [self._now()]
        for le in leases:
            args += [le.member, le.lease_score, le.previous_score]
        codes = [int(x) for x in self.scripts.release(keys=self._core + [le.shard for le in leases], args=args)]
        for le in leases:
            le.cancel()
        return codes

    def complete(self, leases: Sequence[Lease], interval_ms: int | None = None) -> list[int]:
        """Finish the cycles of ``leases`` in one script call (``complete.lua``); writes no payload.

        Returns one code per lease: 1 completed, -1 lease lost (stale; nothing changed), -2 gone.
        Refused leases get their cancellation token fired.
        """
        if not leases:
            return []
        args: list = [self._now(), int(interval_ms or self.interval_ms)]
        for le in leases:
            args += [le.member, le.lease_score, le.previous_score]
        codes = [int(x) for x in self.scripts.complete(keys=self._core + [le.shard for le in leases], args=args)]
        for le, c in zip(leases, codes):
            if c != COMPLETED:
                le.cancel()
        return codes

    def complete_one(self, lease: Lease) -> None:
        """Complete a single lease; raises :class:`LeaseLost` / :class:`QueueError` when refused."""
        code = self.complete([lease])[0]
        if code != COMPLETED:
            raise _refusal(code, lease.member)

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
        if isinstance(res, int):
            raise _refusal(res, member)
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

        Run it under the ``respread`` leader lock (``magpie queue respread`` does). Leased routes keep
        their lease; their completion then applies the new interval. Returns ``{"moved", "leased",
        "missing"}``.
        """
        interval = int(interval_ms or self.interval_ms)
        members = []
        for shard in self.keys.all_shards():
            members += [(shard, _s(m)) for m in self.r.zrange(shard, 0, -1)]
        total = len(members) or 1
        step = interval / total
        counts = {"moved": 0, "leased": 0, "missing": 0}
        by_shard: dict[str, list] = {}
        for i, (shard, m) in enumerate(members):
            by_shard.setdefault(shard, []).append((m, int(i * step)))
        for shard, rows in by_shard.items():
            for off in range(0, len(rows), batch):
                args: list = [self._now()]
                for m, o in rows[off: off + batch]:
                    args += [m, o]
                moved, leased, missing = self._one(self.scripts.respread, shard, args)
                counts["moved"] += int(moved)
                counts["leased"] += int(leased)
                counts["missing"] += int(missing)
        return counts

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
        status, deleted = self.scripts.obliterate(keys=self._core + [k.layout] + k.all_shards(), args=[
            self._now(), k.payload_prefix, k.logs_prefix, int(batch), "1" if force else "0"])
        status = _s(status)
        if status in ("not_paused", "active_leases"):
            raise QueueError(status)
        return status, int(deleted)

    def remove_route(self, member: str, force: bool = False) -> None:
        """Operator removal of one route. Raises :class:`QueueError` ``gone``, or ``active_leases``
        while a live lease is out unless ``force``."""
        k = self.keys
        res = int(self._one(self.scripts.admin_remove, k.shard_of(member), [
            self._now(), k.payload_prefix, k.logs_prefix, member, "1" if force else "0"]))
        if res < 0:
            raise _refusal(res, member)

    def update(self, member: str, payload: str) -> None:
        """Operator replacement of a route's payload; the schedule is untouched. Raises ``gone``."""
        res = int(self.scripts.update(keys=self._core, args=[self.keys.payload_prefix, member, payload]))
        if res < 0:
            raise _refusal(res, member)

    def dead_letters(self, limit: int = 100) -> list[dict]:
        """Dead-lettered routes, oldest first: ``[{"member", "dead_at_ms", "reason", "stalls"}]``."""
        rows = self.r.zrange(self.keys.dead, 0, limit - 1, withscores=True)
        infos = self.r.hmget(self.keys.dead_info, [m for m, _ in rows]) if rows else []
        out = []
        for (m, sc), info in zip(rows, infos):
            d = json.loads(info) if info else {}
            out.append({"member": _s(m), "dead_at_ms": int(sc), "reason": d.get("reason"),
                        "stalls": d.get("stalls")})
        return out

    def reprocess(self, member: str) -> int:
        """Put a dead-lettered route back, due now, stall count reset. Returns its due time (ms).
        Raises :class:`QueueError` ``not_dead`` or ``gone``."""
        res = self._one(self.scripts.reprocess, self.keys.shard_of(member),
                        [self._now(), member, self.keys.payload_prefix])
        if isinstance(res, int):
            raise _refusal(res, member)
        return int(float(_s(res)))

    # -- reads ---------------------------------------------------------------------------------------
    def server_time_ms(self) -> int:
        """Now in Unix ms: the Redis server clock (or the test clock)."""
        if self.clock:
            return int(self.clock())
        s, us = self.r.time()
        return int(s) * 1000 + int(us) // 1000

    def score(self, member: str) -> str | None:
        """Current score of a route as a '%.2f' string, or None when not scheduled."""
        v = self.r.zscore(self.keys.shard_of(member), member)
        return None if v is None else f"{v:.2f}"

    def payload(self, member: str) -> str | None:
        v = self.r.get(self.keys.payload(member))
        return None if v is None else _s(v)

    def inspect(self, member: str) -> dict:
        """Everything known about one route: ``{"member", "payload", "score", "state", "stalls",
        "retries", "progress", "logs", "dead"}``. ``state`` is one of ``due``, ``waiting``, ``retry``,
        ``leased``, ``lease_expired``, ``dead``, ``gone``."""
        k = self.keys
        now = self.server_time_ms()
        p = self.r.pipeline(transaction=False)
        p.get(k.payload(member))
        p.zscore(k.shard_of(member), member)
        p.hget(k.stalls, member)
        p.hget(k.retries, member)
        p.hget(k.progress, member)
        p.lrange(k.logs_prefix + member, -20, -1)
        p.zscore(k.dead, member)
        p.hget(k.dead_info, member)
        payload, score, stalls, retries, progress, logs, dead_at, dead_info = p.execute()
        if score is not None:
            if is_lease_score(score):
                state = "leased" if score > now else "lease_expired"
            elif score % 1 == 0.25:
                state = "retry"
            else:
                state = "due" if score <= now else "waiting"
        elif dead_at is not None:
            state = "dead"
        else:
            state = "gone"
        return {
            "member": member, "payload": _s(payload) if payload is not None else None,
            "score": None if score is None else f"{score:.2f}", "state": state,
            "stalls": int(stalls or 0), "retries": int(retries or 0),
            "progress": _s(progress) if progress is not None else None, "logs": [_s(x) for x in logs],
            "dead": {"at_ms": int(dead_at), **json.loads(dead_info)} if dead_at is not None and dead_info else None,
        }

    def status(self) -> dict:
        """Per-shard counts for operators (not on the hot path).

        Returns ``{"now_ms", "paused", "shards": [{"shard", "scheduled", "leased", "expired_leases",
        "due_now", "next_due_ms", "oldest_lateness_s"}], "totals": {...}}``. ``leased`` counts live leases
        and ``expired_leases`` leases past expiry not yet re-claimed (from the lease index); ``due_now``
        counts every claimable member (ordinary due routes and expired leases); lateness is now minus the
        oldest claimable score, in seconds.
        """
        now = self.server_time_ms()
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        for shard in k.all_shards():
            pipe.zcard(shard)
            pipe.zrangebyscore(shard, "-inf", now, start=0, num=1, withscores=True)
            pipe.zcount(shard, "-inf", now)
            pipe.zrangebyscore(shard, f"({now}", "+inf", withscores=True, start=0, num=1)
        pipe.zrangebyscore(k.leased, "-inf", "+inf", withscores=True)
        pipe.zcard(k.dead)
        pipe.exists(k.paused)
        res = pipe.execute()
        lease_rows, dead, paused = res[-3:]
        per_shard: dict[str, list[int]] = {}
        for m, sc in lease_rows:
            entry = per_shard.setdefault(k.shard_of(_s(m)), [0, 0])
            entry[0 if sc > now else 1] += 1
        shards = []
        for i, shard in enumerate(k.all_shards()):
            card, oldest, due, nxt = res[4 * i: 4 * i + 4]
            live, expired = per_shard.get(shard, [0, 0])
            shards.append({
                "shard": shard, "scheduled": int(card), "leased": live, "expired_leases": expired,
                "due_now": int(due), "next_due_ms": int(nxt[0][1]) if nxt else None,
                "oldest_lateness_s": round((now - oldest[0][1]) / 1000, 3) if oldest else 0.0,
            })
        totals = {
            "scheduled": sum(s["scheduled"] for s in shards),
            "leased": sum(s["leased"] for s in shards),
            "expired_leases": sum(s["expired_leases"] for s in shards),
            "due_now": sum(s["due_now"] for s in shards),
            "dead": int(dead),
            "next_due_ms": min((s["next_due_ms"] for s in shards if s["next_due_ms"]), default=None),
            "oldest_lateness_s": max((s["oldest_lateness_s"] for s in shards), default=0.0),
        }
        return {"now_ms": now, "paused": bool(paused), "shards": shards, "totals": totals}
