"""Rate limits kept in Redis: token buckets taken from in blocks, atomically (``lua/token_bucket.lua``).

One bucket per limited thing (a judge, a workspace, a rotator's client address) under
``<prefix>ratelimit:<kind>:<name>``, refilled at ``rate`` tokens per second on the Redis clock up to
``burst`` tokens. One script call takes up to N tokens at once, so the limit holds across every process
of the deployment while the busy paths make about one Redis call per block, not per event:

* :class:`TokenBucket` / :func:`take_many`: blocking calls (promote, tools, tests).
* :class:`BlockLimiter`: for an event loop. Tokens are fetched in blocks on a small thread pool (the
  loop never waits on a Redis socket), spent locally, and handed to waiters first come, first served;
  a token not spent within ``hold_s`` is dropped, so a process never sits on a stock that would let it
  burst past the rate later. :meth:`BlockLimiter.acquire` waits up to a deadline, :meth:`BlockLimiter.try_acquire`
  never waits.

Events are counted in the counters hash (:func:`magpie.base.counters.counters_key`) as
``limited:<kind>:<event>`` fields, flushed at most once a second, and exported as
``magpie_rate_limited_total{limiter, event}`` (:mod:`magpie.observability.metrics`). With Redis unreachable a limiter
fails open (nothing is limited; one warning a minute and an ``unavailable`` event), so losing Redis never
stops the checks that other failures already guard.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
import weakref
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor

import redis as redis_lib

from magpie.base import redisconn

log = logging.getLogger(__name__)

KINDS = ("judge", "workspace", "rotator")
"""Limiter kinds (the ``limiter`` label)."""

EVENTS = {"judge": ("waited", "handed_back", "unavailable"), "workspace": ("deferred", "unavailable"),
          "rotator": ("refused", "unavailable")}
"""Events counted per kind (the ``event`` label): ``waited`` a check waited for a token, ``handed_back`` it
could not get one before its deadline, ``deferred`` a claim was put off, ``refused`` a connection refused,
``unavailable`` Redis could not be asked (the limit was not applied)."""

_FLUSH_EVERY_S = 1.0
_WARN_EVERY_S = 60.0
_MIN_POLL_S = 0.005
_AHEAD_S = 0.05


@functools.cache
def _script_text() -> str:
    from magpie.queue.scripts import LUA_DIR

    return (LUA_DIR / "token_bucket.lua").read_text(encoding="utf-8")


_SCRIPTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _script_of(client: redis_lib.Redis):
    """The bucket script registered on ``client`` (kept per client: registering costs more than a call)."""
    script = _SCRIPTS.get(client)
    if script is None:
        script = _SCRIPTS[client] = client.register_script(_script_text())
    return script


def bucket_key(prefix: str, kind: str, name: str) -> str:
    """Redis key of the bucket of ``name`` (e.g. a judge URL's digest) of limiter ``kind``."""
    return f"{prefix}ratelimit:{kind}:{name}"


def default_burst(rate: float) -> float:
    """Burst for ``rate`` tokens/s when none is set: one second's worth, at least 1 token."""
    return max(1.0, float(rate))


def take_many(client: redis_lib.Redis, requests: list[tuple[str, float, float, int]]) -> list[tuple[int, float]]:
    """Take tokens from several buckets in one pipelined round trip.

    Args:
        requests: ``(key, rate tokens/s > 0, burst tokens >= 1, tokens wanted)`` per bucket; a negative
            number hands that many unused tokens back (granted 0).
    Returns ``(granted, seconds until the next whole token)`` per request, in order.
    Raises ``redis.RedisError`` when Redis is unreachable; ``ValueError`` for a rate <= 0.
    """
    if not requests:
        return []
    script = _script_of(client)
    for _key, rate, _burst, _want in requests:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 tokens/s, got {rate!r}")
    calls = [([key], [repr(float(rate)), repr(max(1.0, float(burst))), int(want)])
             for key, rate, burst, want in requests]
    if len(calls) == 1:  # one EVALSHA: a pipeline would add a SCRIPT EXISTS round trip
        g, w = script(keys=calls[0][0], args=calls[0][1])
        return [(int(g), int(w) / 1000.0)]
    redisconn.load_scripts(client, [script])
    pipe = client.pipeline(transaction=False)
    for keys, args in calls:
        script(keys=keys, args=args, client=pipe)
    return [(int(g), int(w) / 1000.0) for g, w in pipe.execute()]


class TokenBucket:
    """One Redis token bucket (blocking calls).

    Args:
        client: Redis client. key: the bucket's key (:func:`bucket_key`). rate: tokens per second (> 0).
        burst: most tokens held (default :func:`default_burst`).
    """

    def __init__(self, client: redis_lib.Redis, key: str, rate: float, burst: float | None = None):
        if not rate > 0:
            raise ValueError(f"rate must be > 0 tokens/s, got {rate!r}")
        self.client, self.key, self.rate = client, key, float(rate)
        self.burst = float(burst) if burst is not None else default_burst(rate)

    def take(self, want: int = 1) -> tuple[int, float]:
        """Take up to ``want`` tokens: ``(granted, seconds until the next whole token)``.
        Raises ``redis.RedisError`` when Redis is unreachable."""
        return take_many(self.client, [(self.key, self.rate, self.burst, want)])[0]


class EventCounts:
    """Limiter events counted locally and added to the counters hash at most once a second.

    Args:
        client: Redis client. prefix: ``MAGPIE_REDIS_PREFIX``. kind: one of :data:`KINDS`.
    """

    def __init__(self, client: redis_lib.Redis, prefix: str, kind: str):
        self.client, self.prefix, self.kind = client, prefix, kind
        self.totals: Counter[str] = Counter()  # this process's events since start
        self._pending: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._flushed = time.monotonic()

    def add(self, event: str, n: int = 1) -> None:
        """Count ``n`` events of ``event`` (no I/O)."""
        with self._lock:
            self.totals[event] += n
            self._pending[event] += n

    def due(self) -> bool:
        """True when there is something to flush and the last flush is a second old."""
        return bool(self._pending) and time.monotonic() - self._flushed >= _FLUSH_EVERY_S

    def flush(self) -> None:
        """Add the pending counts to Redis (one pipeline); kept for the next flush when Redis fails."""
        from magpie.base.counters import counters_key

        with self._lock:
            pending, self._pending = self._pending, Counter()
            self._flushed = time.monotonic()
        if not pending:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for event, n in pending.items():
                pipe.hincrby(counters_key(self.prefix), f"limited:{self.kind}:{event}", int(n))
            pipe.execute()
        except redis_lib.RedisError:
            with self._lock:
                self._pending.update(pending)


class _Stock:
    __slots__ = ("tokens", "got_at", "next_at", "queue", "fetch")

    def __init__(self) -> None:
        self.tokens = 0
        self.got_at = 0.0
        self.next_at = 0.0  # loop time the bucket said its next token comes
        self.queue: deque[asyncio.Future] = deque()
        self.fetch: asyncio.Task | None = None


class BlockLimiter:
    """Token buckets of one limiter kind for an asyncio event loop, taken from Redis in blocks.

    Args:
        client: Redis client (blocking; used on the limiter's own threads only).
        prefix: ``MAGPIE_REDIS_PREFIX``. kind: one of :data:`KINDS` (key and metric label).
        block: most tokens one Redis call takes (>= 1).
        hold_s: seconds a fetched token may wait locally before it is dropped.
    An instance binds to the first event loop it runs on (its state starts over on another loop).
    """

    def __init__(self, client: redis_lib.Redis, prefix: str, kind: str, *, block: int = 256, hold_s: float = 1.0):
        if block < 1:
            raise ValueError(f"block must be >= 1 token, got {block!r}")
        self.client, self.prefix, self.kind = client, prefix, kind
        self.block, self.hold_s = int(block), float(hold_s)
        self.counts = EventCounts(client, prefix, kind)
        self.calls = 0  # Redis calls made
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"magpie-ratelimit-{kind}")
        self._stocks: dict[str, _Stock] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warned = -_WARN_EVERY_S

    # -- state ------------------------------------------------------------------------------------------
    def _stock(self, name: str) -> _Stock:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._stocks = loop, {}
        st = self._stocks.get(name)
        if st is None:
            st = self._stocks[name] = _Stock()
        return st

    def _spend_local(self, st: _Stock, now: float) -> bool:
        if st.tokens > 0:
            if now - st.got_at <= self.hold_s:
                st.tokens -= 1
                return True
            st.tokens = 0
        return False

    def _count(self, event: str) -> None:
        self.counts.add(event)
        if self.counts.due():
            self._pool.submit(self.counts.flush)

    def _take(self, name: str, rate: float, burst: float, want: int) -> tuple[int, float]:
        self.calls += 1
        return take_many(self.client, [(bucket_key(self.prefix, self.kind, name), rate, burst, want)])[0]

    def _unavailable(self, exc: Exception) -> None:
        self._count("unavailable")
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            log.warning("%s rate limit not applied: Redis unavailable (%s)", self.kind, type(exc).__name__)

    async def _fetch(self, name: str, st: _Stock, rate: float, burst: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while st.queue and st.queue[0].done():
                st.queue.popleft()
            if not st.queue:
                return
            # what waits, plus ~50 ms of the rate for the checks about to arrive (they then take a local
            # token without a future or a timer); what is not spent within hold_s is dropped
            want = min(self.block, len(st.queue) + math.ceil(rate * _AHEAD_S))
            try:
                granted, wait_s = await loop.run_in_executor(self._pool, self._take, name, rate, burst, want)
            except Exception as exc:  # noqa: BLE001 - fail open: the waiters go ahead
                self._unavailable(exc)
                while st.queue:
                    f = st.queue.popleft()
                    if not f.done():
                        f.set_result(True)
                return
            now = loop.time()
            st.next_at = now + wait_s
            dry = granted < want  # the bucket ran out: ask again when its next token is due
            while granted and st.queue:
                f = st.queue.popleft()
                if not f.done():
                    f.set_result(True)
                    granted -= 1
            if granted:
                st.tokens, st.got_at = st.tokens + granted, now
            if st.queue and dry:
                await asyncio.sleep(max(wait_s, _MIN_POLL_S))

    # -- public -----------------------------------------------------------------------------------------
    async def acquire(self, name: str, rate: float, until: float | None = None, burst: float | None = None) -> bool:
        """Take one token of ``name``'s bucket, waiting for it until ``until`` at most.

        Args:
            name: the bucket (under this limiter's kind). rate: tokens per second (<= 0: unlimited).
            until: the running loop's ``time()`` by which the token must be had (None: no bound).
            burst: bucket size (default :func:`default_burst`).
        Returns True with a token (or when unlimited, or Redis is unavailable); False when it could not be
        had by ``until``: at once when the bucket's next token, after the waiters ahead, comes too late.
        """
        if not rate > 0:
            return True
        burst = float(burst) if burst is not None else default_burst(rate)
        loop = asyncio.get_running_loop()
        st = self._stock(name)
        now = loop.time()
        if not st.queue and self._spend_local(st, now):
            return True
        if until is not None:
            ahead = max(0.0, len(st.queue) - burst) / rate
            if now >= until or max(0.0, st.next_at - now) + ahead > until - now:
                self._count("handed_back")
                return False
        self._count("waited")
        fut = loop.create_future()
        st.queue.append(fut)
        if st.fetch is None or st.fetch.done():
            st.fetch = loop.create_task(self._fetch(name, st, rate, burst))
        try:
            if until is None:
                return await fut
            async with asyncio.timeout_at(until):
                return await fut
        except TimeoutError:
            self._count("handed_back")
            return False
        finally:
            if not fut.done():
                fut.cancel()

    async def try_acquire(self, name: str, rate: float, burst: float | None = None) -> bool:
        """Take one token of ``name``'s bucket without waiting for a refill (one Redis call when the local
        stock is out). Returns False when the bucket is empty; True otherwise (also when unlimited or
        Redis is unavailable)."""
        if not rate > 0:
            return True
        burst = float(burst) if burst is not None else default_burst(rate)
        loop = asyncio.get_running_loop()
        st = self._stock(name)
        if self._spend_local(st, loop.time()):
            return True
        if loop.time() < st.next_at:
            return False
        want = max(1, min(self.block, int(rate * self.hold_s / 4) or 1))  # a few calls per hold_s
        try:
            granted, wait_s = await loop.run_in_executor(self._pool, self._take, name, rate, burst, want)
        except Exception as exc:  # noqa: BLE001 - fail open
            self._unavailable(exc)
            return True
        now = loop.time()
        st.next_at = now + wait_s if granted == 0 else 0.0
        if granted == 0:
            return False
        st.tokens, st.got_at = st.tokens + granted - 1, now
        return True

    def flush(self) -> None:
        """Write the pending event counts now (blocking)."""
        self.counts.flush()

    def close(self) -> None:
        """Flush the counts and stop the limiter's threads."""
        try:
            self.counts.flush()
        finally:
            self._pool.shutdown(wait=False)


class WorkspaceBudget:
    """Checks per second per workspace, enforced where promote claims routes (:func:`magpie.pipeline.promote.promote`).

    A claimed lease's owners are read from its payload (the clear ``w`` field); each limited owner's
    bucket (``<prefix>ratelimit:workspace:<id>``) is asked for the batch's demand in one pipelined call.
    A lease goes ahead when one owner is unlimited or pays a token; otherwise (every owner out of budget)
    it is deferred until its owners' next token, at least ``min_defer_ms``. Tokens taken but not spent
    (a route charged to one of several owners) are handed back.

    Args:
        client: Redis client. prefix: ``MAGPIE_REDIS_PREFIX``. default_rate: checks/s of a workspace
            without an override (0: unlimited). rates: overrides ``{workspace id: checks/s}``.
        min_defer_ms: shortest deferral.
    """

    def __init__(self, client: redis_lib.Redis, prefix: str, default_rate: float = 0.0,
                 rates: dict[int, float] | None = None, *, min_defer_ms: int = 1000):
        self.client, self.prefix = client, prefix
        self.default_rate = float(default_rate)
        self.rates = dict(rates or {})
        self.min_defer_ms = int(min_defer_ms)
        self.counts = EventCounts(client, prefix, "workspace")

    @classmethod
    def from_settings(cls, client: redis_lib.Redis, settings) -> WorkspaceBudget | None:
        """The budget of ``MAGPIE_WORKSPACE_CHECK_RATE`` / ``MAGPIE_WORKSPACE_CHECK_RATES``; None when
        neither limits anything."""
        from magpie.config import parse_workspace_rates

        rates = parse_workspace_rates(getattr(settings, "workspace_check_rates", ""))
        default = float(getattr(settings, "workspace_check_rate", 0.0) or 0.0)
        if default <= 0 and not any(r > 0 for r in rates.values()):
            return None
        return cls(client, settings.redis_prefix, default, rates)

    def rate_of(self, workspace: int) -> float:
        """Checks per second of ``workspace`` (0: unlimited)."""
        return float(self.rates.get(workspace, self.default_rate))

    @staticmethod
    def owners(lease) -> list[int]:
        """Workspace ids owning a lease's route, from its payload (empty when unreadable)."""
        import json

        try:
            w = json.loads(lease.payload).get("w") or []
            return [int(x) for x in w]
        except (ValueError, TypeError, AttributeError):
            return []

    def admit(self, leases: list) -> tuple[list, list[tuple[object, int]]]:
        """Split claimed ``leases`` into ``(go ahead, [(lease, defer ms)])`` (see the class doc).
        Fails open (everything goes ahead) when Redis cannot be asked."""
        owners = [self.owners(le) for le in leases]
        demand: Counter[int] = Counter()
        for ws in owners:
            if ws and all(self.rate_of(w) > 0 for w in ws):
                demand.update(ws)
        if not demand:
            return list(leases), []
        order = sorted(demand)
        try:
            got = take_many(self.client, [(bucket_key(self.prefix, "workspace", str(w)), self.rate_of(w),
                                           default_burst(self.rate_of(w)), demand[w]) for w in order])
        except redis_lib.RedisError:
            self.counts.add("unavailable")
            return list(leases), []
        left = {w: g for w, (g, _wait) in zip(order, got)}
        wait = {w: s for w, (_g, s) in zip(order, got)}
        go, defer = [], []
        for le, ws in zip(leases, owners):
            if not ws or not all(w in left for w in ws):
                go.append(le)
                continue
            payer = next((w for w in ws if left[w] > 0), None)
            if payer is not None:
                left[payer] -= 1
                go.append(le)
            else:
                defer.append((le, max(self.min_defer_ms, int(min(wait[w] for w in ws) * 1000))))
        unused = [(bucket_key(self.prefix, "workspace", str(w)), self.rate_of(w), default_burst(self.rate_of(w)),
                   -n) for w, n in left.items() if n > 0]
        try:
            take_many(self.client, unused)
        except redis_lib.RedisError:
            pass  # the tokens are lost for this second only
        if defer:
            self.counts.add("deferred", len(defer))
        self.counts.flush()
        return go, defer


def judge_bucket_name(url: str) -> str:
    """Bucket name of the judge at ``url``: a digest, so no URL (nor a password in it) lands in a key."""
    import hashlib

    return hashlib.sha256(url.encode()).hexdigest()[:24]


__all__ = ["BlockLimiter", "EVENTS", "EventCounts", "KINDS", "TokenBucket", "WorkspaceBudget", "bucket_key",
           "default_burst",
           "judge_bucket_name", "take_many"]
