"""Renewable Redis leader locks for leader-only jobs (``magpie:leader:<job>``), with fencing tokens.

A leader lock is a lease, not a permanent primary: acquire with a random per-holder token
(``lua/leader_acquire.lua``: ``SET NX PX``), renew every third of the TTL with compare-and-extend
(``lua/leader_extend.lua``), release with compare-and-delete (``lua/leader_release.lua``). When the other
work is built on top, three rules keep it to one leader at a time:

* **A lease that cannot be confirmed is lost at once.** A renewal that fails (connection error, lock
  gone, or a Redis server other than the one the lock was taken on: its ``run_id`` from ``INFO server``,
  recorded at acquisition, changed because Redis restarted or failed over) sets the holder's
  cancellation event immediately; a watchdog sets it when the lease sent last runs out unconfirmed (a
  renewal stuck on a dead connection). Lock calls use a client of their own without retries and with
  socket timeouts below the renewal interval, so a failure is seen at once, not after a retry loop.
* **Nobody new leads right after a Redis start.** A restart that loses the data loses the lock, but its
  former holder learns so only at its next renewal; a server that started less than
  :attr:`LeaderLock.quiet_ms` (one renewal interval plus a second) ago refuses every acquisition, so the
  former holder has stopped before anyone else starts.
* **Protected writes carry a fencing token.** Each acquisition gets the lock's next *generation*
  (:attr:`LeaderLock.generation`): an ``INCR`` counter raised to at least the Redis clock in ms, so it
  grows across a restart that lost the counter. A write that must not come from a former leader (a
  process paused past its lease, then resumed) checks it with :func:`magpie.coordination.fencing.fence`, which refuses
  a generation older than the newest one recorded.

:func:`lock_key` and :func:`locks_held` are the lock names' one spelling for readers such as the metrics
exporter and ``magpie maintenance status``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import redis

from magpie.queue.scripts import LUA_DIR
from magpie.base.redisconn import is_cluster

log = logging.getLogger(__name__)

STANDING_LOCKS: tuple[str, ...] = ("respread", "alerts", "outbox-housekeeping")
"""Leader-lock names taken outside the maintenance job list: ``magpie respread``, the alert evaluation and
the outbox housekeeping. Each maintenance job's lock is its :attr:`magpie.maintenance.base.Job.lock`."""

DRIFT = 0.02
"""Share of the TTL a holder gives up to clock-rate differences: it counts its lease as over after
``ttl * (1 - DRIFT)`` from the moment it sent the acquisition or renewal."""

QUIET_EXTRA_MS = 1000
"""Added to one renewal interval to make the quiet period after a Redis start (round trips, timeouts)."""


def lock_key(prefix: str, name: str, tagged: bool = False) -> str:
    """Redis key of the leader lock ``name``: ``f"{prefix}leader:{name}"``; on a Redis Cluster (``tagged``)
    ``f"{prefix}leader:{{{name}}}"``, so that the lock and its generation counter share a slot (the
    acquire script takes both)."""
    return f"{prefix}leader:{{{name}}}" if tagged else f"{prefix}leader:{name}"


def generation_key(prefix: str, name: str, tagged: bool = False) -> str:
    """Redis key of the generation counter of the lock ``name``: ``f"{prefix}leader:{name}:generation"``
    (tagged like :func:`lock_key`)."""
    return f"{lock_key(prefix, name, tagged)}:generation"


def locks_held(client: redis.Redis, prefix: str, names: Sequence[str]) -> list[bool]:
    """Whether some process holds each leader lock of ``names`` now (one pipelined round trip).

    Returns:
        One bool per name, in order.
    Raises:
        redis.RedisError: Redis unreachable.
    """
    tagged = is_cluster(client)
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(lock_key(prefix, name, tagged))
    return [bool(x) for x in pipe.execute()]


@functools.cache
def _script_text(name: str) -> str:
    """Text of ``lua/<name>.lua``, read once per process."""
    return (LUA_DIR / f"{name}.lua").read_text(encoding="utf-8")


