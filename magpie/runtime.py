"""Per-process resources shared by tasks and the CLI: Redis client, route queue, checker, engine.

Built lazily and rebuilt after a fork (prefork Celery workers must not share sockets with their parent).
"""

from __future__ import annotations

import os
import threading

import redis

from magpie.config import Settings, get_settings

_lock = threading.RLock()  # factories nest (route_queue -> redis_client)
_cache: dict = {}


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
    return _get("redis", lambda: redis.Redis.from_url(settings().redis_url, health_check_interval=30))


def route_queue():
    """The :class:`magpie.queue.RouteQueue` of this deployment."""
    from magpie.queue import RouteQueue

    return _get("queue", lambda: RouteQueue.from_settings(settings(), redis_client()))


def checker():
    """The process's :class:`magpie.checker.Checker` (it caches the checker's own address)."""
    from magpie.checker import Checker

    s = settings()
    return _get("checker", lambda: Checker(s.judge_url, timeout=s.check_timeout, attempts=s.check_attempts,
                                           body_cap=s.body_cap))


def engine():
    from magpie.db.session import get_engine

    return get_engine(settings().database_url)
