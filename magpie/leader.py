"""Renewable Redis leader locks for leader-only jobs (``magpie:leader:<job>``).

A leader lock is a lease, not a permanent primary: acquire with a random per-holder token
(``SET NX PX``), renew at a third of the TTL with compare-and-extend, release with compare-and-delete.
A renewal that fails (lost lock, or Redis unreachable) fires the holder's cancellation event so the job
stops at its next safe point; whoever acquires next resumes the work. When Redis comes back, contention
simply resumes: acquisition is retried by the next task run.

The two scripts are ``lua/leader_extend.lua`` and ``lua/leader_release.lua`` (read once per process,
registered once per lock). :func:`lock_key` and :func:`locks_held` are the lock names' one spelling for
readers such as the metrics exporter and ``magpie maintenance status``.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import redis

from magpie.queue.scripts import LUA_DIR

log = logging.getLogger(__name__)

STANDING_LOCKS: tuple[str, ...] = ("respread", "alerts", "outbox-housekeeping")
"""Leader-lock names taken outside the maintenance registry: ``magpie respread``, the alert evaluation and
the outbox housekeeping. Each maintenance job's lock is its :attr:`magpie.maintenance.base.Job.lock`."""


def lock_key(prefix: str, name: str) -> str:
    """Redis key of the leader lock ``name``: ``f"{prefix}leader:{name}"``."""
    return f"{prefix}leader:{name}"


def locks_held(client: redis.Redis, prefix: str, names: Sequence[str]) -> list[bool]:
    """Whether some process holds each leader lock of ``names`` now (one pipelined round trip).

    Returns:
        One bool per name, in order.
    Raises:
        redis.RedisError: Redis unreachable.
    """
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(lock_key(prefix, name))
    return [bool(x) for x in pipe.execute()]


@functools.cache
def _script_text(name: str) -> str:
    """Text of ``lua/<name>.lua``, read once per process."""
    return (LUA_DIR / f"{name}.lua").read_text(encoding="utf-8")


class LeaderLock:
    """One holder's lease on the leader lock of ``job``.

    Args:
        client: redis-py client.
        prefix: key prefix (``MAGPIE_REDIS_PREFIX``); the key is ``<prefix>leader:<job>``.
        job: job name, e.g. ``respread``, ``retention``, ``alerts``.
        ttl_ms: lease length in ms; renewed every ``ttl_ms / 3`` by :meth:`hold`.
    """

    def __init__(self, client: redis.Redis, prefix: str, job: str, ttl_ms: int = 30_000):
        self.r = client
        self.key = lock_key(prefix, job)
        self.job = job
        self.ttl_ms = int(ttl_ms)
        self.token = f"{os.getpid()}-{secrets.token_hex(8)}"
        self.lost = threading.Event()
        self._extend = client.register_script(_script_text("leader_extend"))  # compare-and-extend
        self._release = client.register_script(_script_text("leader_release"))  # compare-and-delete

    def acquire(self) -> bool:
        """Try once; True when this holder now owns the lock, False when another holder has it.

        Raises ``redis.RedisError`` when Redis is unreachable (that is not contention: the caller's job
        fails and is retried on its next run, when contention simply resumes).
        """
        ok = bool(self.r.set(self.key, self.token, nx=True, px=self.ttl_ms))
        if ok:
            self.lost.clear()
        return ok

    def renew(self) -> bool:
        """Compare-and-extend; on failure sets :attr:`lost` and returns False."""
        try:
            ok = bool(self._extend(keys=[self.key], args=[self.token, self.ttl_ms]))
        except redis.RedisError as exc:
            log.warning("leader lock %s: renewal failed: %s", self.key, exc)
            ok = False
        if not ok:
            self.lost.set()
        return ok

    def release(self) -> bool:
        """Compare-and-delete; True when this holder's lock was deleted."""
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

    @contextmanager
    def hold(self) -> Iterator[threading.Event | None]:
        """Acquire, keep renewing in a background thread, release on exit (``redis.RedisError`` when
        Redis is unreachable at the start).

        Yields the cancellation event, or ``None`` when another holder has the lock (do nothing then).
        The event is set when a renewal is refused or fails, or when no renewal has been confirmed for a
        whole TTL (Redis unreachable): stop at the next safe point, another instance may lead by now.
        """
        if not self.acquire():
            yield None
            return
        stop = threading.Event()
        confirmed = [time.monotonic()]

        def renewer():
            while not stop.wait(self.ttl_ms / 3000):
                if not self.renew():
                    return
                confirmed[0] = time.monotonic()

        def watchdog():  # a renewal blocked on a dead connection must not keep a stale leader running
            while not stop.wait(self.ttl_ms / 6000):
                if time.monotonic() - confirmed[0] > self.ttl_ms / 1000:
                    self.lost.set()
                    return

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