def _lock_client(client: redis.Redis, timeout_s: float) -> tuple[redis.Redis, bool]:
    """A client on the same server without retries and with socket timeouts of at most ``timeout_s``
    (its own small pool), and whether it is new (to be closed). Pools of other kinds (Sentinel, Cluster)
    keep the caller's client."""
    pool = getattr(client, "connection_pool", None)  # a RedisCluster has none: it keeps the caller's client
    if type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
        return client, False
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw = dict(pool.connection_kwargs)
    kw["retry"] = Retry(NoBackoff(), 0)
    for name in ("socket_timeout", "socket_connect_timeout"):
        kw[name] = min(kw.get(name) or math.inf, timeout_s)
    try:
        fast = redis.Redis(connection_pool=redis.ConnectionPool(
            connection_class=pool.connection_class, max_connections=4, **kw))
    except (TypeError, ValueError):
        return client, False
    return fast, True


class LeaderLock:
    """One holder's lease on the leader lock of ``job``.

    Args:
        client: redis-py client (its server and credentials; lock calls go through a client of their own
            without retries, see the module doc).
        prefix: key prefix (``MAGPIE_REDIS_PREFIX``); the key is ``<prefix>leader:<job>``.
        job: job name, e.g. ``respread``, ``retention``, ``alerts``.
        ttl_ms: lease length in ms; renewed every ``ttl_ms / 3`` by :meth:`hold`.

    Attributes:
        generation: the fencing token of the current holding (int), None before an acquisition.
        run_id: the Redis server's ``run_id`` when the lock was taken.
        refusal: why the last :meth:`acquire` failed: ``"held"`` (another holder) or ``"restarting"``
            (Redis started less than :attr:`quiet_ms` ago); None after a success.
        lost: set when leadership ends (refused or failed renewal, unconfirmed lease, release).
    """

    def __init__(self, client: redis.Redis, prefix: str, job: str, ttl_ms: int = 30_000):
        tagged = is_cluster(client)
        self.key = lock_key(prefix, job, tagged)
        self.generation_key = generation_key(prefix, job, tagged)
        self.job = job
        self.ttl_ms = int(ttl_ms)
        self.token = f"{os.getpid()}-{secrets.token_hex(8)}"
        self.lost = threading.Event()
        self.generation: int | None = None
        self.run_id: str | None = None
        self.refusal: str | None = None
        self._lease_until = 0.0  # time.monotonic() at which the lease sent last runs out
        self.r, self._own_client = _lock_client(client, max(0.2, self.renew_interval_s))
        self._acquire = self.r.register_script(_script_text("leader_acquire"))
        self._extend = self.r.register_script(_script_text("leader_extend"))  # compare-and-extend
        self._release = self.r.register_script(_script_text("leader_release"))  # compare-and-delete

    @property
    def renew_interval_s(self) -> float:
        """Seconds between two renewals while :meth:`hold` runs: a third of the TTL."""
        return self.ttl_ms / 3000

    @property
    def quiet_ms(self) -> int:
        """Ms after a Redis start during which nobody acquires this lock: one renewal interval plus
        :data:`QUIET_EXTRA_MS`, time enough for a holder from before the restart to find out."""
        return int(self.ttl_ms / 3) + QUIET_EXTRA_MS

    @property
    def fence_name(self) -> str:
        """The name protected writes record this lock's generations under (its key)."""
        return self.key

    def acquire(self) -> bool:
        """Try once; True when this holder now owns the lock (with a new :attr:`generation`), False when
        another holder has it or Redis started moments ago (:attr:`refusal` says which).

        Raises ``redis.RedisError`` when Redis is unreachable (that is not contention: the caller's job
        fails and is retried on its next run, when contention simply resumes).
        """
        sent = time.monotonic()
        status, value, run_id = self._acquire(keys=[self.key, self.generation_key],
                                              args=[self.token, self.ttl_ms, self.quiet_ms])
        status = int(status)
        if status != 1:
            self.refusal = "held" if status == 0 else "restarting"
            return False
        self.generation = int(value)
        self.run_id = run_id.decode() if isinstance(run_id, bytes) else str(run_id)
        self.refusal = None
        self._lease_until = sent + self.ttl_ms / 1000 * (1 - DRIFT)
        self.lost.clear()
        return True

    def renew(self) -> bool:
        """Compare-and-extend on this server; on any failure sets :attr:`lost` and returns False."""
        sent = time.monotonic()
        try:
            res = int(self._extend(keys=[self.key], args=[self.token, self.ttl_ms, self.run_id or ""]))
        except redis.RedisError as exc:
            log.warning("leader lock %s: renewal failed, leadership ends: %s", self.key, exc)
            res = 0
        if res == 2:
            log.warning("leader lock %s: Redis restarted or failed over since the lock was taken; "
                        "leadership ends", self.key)
        if res != 1:
            self.lost.set()
            return False
        self._lease_until = sent + self.ttl_ms / 1000 * (1 - DRIFT)
        return True

    def release(self) -> bool:
        """Compare-and-delete; True when this holder's lock was deleted. Ends leadership either way."""
        self.lost.set()
        try:
            return bool(self._release(keys=[self.key], args=[self.token]))
        except redis.RedisError:
            return False

    def is_held(self) -> bool:
        """True when this holder owns the lock now; False when not, or when Redis is unreachable."""
        try:
            v = self.r.get(self.key)
        except redis.RedisError:
            return False
        return v is not None and (v.decode() if isinstance(v, bytes) else v) == self.token

    def close(self) -> None:
        """Close the lock's own connections (a lock is usable again afterwards: they reopen)."""
        if self._own_client:
            self.r.connection_pool.disconnect()

    @contextmanager
    def hold(self) -> Iterator[threading.Event | None]:
        """Acquire, keep renewing in a background thread, release on exit (``redis.RedisError`` when
        Redis is unreachable at the start).

        Yields the cancellation event, or ``None`` when the lock cannot be taken now (another holder, or
        Redis started moments ago; :attr:`refusal`): do nothing then. The event is set as soon as the
        lease cannot be confirmed (module doc): stop at the next safe point, another instance may lead
        by now, and writes fenced with :attr:`generation` would be refused.
        """
        try:
            if not self.acquire():
                yield None
                return
        except BaseException:
            self.close()
            raise
        stop = threading.Event()

        def renewer():
            while not stop.wait(self.renew_interval_s):
                if self.lost.is_set() or not self.renew():
                    return

        def watchdog():  # a renewal blocked on a dead connection must not keep a stale leader running
            while not stop.is_set() and not self.lost.is_set():
                left = self._lease_until - time.monotonic()
                if left <= 0:
                    log.warning("leader lock %s: lease not confirmed in time, leadership ends", self.key)
                    self.lost.set()
                    return
                stop.wait(min(left, self.renew_interval_s))

        threads = [threading.Thread(target=f, name=f"leader-{self.job}-{f.__name__}", daemon=True)
                   for f in (renewer, watchdog)]
        for t in threads:
            t.start()
        try:
            yield self.lost
        finally:
            stop.set()
            for t in threads:
                t.join(self.ttl_ms / 1000)
            self.release()
            self.close()


def slot_key(prefix: str, lock: str, slot: int) -> str:
    """Redis key recording that cadence slot ``slot`` of the lock ``lock`` ran."""
    return f"{prefix}leader:{lock}:slot:{slot}"


def claim_cadence_slot(client: redis.Redis, prefix: str, lock: str, cadence: float,
                       generation: int | None) -> int | None:
    """Record that the caller (holding leader lock ``lock``) runs the current cadence slot,
    ``floor(redis time / cadence)`` (``SET NX`` of :func:`slot_key`, kept two cadences).

    Args:
        cadence: the job's period in seconds (> 0).
        generation: the lock's fencing token, stored as the slot's value.
    Returns:
        The slot number claimed, or None when a pass already ran it (a second beat's trigger).
    Raises ``redis.RedisError`` when Redis is unreachable.
    """
    sec, usec = client.time()
    slot = int((int(sec) + int(usec) / 1e6) // cadence)
    ttl = max(1, int(2 * cadence + 1))
    return slot if client.set(slot_key(prefix, lock, slot), str(generation or 0), nx=True, ex=ttl) else None


__all__ = ["DRIFT", "LeaderLock", "STANDING_LOCKS", "claim_cadence_slot", "generation_key", "lock_key",
           "locks_held", "slot_key"]
