"""Conformance suite fixtures: every test runs once per schedule provider: ``redis``, ``redis-partitioned``
(the Redis schedule over 4 partitions), ``postgresql``, ``redis-cluster`` (the Redis schedule on a private
3+3 Redis Cluster, one partition, see tests/private_cluster.py) and ``redis-cluster-partitioned`` (4
partitions spread over that cluster's masters); the two cluster providers run in the slow tier.

Fixture API (use these names in any test file of this folder):

* ``make_queue(interval_ms=60_000, lease_ms=60_000, clock=None, **kw)`` builds a fresh, empty provider
  (``kw``: ``max_stalled``, ``log_limit``, ``shards``); ``clock`` is a :class:`Clock` (or any callable giving
  Unix ms) used instead of the server clock.
* ``q``: ``make_queue()`` with the defaults; ``clock``: a fresh :class:`Clock`; ``backend``: the provider's
  name (``"redis"`` or ``"postgresql"``).

Providers built here carry test hooks on top of :class:`magpie.queue.provider.ScheduleProvider`:
``force_due(member, score_ms)`` moves a route's due time (dropping a lease), ``put_payload(member, text)``
overwrites the stored payload behind the provider's back, ``leftovers()`` lists what the schedule still
stores (keys or rows) and ``drop_payload(member)`` (Redis only: payloads live apart from the schedule).
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from magpie.base import redisconn
from magpie.queue import QueueKeys, RouteQueue
from magpie.queue.partitioned import PartitionedSchedule
from magpie.queue.pg import PgSchedule
from magpie.queue.provider import ScheduleProvider


class RedisBackend(RouteQueue):
    """:class:`RouteQueue` with the suite's test hooks."""

    def force_due(self, member: str, score: float = 1000) -> None:
        shard = self.keys.shard_of(member)
        self.r.zadd(shard, {member: score})
        self.r.zadd(self.keys.heads, {shard: self.r.zrange(shard, 0, 0, withscores=True)[0][1]})

    def put_payload(self, member: str, text: str) -> None:
        self.r.set(self.keys.payload(member), text)

    def drop_payload(self, member: str) -> None:
        self.r.delete(self.keys.payload(member))

    def leftovers(self) -> list:
        return list(self.r.scan_iter(match=f"*{self.keys.prefix}*"))


class PartitionedBackend(PartitionedSchedule):
    """:class:`PartitionedSchedule` (4 partitions) with the suite's test hooks. ``keys_of(member)`` gives the
    :class:`QueueKeys` of the partition holding a route; ``all_keys(name)`` one key name per partition."""

    def keys_of(self, member: str) -> QueueKeys:
        return self._where(member).keys

    def all_keys(self, name: str) -> list[str]:
        return [getattr(q.keys, name) for q in self.parts]

    def force_due(self, member: str, score: float = 1000) -> None:
        k = self.keys_of(member)
        shard = k.shard_of(member)
        self.r.zadd(shard, {member: score})
        self.r.zadd(k.heads, {shard: self.r.zrange(shard, 0, 0, withscores=True)[0][1]})

    def put_payload(self, member: str, text: str) -> None:
        self.r.set(self.keys_of(member).payload(member), text)

    def drop_payload(self, member: str) -> None:
        self.r.delete(self.keys_of(member).payload(member))

    def leftovers(self) -> list:
        return list(self.r.scan_iter(match=f"*{self.prefix}*"))


class PgBackend(PgSchedule):
    """:class:`PgSchedule` with the suite's test hooks (``force_due`` is the provider's own)."""

    def put_payload(self, member: str, text: str) -> None:
        with self.tx() as cur:
            cur.execute("UPDATE schedule_routes SET payload = %s WHERE schedule = %s AND route = %s",
                        (text, self.name, member))

    def leftovers(self) -> list:
        with self.tx() as cur:
            out = []
            for table in ("schedule_routes", "schedule_meta", "schedule_results"):
                cur.execute(f"SELECT count(*) FROM {table} WHERE schedule = %s", (self.name,))
                out += [table] * cur.fetchone()[0]
            return out


class Clock:
    """A hand-driven clock in Unix ms for deterministic tests."""

    def __init__(self, start: int = 1_800_000_000_000):
        self.now = start

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += int(ms)


BACKENDS = ("redis", "redis-partitioned", "postgresql",
            pytest.param("redis-cluster", marks=pytest.mark.slow),
            pytest.param("redis-cluster-partitioned", marks=pytest.mark.slow))
PARTITIONS = 4
"""Partitions of the ``redis-partitioned`` and ``redis-cluster-partitioned`` providers."""


def is_redis(backend: str) -> bool:
    """True for the Redis schedule, on one server or on a cluster, partitioned or not."""
    return backend.startswith("redis")


def on_cluster(backend: str) -> bool:
    """True for the providers on the private Redis Cluster."""
    return backend.startswith("redis-cluster")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Name of the provider under test."""
    return request.param


@pytest.fixture
def redis_client(request, backend, redis_prefix):
    """The shared test Redis, or under ``redis-cluster`` a client of the private cluster (what the test
    wrote under ``redis_prefix`` there is deleted afterwards)."""
    from tests.conftest import REDIS_URL

    if not on_cluster(backend):
        r = redisconn.connect(REDIS_URL)
        yield r
        r.close()
        return
    cluster = request.getfixturevalue("redis_cluster")
    r = redisconn.connect(cluster.url)
    yield r
    redisconn.delete_many(r, list(r.scan_iter(match="*" + redis_prefix + "*", count=10_000)))
    r.close()


@pytest.fixture
def redis_url(request, backend):
    """URL of the Redis under test (the cluster's ``redis+cluster://`` URL under ``redis-cluster``)."""
    from tests.conftest import REDIS_URL

    if on_cluster(backend):
        return request.getfixturevalue("redis_cluster").url
    return REDIS_URL


@pytest.fixture
def results_key(backend, redis_prefix):
    """``results_key(name)``: a results stream key beside the schedule (tagged ``{default}`` on a cluster,
    as :func:`magpie.queue.streams.stream_key` does)."""
    return lambda name="results": redis_prefix + ("{default}:" if on_cluster(backend) else "") + name


@pytest.fixture
def make_queue(request, backend, redis_client, redis_prefix):
    built: list = []

    def make(interval_ms=60_000, lease_ms=60_000, clock=None, shards=4, **kw):
        keys = QueueKeys(redis_prefix, shards)
        if backend.endswith("-partitioned"):
            q = PartitionedBackend(redis_client, redis_prefix, shards, PARTITIONS, interval_ms=interval_ms,
                                   lease_ms=lease_ms, clock=clock, **kw)
        elif is_redis(backend):
            q = RedisBackend(redis_client, keys, interval_ms=interval_ms, lease_ms=lease_ms, clock=clock, **kw)
        else:
            q = PgBackend(request.getfixturevalue("pg_url"), keys, interval_ms=interval_ms, lease_ms=lease_ms,
                          clock=clock, redis_client=redis_client, **kw)
            q.check_layout()
        assert isinstance(q, ScheduleProvider)
        built.append(q)
        return q

    yield make
    if backend == "postgresql" and built:
        engine = sa.create_engine(request.getfixturevalue("pg_url"))
        with engine.begin() as c:
            for table in ("schedule_routes", "schedule_meta", "schedule_results"):
                c.execute(sa.text(f"DELETE FROM {table} WHERE schedule LIKE :p"), {"p": redis_prefix + "%"})
        engine.dispose()
        for q in built:
            q.close()


@pytest.fixture
def q(make_queue):
    return make_queue()


@pytest.fixture
def clock():
    return Clock()
