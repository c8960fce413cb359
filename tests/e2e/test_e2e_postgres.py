"""End to end with the schedule in PostgreSQL (``MAGPIE_SCHEDULE_URL=postgresql://...``): a real Celery worker
and beat promote, check and complete the lab's routes; results reach PostgreSQL through the results outbox
and the Redis Stream; a killed worker's leases are reclaimed by the next claims (no sweeper)."""

from __future__ import annotations

import contextlib
import os
import signal
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from helpers import TimedOut, checked_until, spawn_celery, stop_group, wait_until

from magpie.base.crypto import get_keyring
from magpie.db.repo import latest_health
from magpie.importer.service import import_file
from magpie.lab.lab import start_free_lab
from magpie.queue.pg import PgSchedule
from magpie.queue.provider import create_provider

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def worker_env(settings, pg_url, redis_prefix, lab, **overrides) -> dict:
    env = dict(os.environ)
    env.update({
        "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": redis_prefix,
        "MAGPIE_BROKER_URL": settings.redis_url, "MAGPIE_BROKER_KEY_PREFIX": redis_prefix + "broker:",
        "MAGPIE_DATABASE_URL": pg_url, "MAGPIE_SCHEDULE_URL": pg_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
        "MAGPIE_JUDGE_URL": lab.judge_url, "MAGPIE_JUDGE_FAILOVERS": "0",
        "MAGPIE_PROFILE_MAX_TIMEOUT": overrides.get("MAGPIE_CHECK_TIMEOUT", "4"),
        "MAGPIE_PROFILE_MAX_ATTEMPTS": overrides.get("MAGPIE_CHECK_ATTEMPTS", "3"),
    })
    env.update(overrides)
    return env


def test_pipeline_checks_lab_routes_repeatedly_with_the_schedule_in_postgres(settings, db, pg_url, redis_prefix,
                                                                             tmp_path):
    lab = start_free_lab(slow_delay=1.0)
    try:
        env = worker_env(settings, pg_url, redis_prefix, lab, MAGPIE_CHECK_INTERVAL="3", MAGPIE_CHECK_TIMEOUT="4",
                         MAGPIE_LEASE_SECONDS="30", MAGPIE_RENEW_BELOW_SECONDS="10")
        s2 = settings.model_copy(update={"check_interval": 3.0, "schedule_url": pg_url})
        lst = tmp_path / "lab.txt"
        lab.write_list(lst)
        rep = import_file(lst, "e2e", s2)
        assert rep.imported == len(lab.proxies) and not rep.invalid
        q = create_provider(pg_url, s2)
        assert isinstance(q, PgSchedule)
        assert q.status()["totals"]["scheduled"] == len(lab.proxies)
        assert q.r.exists(q.keys.shard(0)) == 0  # nothing of the schedule lives in Redis
        log = open(tmp_path / "celery.log", "w")
        procs = [
            spawn_celery(["worker", "-Q", "promote,checks,stats", "-n", f"pg-{redis_prefix}@%h", "--concurrency=2",
                          "--loglevel=info", "--without-mingle", "--without-gossip"], env, log, ROOT),
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
            outbox = c.execute(sa.text("SELECT count(*) FROM schedule_results")).scalar()
        assert n >= 2 * len(expected)
        assert outbox == 0  # every completed result was relayed to the stream
        st = q.status()["totals"]
        assert st["scheduled"] == len(lab.proxies) and st["dead"] == 0
        q.close()
    finally:
        lab.stop()


@pytest.mark.slow  # the same lease expiry runs in the default suite on Redis, and on both backends in conformance
def test_a_killed_workers_leases_are_reclaimed_on_postgres(settings, db, pg_url, redis_prefix, tmp_path):
    lab = start_free_lab(slow_delay=2.0)
    try:
        env = worker_env(settings, pg_url, redis_prefix, lab, MAGPIE_CHECK_INTERVAL="2", MAGPIE_CHECK_TIMEOUT="3",
                         MAGPIE_CHECK_ATTEMPTS="1", MAGPIE_LEASE_SECONDS="5", MAGPIE_RENEW_BELOW_SECONDS="0")
        s2 = settings.model_copy(update={"check_interval": 2.0, "lease_seconds": 5.0, "check_attempts": 1,
                                         "schedule_url": pg_url})
        lst = tmp_path / "lab.txt"
        lab.write_list(lst)
        import_file(lst, "crash", s2)
        q = create_provider(pg_url, s2)
        log = open(tmp_path / "celery.log", "w")
        worker_args = ["worker", "-Q", "promote,checks,stats", "--concurrency=2", "--loglevel=info",
                       "--without-mingle", "--without-gossip"]
        beat = spawn_celery(["beat", "--loglevel=info", f"--schedule={tmp_path / 'beat'}"], env, log, ROOT)
        victim = spawn_celery(worker_args + ["-n", f"victim-{redis_prefix}@%h"], env, log, ROOT)
        survivor = None
        try:
            with contextlib.suppress(TimedOut):  # asserted below
                wait_until(lambda: q.status()["totals"]["leased"] > 0, timeout=30, interval=0.1,
                           what="the victim holding a lease")
            assert q.status()["totals"]["leased"] > 0, "the victim never held a lease"
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            killed_at = datetime.now(UTC)
            survivor = spawn_celery(worker_args + ["-n", f"survivor-{redis_prefix}@%h"], env, log, ROOT)
            rows = []

            def rechecked():
                rows[:] = latest_health(db, "crash", keyring=get_keyring(settings.encryption_key))
                return rows and all(r["last_checked_at"] and r["last_checked_at"] > killed_at for r in rows)

            with contextlib.suppress(TimedOut):  # asserted below, with the logs
                wait_until(rechecked, timeout=60, interval=0.25, what="every route checked after the kill")
        finally:
            for p in (beat, victim, survivor):
                if p is not None:
                    stop_group(p)
            log.close()
        late = [r for r in rows if not (r["last_checked_at"] and r["last_checked_at"] > killed_at)]
        assert len(rows) == len(lab.proxies) and not late, (late, (tmp_path / "celery.log").read_text()[-3000:])
        st = q.status()["totals"]
        assert st["scheduled"] == len(lab.proxies) and st["dead"] == 0
        q.close()
    finally:
        lab.stop()
