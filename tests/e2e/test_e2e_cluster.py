"""End to end on a Redis Cluster: real Celery workers and beat with ``MAGPIE_REDIS_URL=redis+cluster://...``
(a private 3+3 cluster) and the broker on the shared plain Redis (own key prefix), checking the lab's
proxies; results reach PostgreSQL through the tagged results stream on the cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from helpers import checked_until, spawn_celery, stop_group

from magpie.base import redisconn
from magpie.importer.service import import_file
from magpie.lab.lab import start_free_lab
from magpie.queue.streams import stream_key

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_workers_on_a_redis_cluster_check_lab_routes_into_postgres(redis_cluster, cluster_prefix, settings, db,
                                                                   pg_url, redis_prefix, tmp_path):
    import os

    cs = settings.model_copy(update={"redis_url": redis_cluster.url, "redis_prefix": cluster_prefix,
                                     "check_interval": 3.0, "database_url": pg_url})
    lab = start_free_lab(slow_delay=1.0)
    try:
        env = dict(os.environ)
        env.update({
            "MAGPIE_REDIS_URL": redis_cluster.url, "MAGPIE_REDIS_PREFIX": cluster_prefix,
            "MAGPIE_BROKER_URL": settings.redis_url, "MAGPIE_BROKER_KEY_PREFIX": redis_prefix + "broker:",
            "MAGPIE_DATABASE_URL": pg_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
            "MAGPIE_JUDGE_URL": lab.judge_url, "MAGPIE_CHECK_INTERVAL": "3", "MAGPIE_CHECK_TIMEOUT": "4",
            "MAGPIE_LEASE_SECONDS": "30", "MAGPIE_RENEW_BELOW_SECONDS": "10", "MAGPIE_MAINTENANCE_LOCK_TTL": "3",
        })
        lst = tmp_path / "lab.txt"
        lab.write_list(lst)
        rep = import_file(lst, "e2e", cs)
        assert rep.imported == len(lab.proxies) and not rep.invalid
        log = open(tmp_path / "celery.log", "w")
        procs = [
            spawn_celery(["worker", "-Q", "promote,checks,stats", "-n", f"e2e-{cluster_prefix}@%h",
                          "--concurrency=2", "--loglevel=info", "--without-mingle", "--without-gossip"], env, log, ROOT),
            spawn_celery(["beat", "--loglevel=info", f"--schedule={tmp_path / 'beat'}"], env, log, ROOT),
        ]
        try:
            rows = checked_until(procs, db, cs, tmp_path / "celery.log", stop_group, timeout=90)
        finally:
            log.close()
        expected = {(p.route.host, p.route.port): p for p in lab.proxies}
        tail = (tmp_path / "celery.log").read_text()[-3000:]
        assert len(rows) == len(expected), tail
        for r in rows:
            p = expected[(r["host"], r["port"])]
            assert r["checks_total"] >= 2, (p.name, r, tail)
            assert r["alive"] == p.expect_alive, (p.name, r)
        with db.connect() as c:
            assert c.execute(sa.text("SELECT count(*) FROM check_history")).scalar() >= 2 * len(expected)
        client = redisconn.connect(redis_cluster.url)
        assert client.xlen(stream_key(cluster_prefix, True)) > 0  # the results went through the tagged stream
        assert not client.exists(stream_key(cluster_prefix, False))
        client.close()
    finally:
        lab.stop()
