"""The metrics endpoint scraped over real HTTP, the Redis-side check counters, readiness and the CLI."""

from __future__ import annotations

import json
import math

import pytest
from helpers import append_entries
import requests
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from magpie.config import get_settings
from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.queue.payload import schedule_item
from magpie.coordination.leader import LeaderLock
from magpie.wiring.jobs import run_job
from magpie.base.counters import (
    LATENESS_BUCKETS,
    check_outcomes,
    count_stats_drops,
    read_counters,
    record_check_batch,
)
from magpie.observability.metrics import build_registry, serve
from magpie.wiring.jobs import JOBS
from magpie.queue import RouteQueue
from magpie.base.routes import Route
from magpie.stats import encode_result, ensure_group, stream_key

KEY = "test-key-0123456789abcdef"


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    resp = requests.get(url, timeout=10)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(resp.text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


@pytest.fixture
def exporter(settings, pg_url):
    server, thread = serve(settings, "127.0.0.1", 0, jobs=JOBS.values())
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_record_check_batch_keeps_counters_and_fixed_buckets_in_redis(redis_client, redis_prefix):
    assert record_check_batch(
        redis_client,
        redis_prefix,
        {"alive": 3, "dead": 1, "aborted": 0},
        2,
        [10.0, 99.0, 700.0, 4_000_000.0, -5.0],
    )
    record_check_batch(redis_client, redis_prefix, {"alive": 1}, 0, [])
    c = read_counters(redis_client, redis_prefix)
    assert c["checks"] == {"alive": 4, "dead": 1} and c["stale"] == 2
    lat = c["lateness"]
    assert lat["count"] == 5 and math.isclose(lat["sum_s"], (10 + 99 + 700 + 4_000_000 - 5) / 1000)
    buckets = dict(lat["buckets"])
    assert buckets[0.05] == 2 and buckets[0.1] == 3 and buckets[1.0] == 4 and buckets[math.inf] == 5
    assert list(buckets)[:-1] == list(LATENESS_BUCKETS)


def test_outcome_helpers():
    class Rep:
        lease_lost, aborted, malformed, retried = 1, 2, 0, 3

    assert check_outcomes(Rep(), [{"alive": "1"}, {"alive": "0"}, {"alive": "1"}]) == {
        "alive": 2,
        "dead": 1,
        "lease_lost": 1,
        "aborted": 2,
        "malformed": 0,
        "retried": 3,
    }


def test_metrics_endpoint_serves_schedule_stream_maintenance_and_check_figures(
    settings, db, redis_client, redis_prefix, exporter
):
    # A schedule with one leased route, results in the stream, a maintenance pass, a held leader lock.
    q = RouteQueue.from_settings(settings, redis_client)
    stored = upsert_routes(
        db, get_keyring(KEY), "m", [Route("http", "10.9.0.1", 8000 + i) for i in range(3)]
    ).routes
    q.schedule([schedule_item(x) for x in stored], total=3)
    q.enqueue_in(stored[0].route_hash, 0)
    [lease] = q.pop(1)
    ensure_group(redis_client, redis_prefix)
    ids = append_entries(redis_client, redis_prefix, [
            encode_result(
                route_id=x.route_id, route_hash=x.route_hash, alive=True, checked_at_ms=1_700_000_000_000 + i
            )
            for i, x in enumerate(stored)
        ])
    redis_client.xreadgroup("magpie-stats", "c1", {stream_key(redis_prefix): ">"}, count=1)  # one pending
    count_stats_drops(redis_client, redis_prefix, "drop_new", 1000)  # as a check worker counts its drops
    record_check_batch(redis_client, redis_prefix, {"alive": 5, "dead": 2}, 1, [200.0, 3000.0])
    assert run_job("partitions", settings, engine=db, redis=redis_client)["status"] == "ok"
    lock = LeaderLock(redis_client, redis_prefix, "history_retention", ttl_ms=10_000)
    assert lock.acquire()
    try:
        m = _scrape(exporter)
    finally:
        lock.release()

    assert m[("magpie_exporter_source_up", (("source", "redis"),))] == 1
    assert m[("magpie_exporter_source_up", (("source", "postgres"),))] == 1
    assert m[("magpie_leader_job_active", (("lock", "history_retention"),))] == 1
    assert m[("magpie_leader_job_active", (("lock", "partitions"),))] == 0
    ok = ("magpie_maintenance_last_success_timestamp_seconds", (("maintenance_job", "partitions"),))
    assert m[ok] > 1.7e9
    assert m[("magpie_maintenance_failures_total", (("maintenance_job", "partitions"),))] == 0
    assert m[("magpie_maintenance_runs_total", (("maintenance_job", "partitions"),))] == 1
    assert m[("magpie_statistics_replay_floor_timestamp_seconds", ())] == int(ids[0].split("-")[0]) / 1000
    assert m[("magpie_statistics_pending", ())] == 1 and m[("magpie_statistics_backlog", ())] == 2
    assert m[("magpie_statistics_dropped_total", (("policy", "drop_new"),))] == 1000
    shard = lease.shard.rsplit(":", 1)[-1]
    assert m[("magpie_queue_leased", (("shard", shard),))] == 1
    assert sum(v for (n, _), v in m.items() if n == "magpie_queue_depth") == 3
    assert sum(v for (n, _), v in m.items() if n == "magpie_queue_due_now") == 0
    assert m[("magpie_checks_total", (("outcome", "alive"),))] == 5
    assert m[("magpie_checks_total", (("outcome", "dead"),))] == 2
    assert m[("magpie_stale_completions_rejected_total", ())] == 1
    assert m[("magpie_check_lateness_seconds_bucket", (("le", "0.25"),))] == 1
    assert m[("magpie_check_lateness_seconds_bucket", (("le", "+Inf"),))] == 2
    assert m[("magpie_check_lateness_seconds_count", ())] == 2
    assert m[("magpie_check_lateness_seconds_sum", ())] == pytest.approx(3.2)


def test_a_source_down_drops_its_metrics_not_the_scrape(settings, db):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    down = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    registry = build_registry(settings, jobs=JOBS.values(), redis=down, engine=db)
    server, thread = serve(settings, "127.0.0.1", 0, registry=registry)
    try:
        m = _scrape(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    assert m[("magpie_exporter_source_up", (("source", "redis"),))] == 0
    assert m[("magpie_exporter_source_up", (("source", "postgres"),))] == 1
    assert not any(n.startswith("magpie_queue_") for n, _ in m)


# ---------------------------------------------------------------------------------------------------- CLI


@pytest.fixture
def cli_env(monkeypatch, settings, pg_url, redis_prefix):
    env = {
        "MAGPIE_REDIS_URL": settings.redis_url,
        "MAGPIE_REDIS_PREFIX": redis_prefix,
        "MAGPIE_DATABASE_URL": pg_url,
        "PROXY_ENCRYPTION_KEY": settings.encryption_key,
        "MAGPIE_BROKER_URL": settings.redis_url,
        "MAGPIE_BROKER_KEY_PREFIX": redis_prefix + "broker:",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()


def test_cli_health_reports_ready_and_fails_when_the_broker_is_down(cli_env, db, monkeypatch):
    from magpie.cli import main

    res = CliRunner().invoke(main, ["health", "--json"])
    rep = json.loads(res.output)
    assert res.exit_code == 0 and rep["ready"], res.output
    assert set(rep["checks"]) == {"redis", "postgres", "broker", "schema", "key", "judge", "queue", "scripts",
                                  "engines", "stats", "instances"}
    monkeypatch.setenv("MAGPIE_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    res = CliRunner().invoke(main, ["health", "--timeout", "1"])
    assert res.exit_code == 1 and "FAIL broker" in res.output and "NOT READY" in res.output


def test_cli_health_not_ready_while_routes_are_not_scheduled(cli_env, db):
    from magpie.cli import main

    upsert_routes(db, get_keyring(KEY), "h", [Route("http", "10.9.9.1", 8080)])
    res = CliRunner().invoke(main, ["health", "--json"])
    rep = json.loads(res.output)
    assert res.exit_code == 1 and not rep["checks"]["queue"]["ok"] and rep["checks"]["redis"]["ok"]
    assert CliRunner().invoke(main, ["maintenance", "run", "rebuild"]).exit_code == 0
    assert CliRunner().invoke(main, ["health"]).exit_code == 0


def test_cli_maintenance_run_and_status(cli_env, db):
    from magpie.cli import main

    res = CliRunner().invoke(main, ["maintenance", "run", "token_expiry", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["job"] == "token_expiry" and out["status"] == "ok"
    res = CliRunner().invoke(main, ["maintenance", "run", "all"])
    assert res.exit_code == 0 and "partitions" in res.output and "rebuild" in res.output
    res = CliRunner().invoke(main, ["maintenance", "status", "--json"])
    rows = {r["job"]: r for r in json.loads(res.output)}
    assert rows["token_expiry"]["runs_total"] == 2 and rows["partitions"]["runs_total"] == 1
    assert CliRunner().invoke(main, ["maintenance", "status"]).exit_code == 0
    res = CliRunner().invoke(main, ["maintenance", "run", "nope"])
    assert res.exit_code != 0 and "unknown job" in res.output


def test_beat_entries_cover_every_job_with_expiry_and_overrides(settings):
    from magpie.wiring.celery_config import build
    from magpie.config import ConfigError
    from magpie.wiring.jobs import JOBS, beat_entries

    entries = beat_entries(settings)
    assert set(entries) == {f"maintenance-{j}" for j in JOBS}
    for name, e in entries.items():
        assert e["task"] == "magpie.maintenance.run" and e["args"] == [name.removeprefix("maintenance-")]
        assert e["options"]["expires"] == e["schedule"].total_seconds()
    tuned = settings.model_copy(update={"maintenance_cadences": "orphan_routes=30, rebuild=0"})
    e = beat_entries(tuned)
    assert e["maintenance-orphan_routes"]["schedule"].total_seconds() == 30 and "maintenance-rebuild" not in e
    with pytest.raises(ConfigError, match="MAGPIE_MAINTENANCE_CADENCES"):
        beat_entries(settings.model_copy(update={"maintenance_cadences": "nosuchjob=5"}))
    conf = build(settings)
    assert "maintenance-partitions" in conf["beat_schedule"]
    assert conf["task_routes"]["magpie.maintenance.*"]["queue"] == "maintenance"
