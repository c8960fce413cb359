"""End to end: a real Celery worker and beat (subprocesses) check the lab's real proxies on loopback,
and the results land in PostgreSQL through the Redis Stream."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from helpers import TimedOut, checked_until, spawn_celery, stop_group, wait_until

from magpie.base.crypto import get_keyring
from magpie.db.repo import latest_health
from magpie.importer.service import import_file
from magpie.lab.lab import start_free_lab

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def worker_env(settings, pg_url, redis_prefix, lab, broker_url: str | None = None, **overrides) -> dict:
    """Environment for Celery subprocesses: the test's Redis prefix (schedule and broker keys), database,
    key and lab judge, plus ``MAGPIE_*`` overrides. ``broker_url``: a RabbitMQ vhost of the test's own
    instead of the test Redis under the prefix."""
    env = dict(os.environ)
    env.update({
        "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": redis_prefix,
        "MAGPIE_BROKER_URL": broker_url or settings.redis_url,
        "MAGPIE_BROKER_KEY_PREFIX": "" if broker_url else redis_prefix + "broker:",
        "MAGPIE_DATABASE_URL": pg_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
        "MAGPIE_JUDGE_URL": lab.judge_url,
    })
    env.update(overrides)
    return env


BROKERS = ["redis", pytest.param("amqp", marks=pytest.mark.slow)]
"""The e2e tests run on either broker: the test Redis (key prefix) or a RabbitMQ vhost of their own (slow
tier; the default tier's RabbitMQ checks are tests/integration/test_amqp_broker.py)."""


@pytest.fixture
def broker_url(request):
    """None for the Redis broker, else the URL of a fresh RabbitMQ vhost (``amqp_vhost``; skips without
    RabbitMQ). Parametrized indirectly with :data:`BROKERS`."""
    if getattr(request, "param", "redis") == "amqp":
        return request.getfixturevalue("amqp_vhost").url
    return None


def spawn(args, env, log):
    return spawn_celery(args, env, log, ROOT)


stop = stop_group


@pytest.mark.parametrize("broker_url", BROKERS, indirect=True)
def test_worker_and_beat_check_lab_routes_repeatedly_into_postgres(settings, db, pg_url, redis_prefix, tmp_path,
                                                                   broker_url):
    lab = start_free_lab(slow_delay=1.0)
    try:
        env = worker_env(settings, pg_url, redis_prefix, lab, broker_url, MAGPIE_CHECK_INTERVAL="3",
                         MAGPIE_CHECK_TIMEOUT="4",
                         MAGPIE_LEASE_SECONDS="30", MAGPIE_RENEW_BELOW_SECONDS="10")
        lst = tmp_path / "lab.txt"
        lab.write_list(lst)
        rep = import_file(lst, "e2e", settings.model_copy(update={"check_interval": 3.0}))
        assert rep.imported == len(lab.proxies) and not rep.invalid
        log = open(tmp_path / "celery.log", "w")
        procs = [
            spawn(["worker", "-Q", "promote,checks,stats", "-n", f"e2e-{redis_prefix}@%h", "--concurrency=2",
                   "--loglevel=info", "--without-mingle", "--without-gossip"], env, log),
            spawn(["beat", "--loglevel=info", f"--schedule={tmp_path / 'beat'}"], env, log),
        ]
        try:
            rows = checked_until(procs, db, settings, tmp_path / "celery.log", stop)
        finally:
            log.close()
        expected = {(p.route.host, p.route.port): p for p in lab.proxies}
        assert len(rows) == len(expected)
        if broker_url:  # the messages went through RabbitMQ, with the password masked in the banner
            text = (tmp_path / "celery.log").read_text(errors="replace")
            assert "transport:   amqp://guest:**@" in text and "guest:guest" not in text, text[:2000]
        for r in rows:
            p = expected[(r["host"], r["port"])]
            assert r["checks_total"] >= 2, (p.name, r, (tmp_path / "celery.log").read_text()[-3000:])
            assert r["alive"] == p.expect_alive, (p.name, r)
            assert r["anonymity"] == p.expect_anonymity, (p.name, r)
        with db.connect() as c:
            import sqlalchemy as sa

            n = c.execute(sa.text("SELECT count(*) FROM check_history")).scalar()
        assert n >= 2 * len(expected)
    finally:
        lab.stop()


@pytest.mark.parametrize("broker_url", ["redis", pytest.param("amqp", marks=pytest.mark.slow)], indirect=True)
def test_routes_of_a_killed_worker_come_back_after_lease_expiry(settings, db, pg_url, redis_prefix, tmp_path,
                                                                broker_url):
    """SIGKILL a worker while it holds leases: nothing is lost, another worker checks the routes once
    their leases expire (no sweeper), and the schedule ends with no stranded lease. On RabbitMQ the
    messages the victim held unacked are redelivered to the survivor at once (its channel closed)."""
    from datetime import datetime, timezone

    from magpie.queue import RouteQueue

    lab = start_free_lab(slow_delay=2.0)
    try:
        env = worker_env(settings, pg_url, redis_prefix, lab, broker_url, MAGPIE_CHECK_INTERVAL="2",
                         MAGPIE_CHECK_TIMEOUT="3",
                         MAGPIE_CHECK_ATTEMPTS="1", MAGPIE_LEASE_SECONDS="5", MAGPIE_RENEW_BELOW_SECONDS="0")
        lst = tmp_path / "lab.txt"
        lab.write_list(lst)
        s2 = settings.model_copy(update={"check_interval": 2.0, "lease_seconds": 5.0, "check_attempts": 1})
        import_file(lst, "crash", s2)
        q = RouteQueue.from_settings(s2)
        log = open(tmp_path / "celery.log", "w")
        worker_args = ["worker", "-Q", "promote,checks,stats", "--concurrency=2", "--loglevel=info",
                       "--without-mingle", "--without-gossip"]
        beat = spawn(["beat", "--loglevel=info", f"--schedule={tmp_path / 'beat'}"], env, log)
        victim = spawn(worker_args + ["-n", f"victim-{redis_prefix}@%h"], env, log)
        survivor = None
        try:
            with contextlib.suppress(TimedOut):  # asserted below
                wait_until(lambda: q.status()["totals"]["leased"] > 0, timeout=30, interval=0.1,
                           what="the victim holding a lease")
            held = q.status()["totals"]["leased"]
            assert held > 0, "the victim never held a lease"
            os.killpg(victim.pid, signal.SIGKILL)  # worker and its pool children die mid-check
            victim.wait()
            killed_at = datetime.now(timezone.utc)
            survivor = spawn(worker_args + ["-n", f"survivor-{redis_prefix}@%h"], env, log)
            rows = []

            def rechecked():
                rows[:] = latest_health(db, "crash", keyring=get_keyring(settings.encryption_key))
                return rows and all(r["last_checked_at"] and r["last_checked_at"] > killed_at for r in rows)

            with contextlib.suppress(TimedOut):  # asserted below, with the logs
                wait_until(rechecked, timeout=60, interval=0.25, what="every route checked after the kill")
        finally:
            for p in (beat, victim, survivor):
                if p is not None:
                    stop(p)
            log.close()
        assert len(rows) == len(lab.proxies)
        late = [r for r in rows if not (r["last_checked_at"] and r["last_checked_at"] > killed_at)]
        assert not late, (late, (tmp_path / "celery.log").read_text()[-3000:])
        st = q.status()["totals"]
        assert st["scheduled"] == len(lab.proxies) and st["dead"] == 0
    finally:
        lab.stop()
