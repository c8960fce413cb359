"""Everything beside the schedule on a real Redis Cluster (3 masters + 3 replicas, tests/private_cluster.py):
leader locks, the capacity registry, instance records, token buckets, pub/sub, and results written by
``complete_with_results`` on the cluster ingested into PostgreSQL through the stream's consumer group."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from magpie.base import redisconn
from magpie.config import load_settings
from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.queue.payload import schedule_item
from magpie.coordination.instances import InstanceRegistry
from magpie.lab.cluster import key_slot
from magpie.coordination.leader import LeaderLock, generation_key, lock_key, locks_held
from magpie.queue import COMPLETED, QueueKeys, RouteQueue
from magpie.queue.capacity import CapacityRegistry
from magpie.queue.completion import StreamTarget
from magpie.coordination.ratelimit import TokenBucket, bucket_key, take_many
from magpie.base.routes import Route
from magpie.stats import GROUP, encode_result, ingest, pending_summary
from magpie.queue.streams import dead_key, infra_key, stream_key
from magpie.wiring.jobs import JOBS
from helpers import wait_until

pytestmark = pytest.mark.slow  # a private 3+3 cluster per session: the cluster tier runs in make test-all

KEY = "test-key-0123456789abcdef"


def cluster_settings(cluster, prefix, **kw):
    from tests.conftest import REDIS_URL

    return load_settings(redis_url=cluster.url, broker_url=REDIS_URL, redis_prefix=prefix, encryption_key=KEY,
                         **kw)


def test_stats_keys_share_the_schedules_slot_on_a_cluster_only(cluster_client, cluster_prefix):
    sched = QueueKeys(cluster_prefix).heads
    for fn in (stream_key, dead_key, infra_key):
        assert key_slot(fn(cluster_prefix, True)) == key_slot(sched)
        assert fn(cluster_prefix, False) == cluster_prefix + fn(cluster_prefix, False)[len(cluster_prefix):]
        assert "{" not in fn(cluster_prefix, False)  # one server: today's keys
    assert stream_key(cluster_prefix, True) == f"{cluster_prefix}{{default}}:stats:results"


def test_leader_lock_excludes_a_second_holder_and_fences_on_a_cluster(cluster_client, cluster_prefix):
    a = LeaderLock(cluster_client, cluster_prefix, "respread", ttl_ms=3000)
    b = LeaderLock(cluster_client, cluster_prefix, "respread", ttl_ms=3000)
    assert a.key == lock_key(cluster_prefix, "respread", True)
    assert key_slot(a.key) == key_slot(generation_key(cluster_prefix, "respread", True))
    wait_until(a.acquire, timeout=10, what="the quiet period after the cluster's start")
    assert not b.acquire() and b.refusal == "held"
    assert locks_held(cluster_client, cluster_prefix, ["respread", "retention"]) == [True, False]
    first = a.generation
    a.release()
    assert b.acquire() and b.generation > first
    b.release()


def test_capacity_registry_on_a_cluster(cluster_client, cluster_prefix):
    cap = CapacityRegistry(cluster_client, QueueKeys(cluster_prefix))
    cap.announce("e1", 10, 60_000)
    cap.announce("e2", 5, 60_000)
    cap.announce("e3", 1, 1)  # expires at once
    wait_until(lambda: cluster_client.get(QueueKeys(cluster_prefix).checker_prefix + "e3") is None, timeout=5)
    assert cap.engines() == {"e1": 10, "e2": 5}
    cap.withdraw("e1")
    assert cap.engines() == {"e2": 5}


def test_instance_records_span_slots_on_a_cluster(cluster_client, cluster_prefix):
    reg = InstanceRegistry(cluster_client, cluster_prefix)
    ids = [f"worker-{i}" for i in range(12)]
    assert len({key_slot(f"{cluster_prefix}instance:{i}") for i in ids}) > 1  # records live on many slots
    for i in ids:
        reg.refresh({"id": i, "role": "worker"}, ttl_s=60)
    assert [r["id"] for r in reg.list_live("worker")] == sorted(ids)
    reg.withdraw(ids[0])
    assert [r["id"] for r in reg.list_live()] == sorted(ids[1:])


def test_token_buckets_across_slots_on_a_cluster(cluster_client, cluster_prefix):
    keys = [bucket_key(cluster_prefix, "judge", f"j{i}") for i in range(6)]
    assert len({key_slot(k) for k in keys}) > 1
    got = take_many(cluster_client, [(k, 1.0, 3, 5) for k in keys])  # pipelined EVALSHA over many slots
    assert [g for g, _ in got] == [3] * 6 and all(w > 0 for _, w in got)
    tb = TokenBucket(cluster_client, bucket_key(cluster_prefix, "workspace", "w1"), rate=1.0, burst=2)
    assert tb.take(5)[0] == 2 and tb.take(1)[0] == 0


def test_api_rate_bucket_on_a_cluster(cluster_client, cluster_prefix):
    from magpie.apitokens import ratelimit as api

    waits = [api.take(cluster_client, cluster_prefix, "tok1", "read", rate=1.0, burst=2) for _ in range(3)]
    assert waits[0] is None and waits[1] is None and waits[2] is not None and waits[2] > 0
    assert api.limited_counts(cluster_client, cluster_prefix)["read"] == 1


def test_pubsub_reaches_a_subscriber_on_another_node(redis_cluster, cluster_prefix):
    pub = redisconn.connect(redis_cluster.url)
    sub = redisconn.connect(redis_cluster.url).pubsub(ignore_subscribe_messages=True)
    chan = f"{cluster_prefix}judges:changed"
    sub.subscribe(chan)
    wait_until(lambda: pub.publish(chan, "x") >= 1, timeout=5, what="the subscription")
    msg = wait_until(lambda: sub.get_message(timeout=0.2), timeout=5, what="the message")
    assert msg["data"] == b"x"
    sub.close()
    pub.close()


def test_results_completed_on_a_cluster_are_ingested_into_postgresql(redis_cluster, cluster_client,
                                                                     cluster_prefix, pg_url, db):
    s = cluster_settings(redis_cluster, cluster_prefix, database_url=pg_url)
    stored = upsert_routes(db, get_keyring(KEY), "alpha", [Route("http", "127.0.9.3", 8000 + i)
                                                           for i in range(5)]).routes
    q = RouteQueue.from_settings(s, redisconn.connect(s.redis_url))
    assert redisconn.is_cluster(q.r)
    q.schedule([schedule_item(r) for r in stored])
    for r in stored:
        q.r.zadd(q.keys.shard_of(r.route_hash), {r.route_hash: 1000})
        q.r.zadd(q.keys.heads, {q.keys.shard_of(r.route_hash): 1000})
    leases = q.pop(10)
    assert len(leases) == 5
    by_hash = {r.route_hash: r for r in stored}
    results = [encode_result(route_id=by_hash[le.member].route_id, route_hash=le.member, alive=True,
                             checked_at_ms=1_700_000_000_000, latency_ms=10.0, status=200, attempts=1, error=None,
                             body="{}", anonymity="elite", judge="http://127.0.0.1:8899/") for le in leases]
    target = StreamTarget.from_settings(s)
    assert target.key == stream_key(cluster_prefix, True)
    comp = q.complete_with_results(leases, results, target)
    assert comp.codes == [COMPLETED] * 5 and all(comp.ids)
    rep = ingest(cluster_client, db, cluster_prefix, "c1")
    assert rep.read == 5
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM check_history")).scalar_one() == 5
    assert cluster_client.xpending(target.key, GROUP)["pending"] == 0
    summary = pending_summary(cluster_client, cluster_prefix)
    assert summary["pending"] == 0


def test_a_cluster_url_without_a_broker_url_is_refused(redis_cluster, monkeypatch):
    import pytest

    from magpie.config import ConfigError

    monkeypatch.delenv("MAGPIE_BROKER_URL", raising=False)
    with pytest.raises(ConfigError) as err:
        load_settings(redis_url=redis_cluster.url.replace("://", "://u:hunter2pass@", 1))
    assert "MAGPIE_BROKER_URL" in str(err.value) and "hunter2pass" not in str(err.value)
    assert "\n" not in str(err.value)


def test_payload_migration_scans_the_cluster(redis_cluster, cluster_client, cluster_prefix):
    from magpie.queue.migrate import migrate_payloads
    from magpie.queue.payload import Payload, read_cipher

    s = cluster_settings(redis_cluster, cluster_prefix)
    q = RouteQueue.from_settings(s, cluster_client)
    items = []
    for i in range(7):
        h = f"{i:024x}"
        items.append((h, Payload(i, Route("socks5", "127.0.0.1", 3000 + i, f"user{i}", f"pw-{i}-secret"), h,
                                 [1]).encode()))
    q.schedule(items)
    counts = migrate_payloads(q, read_cipher(s), encrypt=True, batch=3)
    assert counts["scanned"] == 7 and counts["changed"] == 7
    assert all("secret" not in q.payload(h) for h, _ in items)
    assert migrate_payloads(q, read_cipher(s), encrypt=True, batch=3)["changed"] == 0


def test_eviction_policy_is_checked_on_every_primary(redis_cluster, cluster_client):
    from magpie.queue.redis_policy import eviction_policy

    assert eviction_policy(cluster_client) == "noeviction"
    last = redis_cluster.node(redis_cluster.masters_ports()[-1]).client()
    last.config_set("maxmemory-policy", "allkeys-lru")
    try:
        assert eviction_policy(cluster_client) == "allkeys-lru"
    finally:
        last.config_set("maxmemory-policy", "noeviction")


def test_the_cli_runs_on_a_cluster(redis_cluster, cluster_prefix, pg_url, db, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from magpie.cli import main
    from magpie.config import get_settings
    from tests.conftest import REDIS_URL

    for k, v in {"MAGPIE_REDIS_URL": redis_cluster.url, "MAGPIE_BROKER_URL": REDIS_URL,
                 "MAGPIE_REDIS_PREFIX": cluster_prefix, "MAGPIE_DATABASE_URL": pg_url,
                 "PROXY_ENCRYPTION_KEY": KEY}.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    lst = tmp_path / "l.txt"
    lst.write_text("127.0.0.1:8080\n127.0.0.2:8080\n")
    try:
        def run(*args):
            res = CliRunner().invoke(main, list(args), catch_exceptions=False)
            assert res.exit_code == 0, res.output
            return res.output

        assert "2" in run("import", str(lst), "--workspace", "cli")
        assert run("queue", "claim")
        out = run("status")
        assert "leased" in out.lower()
        assert run("stats", "status")
        run("queue", "pause")
        run("queue", "resume")
    finally:
        get_settings.cache_clear()


def test_a_metrics_scrape_reads_the_cluster(redis_cluster, cluster_client, cluster_prefix, pg_url, db):
    from prometheus_client import generate_latest

    from magpie.observability.metrics import build_registry

    s = cluster_settings(redis_cluster, cluster_prefix, database_url=pg_url)
    q = RouteQueue.from_settings(s, cluster_client)
    q.schedule([(f"{i:024x}", '{"v":1}') for i in range(3)])
    text = generate_latest(build_registry(s, jobs=JOBS.values(), redis=cluster_client, engine=db)).decode()
    assert 'magpie_exporter_source_up{source="redis"} 1.0' in text  # every Redis read of the scrape worked
    assert 'magpie_leader_job_active{lock="respread"}' in text


def test_wait_on_a_server_without_replicas_falls_short_and_says_so(redis_client, redis_prefix, caplog):
    """``MAGPIE_REDIS_WAIT_REPLICAS`` works on one server too; with no replica every WAIT falls short:
    the claim and completion still happen, the shortfall is counted and logged (once a minute)."""
    q = RouteQueue(redis_client, QueueKeys(redis_prefix, 2), interval_ms=60_000, lease_ms=30_000)
    q.wait_replicas, q.wait_timeout_ms = 1, 20
    q.schedule([(f"{i:024x}", '{"v":1}') for i in range(3)])
    for shard in q.keys.all_shards():
        for m in redis_client.zrange(shard, 0, -1):
            redis_client.zadd(shard, {m: 1000})
        redis_client.zadd(q.keys.heads, {shard: 1000})
    with caplog.at_level("WARNING", logger="magpie.queue.routequeue"):
        leases = q.pop(3)
        assert len(leases) == 3 and q.last_wait == 0
        assert q.complete(leases) == [COMPLETED] * 3 and q.last_wait == 0
    assert q.wait_short == 2
    assert sum("only 0 replica(s) confirmed" in r.getMessage() for r in caplog.records) == 1
