"""A private Redis Cluster (3 masters + 3 replicas on free loopback ports, :mod:`magpie.lab.cluster`) for
the tests that need the cluster protocol. One cluster per test session, started on first use (~3-8 s:
the replicas' first sync) and stopped by PID at the end; tests skip cleanly without ``redis-server``.

Each test writes under its own key prefix (``cluster_prefix``) and deletes what it wrote. Tests that kill
or migrate nodes take ``fault_cluster`` instead: a cluster of their own (module scope), so a killed master
never disturbs the shared one.
"""

from __future__ import annotations

import shutil
import uuid

import pytest

from magpie.base import redisconn
from magpie.lab.cluster import LocalCluster


def _start() -> LocalCluster:
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server / redis-cli not installed")
    return LocalCluster().start()


@pytest.fixture(scope="session")
def redis_cluster():
    """The session's :class:`LocalCluster` (never killed or migrated by tests)."""
    c = _start()
    yield c
    c.stop()


@pytest.fixture
def cluster_prefix(redis_cluster):
    """A fresh key prefix; every key holding it is deleted from the cluster after the test."""
    prefix = f"magpie-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    r = redisconn.connect(redis_cluster.url)
    redisconn.delete_many(r, list(r.scan_iter(match="*" + prefix + "*", count=10_000)))
    r.close()


@pytest.fixture
def cluster_client(redis_cluster):
    """A :class:`redis.RedisCluster` client (bytes replies) on the session's cluster."""
    r = redisconn.connect(redis_cluster.url)
    yield r
    r.close()


@pytest.fixture(scope="module")
def fault_cluster():
    """A cluster of the module's own, for tests that kill masters or migrate slots."""
    c = _start()
    yield c
    c.stop()
