"""Conformance suite fixtures: every test runs once per registered queue backend.

A backend factory takes ``(redis_client, prefix, interval_ms, lease_ms, clock, **kw)`` and returns an
object implementing :class:`magpie.queue.backend.QueueBackend`, plus a ``force_due(member, score)``
test hook that moves a route's due time.
"""

from __future__ import annotations

import pytest

from magpie.queue import QueueKeys, RouteQueue
from magpie.queue.backend import QueueBackend


class RedisBackend(RouteQueue):
    def force_due(self, member: str, score: float = 1000) -> None:
        shard = self.keys.shard_of(member)
        self.r.zadd(shard, {member: score})
        self.r.zadd(self.keys.heads, {shard: self.r.zrange(shard, 0, 0, withscores=True)[0][1]})


def redis_backend(client, prefix, interval_ms, lease_ms, clock=None, shards=4, **kw):
    return RedisBackend(client, QueueKeys(prefix, shards), interval_ms=interval_ms, lease_ms=lease_ms, clock=clock,
                        **kw)


BACKENDS = {"redis": redis_backend}


class Clock:
    """A hand-driven clock in Unix ms for deterministic tests."""

    def __init__(self, start: int = 1_800_000_000_000):
        self.now = start

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += int(ms)


@pytest.fixture(params=sorted(BACKENDS))
def make_queue(request, redis_client, redis_prefix):
    factory = BACKENDS[request.param]

    def make(interval_ms=60_000, lease_ms=60_000, clock=None, **kw):
        q = factory(redis_client, redis_prefix, interval_ms, lease_ms, clock, **kw)
        assert isinstance(q, QueueBackend)
        return q

    return make


@pytest.fixture
def q(make_queue):
    return make_queue()


@pytest.fixture
def clock():
    return Clock()
