"""Per-process resources shared by tasks and the CLI: Redis client, route queue, check pool, database engine.

Built lazily and rebuilt after a fork (prefork Celery workers must not share sockets with their parent).
"""

from __future__ import annotations

import functools
import os
import sys
import threading

import redis

from magpie.base import redisconn
from magpie.config import Settings, get_settings

ISOLATED_CHILD = (sys.executable, "-m", "magpie.wiring.runtime")
"""The isolated check process's command line (:func:`isolated_check_main`)."""

_lock = threading.RLock()  # factories nest (route_queue -> redis_client)
_cache: dict = {}

worker_state: dict = {"checks": False, "prefork": True}
"""What this Celery worker runs (set by :mod:`magpie.wiring.worker` at start): ``checks`` (it consumes the
``checks`` queue) and ``prefork`` (a prefork pool)."""


def _get(name, factory):
    key = (os.getpid(), name)
    v = _cache.get(key)
    if v is None:
        with _lock:
            v = _cache.get(key)
            if v is None:
                v = _cache[key] = factory()
    return v


def settings() -> Settings:
    return get_settings()


def redis_client() -> redis.Redis:
    """redis-py client on ``MAGPIE_REDIS_URL`` (bytes replies)."""
    return _get("redis", lambda: redisconn.connect(settings().redis_url, health_check_interval=30))


def route_queue():
    """The schedule provider of this deployment (``MAGPIE_SCHEDULE_URL``: Redis or PostgreSQL)."""
    from magpie.queue.provider import create_provider

    return _get("queue", lambda: create_provider(settings().schedule_url, settings(), redis_client=redis_client()))


def engine():
    from magpie.db.session import get_engine

    return get_engine(settings().database_url)


def capacity_registry():
    """The :class:`magpie.queue.capacity.CapacityRegistry` of this deployment's schedule."""
    return _get("capacity", lambda: route_queue().capacity_registry())


def check_pool():
    """This process's started :class:`magpie.pipeline.checkpool.CheckPool` (built on first use, after a fork anew).

    Its capacity is ``MAGPIE_CHECKS_PER_PROCESS`` capped below the descriptor limit; its completions append
    results to the stream atomically, it records check metrics and announces its slots to the capacity
    registry.
    """

    def build():
        from magpie.base import counters
        from magpie.base.backoff import Backoff
        from magpie.judges.checking import profiled_engine
        from magpie.judges.ownership import OwnerChanges
        from magpie.checker.limits import checks_within_fd_limit
        from magpie.pipeline.checkpool import CheckPool
        from magpie.pipeline.isolation import check_isolated
        from magpie.queue.quarantine import QuarantineSlot
        from magpie.queue.completion import StreamTarget
        from magpie.queue.payload import read_cipher

        s = settings()
        checks, stream, prefix = s.checks, s.stream, s.redis_prefix
        r = redis_client()

        def record(report, entries):
            counters.record_check_batch(r, prefix, counters.check_outcomes(report, entries),
                                        report.stale_completions, [])
            if report.dropped:
                counters.count_stats_drops(r, prefix, stream.overflow, report.dropped)

        def timings(samples):
            counters.record_start_timings(r, prefix, samples)

        pool = CheckPool(
            route_queue(), profiled_engine(s, engine(), r),
            StreamTarget.from_settings(s), block_timeout=stream.block_timeout,
            capacity=checks_within_fd_limit(checks.checks_per_process), renew_below_ms=checks.renew_below_ms,
            backoff=Backoff("exponential", checks.retry_base_ms, checks.retry_cap_ms, 2.0, "full"),
            registry=capacity_registry(), record=record, timings=timings,
            complete_interval=checks.complete_interval, heartbeat=checks.heartbeat,
            payload_cipher=read_cipher(s), quarantine=QuarantineSlot(r, prefix),
            owner_changes=OwnerChanges(r, prefix),
            isolate=functools.partial(check_isolated, argv=ISOLATED_CHILD))
        return pool.start()

    return _get("check_pool", build)


def close_check_pool() -> None:
    """Close this process's check pool if one runs (running checks cancelled, leases handed back)."""
    pool = _cache.pop((os.getpid(), "check_pool"), None)
    if pool is not None:
        pool.close()


def isolated_check_main() -> int:
    """The isolated check process (``python -m magpie.wiring.runtime``, :data:`ISOLATED_CHILD`): reads one
    line ``{"payload": text}`` on stdin, checks it with this deployment's profiled engine, writes the
    :class:`magpie.checker.result.CheckResult` as one JSON line and exits 0; exits 3 at once when stdin
    closes (the pool's process is gone)."""
    import asyncio
    import dataclasses
    import json
    import logging
    import sys

    from magpie.checker.result import CheckResult

    from magpie.judges.checking import profiled_engine
    from magpie.queue.payload import Payload, read_cipher

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s isolated check: %(message)s")
    line = sys.stdin.buffer.readline()
    if not line:
        return 3
    payload_text = json.loads(line)["payload"]
    s = settings()
    checker = profiled_engine(s, engine(), redis_client(), subscribe=False)
    payload = Payload.decode(payload_text, read_cipher(s))

    async def run() -> CheckResult:
        loop = asyncio.get_running_loop()
        fd = sys.stdin.fileno()

        def on_input() -> None:
            if not os.read(fd, 4096):  # the pool's process is gone: so is this check
                os._exit(3)
        loop.add_reader(fd, on_input)
        return await checker.check_payload(payload)

    res = asyncio.run(run())
    sys.stdout.write(json.dumps(dataclasses.asdict(res)) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the engine's caches run daemon threads: nothing else to wait for


if __name__ == "__main__":
    import sys

    sys.exit(isolated_check_main())
