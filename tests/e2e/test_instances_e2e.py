"""End to end: real Celery worker and beat processes register instance records; a killed worker's record
disappears after its TTL while the others keep refreshing; ``magpie health`` reports the beat's
schedule bootstrap."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from helpers import TimedOut, spawn_celery, stop_group, wait_until

from magpie.coordination.instances import InstanceRegistry

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _wait(pred, timeout, step=0.25):
    try:
        return wait_until(pred, timeout=timeout, interval=step)
    except TimedOut:
        return pred()


def test_workers_and_beat_register_and_a_killed_worker_disappears_after_its_ttl(settings, db, pg_url,
                                                                                redis_prefix, redis_client,
                                                                                tmp_path):
    env = dict(os.environ)
    env.update({
        "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": redis_prefix,
        "MAGPIE_BROKER_URL": settings.redis_url, "MAGPIE_BROKER_KEY_PREFIX": redis_prefix + "broker:",
        "MAGPIE_DATABASE_URL": pg_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
        "MAGPIE_INSTANCE_HEARTBEAT": "0.5", "MAGPIE_INSTANCE_TTL": "2", "MAGPIE_CHECKS_PER_PROCESS": "50",
    })
    reg = InstanceRegistry(redis_client, redis_prefix)
    log = open(tmp_path / "celery.log", "w")
    common = ["--loglevel=info", "--without-mingle", "--without-gossip"]
    procs = {
        "checks": spawn_celery(["worker", "-Q", "checks", "-n", f"c-{redis_prefix}@%h", "--concurrency=2", *common],
                               env, log, ROOT),
        "promote": spawn_celery(["worker", "-Q", "promote", "-n", f"p-{redis_prefix}@%h", "--pool=solo", *common],
                                env, log, ROOT),
        "beat": spawn_celery(["beat", "--loglevel=info", f"--schedule={tmp_path / 'beat'}"], env, log, ROOT),
    }
    try:
        def ready():
            live = reg.list_live()
            workers = [r for r in live if r["role"] == "worker"]
            beats = [r for r in live if r["role"] == "beat" and (r.get("schedule") or {}).get("bootstrapped")]
            checks = [r for r in workers if "checks" in r["queues"] and (r.get("checks") or {}).get("processes") == 2]
            return live if len(workers) == 2 and beats and checks else None

        live = _wait(ready, 60)
        assert live, (reg.list_live(), (tmp_path / "celery.log").read_text()[-3000:])
        by_queue = {tuple(r["queues"]): r for r in live if r["role"] == "worker"}
        checker = by_queue[("checks",)]
        assert checker["checks"]["slots"] == 100 and checker["checks"]["in_flight"] == 0
        assert checker["pid"] == procs["checks"].pid and checker["version"]
        [beat] = [r for r in live if r["role"] == "beat"]
        assert beat["schedule"]["entries"] > 10 and beat["pid"] == procs["beat"].pid

        from magpie.observability.health import instances_probe

        assert "beat schedule bootstrapped" in instances_probe(redis_client, redis_prefix)

        os.killpg(procs["checks"].pid, signal.SIGKILL)  # no shutdown hook runs: the record must expire
        procs["checks"].wait()
        t0 = time.monotonic()
        gone = _wait(lambda: checker["id"] not in [r["id"] for r in reg.list_live()], 10)
        assert gone and time.monotonic() - t0 >= 0.5  # it outlived the kill until its TTL ran out
        left = {r["id"] for r in reg.list_live()}
        assert by_queue[("promote",)]["id"] in left and beat["id"] in left
    finally:
        for p in procs.values():
            stop_group(p)
        log.close()
    # a clean stop withdraws at once
    assert _wait(lambda: reg.list_live() == [], 5), reg.list_live()
