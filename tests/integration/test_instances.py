"""Instance heartbeats against real Redis: records with a TTL, extras, expiry of a silent instance,
``magpie instances``, promote's fair shares from the live counts, the sweep job, the readiness probe and
``magpie maintenance status``."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers import TimedOut, elapse, wait_until

from magpie.coordination.instances import (
    BASE_FIELDS,
    Heartbeat,
    InstanceRegistry,
    fair_share,
    promote_shares,
    register_cache_revision,
    register_extra,
    unregister_extra,
)

KEY = "test-key-0123456789abcdef"


def _wait(pred, timeout=5.0, step=0.05):
    try:
        return bool(wait_until(pred, timeout=timeout, interval=step))
    except TimedOut:
        return False


@pytest.fixture
def cli_env(settings, monkeypatch):
    from magpie.config import get_settings

    for k, v in {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
                 "PROXY_ENCRYPTION_KEY": KEY, "COLUMNS": "250"}.items():
        monkeypatch.setenv(k, v)
    if settings.database_url:
        monkeypatch.setenv("MAGPIE_DATABASE_URL", settings.database_url)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def _cli(*args):
    from magpie.cli import main

    return CliRunner().invoke(main, list(args))


def test_a_record_carries_base_fields_role_fields_extras_and_cache_revisions(redis_client, redis_prefix):
    register_extra("probe_field", lambda: {"n": 7})
    register_extra("broken_field", lambda: 1 / 0)  # logged and left out: the heartbeat goes on
    register_cache_revision("judges", lambda: 42)
    try:
        hb = Heartbeat("worker", redis_client, redis_prefix, interval=0.2, ttl=5, fields={"queues": ["checks"]})
        rec = hb.beat_once()
    finally:
        unregister_extra("probe_field")
        unregister_extra("broken_field")
    assert set(BASE_FIELDS) <= set(rec)
    assert rec["role"] == "worker" and rec["queues"] == ["checks"] and rec["probe_field"] == {"n": 7}
    assert "broken_field" not in rec and rec["cache_revisions"]["judges"] == 42
    [live] = InstanceRegistry(redis_client, redis_prefix).list_live()
    assert live["id"] == hb.id and live["probe_field"] == {"n": 7}
    with pytest.raises(ValueError):
        register_extra("role", lambda: "x")


def test_an_instance_that_stops_refreshing_disappears_after_its_ttl(redis_client, redis_prefix, settings,
                                                                   cli_env):
    reg = InstanceRegistry(redis_client, redis_prefix)
    silent = Heartbeat("worker", redis_client, redis_prefix, interval=0.2, ttl=1.0).start()
    steady = Heartbeat("beat", redis_client, redis_prefix, interval=0.2, ttl=1.0).start()
    assert _wait(lambda: len(reg.list_live()) == 2)
    out = _cli("instances", "--json")
    assert out.exit_code == 0 and sorted(r["role"] for r in json.loads(out.output)) == ["beat", "worker"]
    silent.stop(withdraw=False)  # a crash: no withdrawal, the record only stops being refreshed
    elapse(0.5)  # the behaviour: unrefreshed for a while, it is still listed within its TTL
    assert silent.id in [r["id"] for r in reg.list_live()]  # still within its TTL
    assert _wait(lambda: silent.id not in [r["id"] for r in reg.list_live()], timeout=3)
    assert [r["id"] for r in json.loads(_cli("instances", "--json").output)] == [steady.id]
    assert [r["id"] for r in reg.list_live("beat")] == [steady.id] and reg.list_live("worker") == []
    # the expired id left the index too
    assert {m.decode() for m in redis_client.smembers(redis_prefix + "instances")} == {steady.id}
    table = _cli("instances")
    assert table.exit_code == 0 and steady.id in table.output
    steady.stop(withdraw=True)  # a clean stop withdraws at once
    assert reg.list_live() == []


def test_check_figures_of_pool_processes_are_summed_and_stale_ones_dropped(redis_client, redis_prefix):
    reg = InstanceRegistry(redis_client, redis_prefix)
    reg.report_checks("w1", 101, running=30, slots=100, ttl_s=5)
    reg.report_checks("w1", 102, running=12, slots=100, ttl_s=5)
    assert reg.checks_of("w1", ttl_s=5) == (42, 200, 2)
    redis_client.hset(redis_prefix + "instance:w1:checks", "103", json.dumps({"running": 9, "slots": 9, "at": 0}))
    assert reg.checks_of("w1", ttl_s=5) == (42, 200, 2)
    assert not redis_client.hexists(redis_prefix + "instance:w1:checks", "103")
    reg.forget_checks("w1", 101)
    assert reg.checks_of("w1", ttl_s=5) == (12, 100, 1)


def test_fair_share():
    assert [fair_share(100, n) for n in (0, 1, 2, 3)] == [100, 100, 50, 34]
    assert fair_share(1, 5) == 1 and fair_share(0, 3) == 0


def test_promote_splits_its_budget_between_beats_and_its_leases_between_engines(redis_client, redis_prefix):
    from magpie.pipeline.promote import promote_with_settings
    from magpie.queue import QueueKeys, RouteQueue
    from magpie.queue.capacity import CapacityRegistry
    from magpie.queue.payload import Payload
    from magpie.base.routes import Route

    q = RouteQueue(redis_client, QueueKeys(redis_prefix, 4), interval_ms=60_000, lease_ms=60_000)
    assert promote_shares(q, 1000) .want == 1000  # nobody registered: the whole budget, one engine
    beats = [Heartbeat("beat", redis_client, redis_prefix, interval=1, ttl=10) for _ in range(2)]
    for b in beats:
        b.beat_once()
    caps = CapacityRegistry(redis_client, q.keys)
    for i in range(4):
        caps.announce(f"engine-{i}", 1000, 10_000)
    shares = promote_shares(q, 1000)
    assert (shares.want, shares.engines, shares.beats) == (500, 4, 2)

    items = []
    for i in range(40):
        h = f"{i:024x}"
        items.append((h, Payload(i + 1, Route("http", "127.0.0.1", 1000 + i), h, [1]).encode()))
    q.schedule(items)
    for h, _ in items:
        shard = q.keys.shard_of(h)
        q.r.zadd(shard, {h: 1000 + int(h, 16)})
        q.r.zadd(q.keys.heads, {shard: 1000})

    class Sched:
        promote_budget, max_inflight, pop_batch, routes_per_task = 60, 10_000, 16, 250

    messages: list[list] = []
    n = promote_with_settings(q, Sched, messages.append, capacity=caps.total())
    # budget 60 split between 2 beats: 30 claimed; 30 leases over 4 engines: messages of at most 8
    assert n == 30
    assert sum(len(m) for m in messages) == 30 and max(len(m) for m in messages) == 8 and len(messages) == 4


def test_promote_sizes_its_messages_by_the_engines_slots_when_fewer_than_the_budget(redis_client, redis_prefix):
    """A pass bounded by the slots (not the budget) still goes out in one message per engine: one engine
    never takes the whole pass while the others idle (seen across network namespaces, docs/multinode.md)."""
    from magpie.pipeline.promote import promote_with_settings
    from magpie.queue import QueueKeys, RouteQueue
    from magpie.queue.capacity import CapacityRegistry
    from magpie.queue.payload import Payload
    from magpie.base.routes import Route

    q = RouteQueue(redis_client, QueueKeys(redis_prefix, 4), interval_ms=60_000, lease_ms=60_000)
    caps = CapacityRegistry(redis_client, q.keys)
    for i in range(3):
        caps.announce(f"engine-{i}", 4, 10_000)
    items = []
    for i in range(40):
        h = f"{i:024x}"
        items.append((h, Payload(i + 1, Route("http", "127.0.0.1", 1000 + i), h, [1]).encode()))
    q.schedule(items)
    for h, _ in items:
        shard = q.keys.shard_of(h)
        q.r.zadd(shard, {h: 1000 + int(h, 16)})
        q.r.zadd(q.keys.heads, {shard: 1000})

    class Sched:
        promote_budget, max_inflight, pop_batch, routes_per_task = 20_000, 10_000, 16, 250

    messages: list[list] = []
    n = promote_with_settings(q, Sched, messages.append, capacity=caps.total())
    # 12 slots over 3 engines: 12 claimed, in messages of at most 4 (not one message of 12)
    assert n == 12
    assert [len(m) for m in messages] == [4, 4, 4]


def test_instance_sweep_job_runs_under_its_lock_and_reports_live_roles(settings, pg_url, redis_client,
                                                                       redis_prefix):
    import sqlalchemy as sa

    from magpie.coordination.leader import LeaderLock
    from magpie.wiring.jobs import run_job

    db = sa.create_engine(pg_url)
    try:
        Heartbeat("worker", redis_client, redis_prefix, interval=1, ttl=10).beat_once()
        gone = Heartbeat("worker", redis_client, redis_prefix, interval=1, ttl=0.2)
        gone.beat_once()
        wait_until(lambda: not redis_client.exists(f"{redis_prefix}instance:{gone.id}"), timeout=5,
                   what="the unrefreshed record expired")
        held = LeaderLock(redis_client, redis_prefix, "instance_sweep", ttl_ms=5000)
        assert held.acquire()
        assert run_job("instance_sweep", settings, engine=db, redis=redis_client)["status"] == "skipped"
        held.release()
        res = run_job("instance_sweep", settings, engine=db, redis=redis_client)
        assert res["status"] == "ok" and res["result"]["dropped"] == 1 and res["result"]["live"] == {"worker": 1}
        again = run_job("instance_sweep", settings, engine=db, redis=redis_client)
        assert again["result"]["dropped"] == 0 and again["result"]["live"] == {"worker": 1}
        with db.connect() as c:
            runs = c.execute(sa.text("SELECT runs_total, failures_total FROM maintenance_runs "
                                     "WHERE job = 'instance_sweep'")).one()
        assert tuple(runs) == (2, 0)
    finally:
        with db.begin() as c:
            c.execute(sa.text("DELETE FROM maintenance_runs WHERE job = 'instance_sweep'"))
        db.dispose()


def test_readiness_reports_instances_and_the_beat_schedule_bootstrap(redis_client, redis_prefix):
    from magpie.observability.health import instances_probe

    d = instances_probe(redis_client, redis_prefix)
    assert "no beat instance" in d and type(d).__name__ == "_Warning"
    state = {"entries": 0, "bootstrapped": False, "last_tick_age_s": None}
    beat = Heartbeat("beat", redis_client, redis_prefix, interval=1, ttl=10, dynamic={"schedule": lambda: state})
    beat.beat_once()
    assert "not bootstrapped" in instances_probe(redis_client, redis_prefix)
    state.update(entries=12, bootstrapped=True, last_tick_age_s=0.5)
    beat.beat_once()
    d = instances_probe(redis_client, redis_prefix)
    assert type(d) is str and "1 beat" in d and "bootstrapped (12 entries)" in d


def test_maintenance_status_lists_every_family_with_cadence_and_last_success(settings, pg_url, db, cli_env,
                                                                             redis_client, redis_prefix):
    from magpie.wiring.jobs import run_job
    from magpie.wiring.jobs import JOBS

    assert run_job("workspace_snapshots", settings, engine=db)["status"] == "ok"
    Heartbeat("worker", redis_client, redis_prefix, interval=1, ttl=10).beat_once()
    out = _cli("maintenance", "status", "--json")
    assert out.exit_code == 0, out.output
    rows = {r["job"]: r for r in json.loads(out.output)}
    mine = {"reputation", "workspace_snapshots", "hourly_counts", "source_stats", "workspace_usage",
            "snapshot_retention", "hourly_retention", "usage_retention", "source_stats_retention",
            "instance_sweep", "instance_heartbeat"}
    assert mine <= set(rows) and set(JOBS) <= set(rows)
    assert rows["workspace_snapshots"]["every_s"] == 600 and rows["workspace_snapshots"]["last_success_at"]
    assert rows["reputation"]["last_success_at"] is None and rows["reputation"]["every_s"] == 60
    hb = rows["instance_heartbeat"]
    assert hb["every_s"] == settings.instance_heartbeat and hb["last_success_at"] and hb["last_result"] == {"live": 1}
    table = _cli("maintenance", "status")
    assert table.exit_code == 0 and "instance_heartbeat" in table.output and "per process" in table.output
