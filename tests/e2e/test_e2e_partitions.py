"""End to end with a partitioned schedule (``MAGPIE_SCHEDULE_PARTITIONS=4``): a real Celery worker and beat
promote, check and complete the lab's routes from four partitions; every partition's results stream is
ingested into PostgreSQL through the one consumer group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy as sa
from helpers import checked_until, spawn_celery, stop_group

from magpie.importer.service import import_file
from magpie.lab.lab import start_free_lab
from magpie.queue.partitioned import PartitionedSchedule
from magpie.queue.partitions import settings_stream_pairs
from magpie.queue.provider import create_provider

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_workers_check_lab_routes_from_four_partitions(settings, db, pg_url, redis_prefix, redis_client, tmp_path):
    lab = start_free_lab(slow_delay=1.0)
    try:
        env = dict(os.environ)
        env.update({
            "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": redis_prefix,
            "MAGPIE_BROKER_URL": settings.redis_url, "MAGPIE_BROKER_KEY_PREFIX": redis_prefix + "broker:",
            "MAGPIE_DATABASE_URL": pg_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
            "MAGPIE_JUDGE_URL": lab.judge_url, "MAGPIE_SCHEDULE_PARTITIONS": "4",
            "MAGPIE_CHECK_INTERVAL": "3", "MAGPIE_CHECK_TIMEOUT": "4", "MAGPIE_LEASE_SECONDS": "30",
            "MAGPIE_RENEW_BELOW_SECONDS": "10",
        })
        s4 = settings.model_copy(update={"check_interval": 3.0, "schedule_partitions": 4})
        lst = tmp_path / "lab.txt"
        lab.write_list(lst)
        rep = import_file(lst, "e2e", s4)
        assert rep.imported == len(lab.proxies) and not rep.invalid
        q = create_provider(None, s4, redis_client=redis_client)
        assert isinstance(q, PartitionedSchedule)
        per = [p["scheduled"] for p in q.status()["partitions"]]
        assert sum(per) == len(lab.proxies) and sum(1 for n in per if n) >= 2
        log = open(tmp_path / "celery.log", "w")
        procs = [
            spawn_celery(["worker", "-Q", "promote,checks,stats", "-n", f"part-{redis_prefix}@%h",
                          "--concurrency=2", "--loglevel=info", "--without-mingle", "--without-gossip"], env, log,
                         ROOT),
            spawn_celery(["beat", "--loglevel=info", f"--schedule={tmp_path / 'beat'}"], env, log, ROOT),
        ]
        try:
            rows = checked_until(procs, db, settings, tmp_path / "celery.log", stop_group)
        finally:
            log.close()
        expected = {(p.route.host, p.route.port): p for p in lab.proxies}
        assert len(rows) == len(expected)
        for r in rows:
            p = expected[(r["host"], r["port"])]
            assert r["checks_total"] >= 2, (p.name, r, (tmp_path / "celery.log").read_text()[-3000:])
            assert r["alive"] == p.expect_alive, (p.name, r)
        with db.connect() as c:
            n = c.execute(sa.text("SELECT count(*) FROM check_history")).scalar()
        assert n >= 2 * len(expected)
        pairs = settings_stream_pairs(s4)
        lengths = [redis_client.xlen(key) for key, _ in pairs]
        assert lengths[:2] == [0, 0] and sum(1 for x in lengths[2:] if x) >= 2  # results per partition stream
        st = q.status()["totals"]
        assert st["scheduled"] == len(lab.proxies) and st["dead"] == 0
    finally:
        lab.stop()
