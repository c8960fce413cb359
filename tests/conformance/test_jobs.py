"""Jobs that read the schedule, run against every provider: owner verification (``route_ownership``),
the interval's convergence (``interval_respread``), the schedule rebuild (``rebuild``), orphan removal
(``orphan_routes``), the blacklist refresh, and promote's shared budget and engine shares. Each
maintenance job builds its own provider from the settings (``MAGPIE_SCHEDULE_URL``), as in production."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from helpers import add_history, history_by_route
from magpie.config import load_settings
from magpie.judges.ownership import drops_key
from magpie.wiring.jobs import run_job
from magpie.queue import Payload
from magpie.base.routes import Route


PARTITIONS = 4  # the redis-partitioned provider's count (conftest.PARTITIONS)


@pytest.fixture
def job_settings(backend, redis_prefix, pg_url, redis_url):
    """Settings whose schedule is the provider under test (same prefix as ``make_queue``)."""
    from tests.conftest import REDIS_URL

    # a fresh private cluster is seconds old: a short lock TTL keeps the leader's quiet period after a Redis
    # start (a third of it plus 1 s) within the cluster's age
    extra = {"maintenance_lock_ttl": 3.0} if backend.startswith("redis-cluster") else {}
    return load_settings(**extra, redis_url=redis_url, broker_url=REDIS_URL, redis_prefix=redis_prefix,
                         database_url=pg_url,
                         schedule_url=pg_url if backend == "postgresql" else None,
                         schedule_partitions=PARTITIONS if backend.endswith("-partitioned") else 1,
                         encryption_key="test-key-0123456789abcdef")


@pytest.fixture
def jq(make_queue, job_settings):
    return make_queue(shards=job_settings.schedule.shards, interval_ms=job_settings.schedule.interval_ms)


@pytest.fixture
def owners_db(pg_url):
    """Two workspaces; routes and workspaces are deleted afterwards."""
    engine = sa.create_engine(pg_url)
    with engine.begin() as c:
        ids = [c.execute(sa.text("INSERT INTO workspaces (name) VALUES (:n) RETURNING id"), {"n": n}).scalar_one()
               for n in ("conf-alpha", "conf-beta")]
    yield engine, ids
    with engine.begin() as c:
        c.execute(sa.text("DELETE FROM route_workspaces WHERE workspace_id = ANY(:w)"), {"w": ids})
        gone = c.execute(sa.text("DELETE FROM routes WHERE route_hash LIKE 'c0nf%' RETURNING id")).scalars().all()
        c.execute(sa.text("DELETE FROM check_history WHERE route_id = ANY(:g)"), {"g": gone})  # no cascade
        c.execute(sa.text("DELETE FROM workspaces WHERE id = ANY(:w)"), {"w": ids})
        c.execute(sa.text("DELETE FROM maintenance_runs WHERE job IN ('route_ownership', 'rebuild', "
                          "'orphan_routes')"))
    engine.dispose()


def _route(engine, h, owners) -> int:
    with engine.begin() as c:
        rid = c.execute(sa.text("INSERT INTO routes (route_hash, protocol, host, port) "
                                "VALUES (:h, 'http', '127.0.0.1', 9) RETURNING id"), {"h": h}).scalar_one()
        for w in owners:
            c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) VALUES (:r, :w)"),
                      {"r": rid, "w": w})
    return rid


def test_owner_verification_reads_the_schedule_of_every_provider(jq, job_settings, owners_db, redis_client):
    engine, (A, B) = owners_db
    kept, moved, orphan = "c0nf" + "1" * 20, "c0nf" + "2" * 20, "c0nf" + "3" * 20
    ids = {kept: _route(engine, kept, [A]), moved: _route(engine, moved, [B]), orphan: _route(engine, orphan, [])}
    jq.schedule([(h, Payload(ids[h], Route("http", "127.0.0.1", 9), h, [A]).encode()) for h in (kept, moved, orphan)])

    rep = run_job("route_ownership", job_settings, engine=engine, redis=redis_client)
    assert rep["status"] == "ok", rep
    res = rep["result"]
    # the orphan is still scheduled: it is a pending drop, never a route "gone" from the schedule
    assert (res["drops"], res["readded"], res["deleted"]) == (2, 1, 0), res
    pending = {k.decode(): v.decode() for k, v in redis_client.hgetall(drops_key(job_settings.redis_prefix)).items()}
    assert pending == {moved: str(A), orphan: str(A)}
    assert json.loads(jq.payload(moved))["w"] == [A, B]  # B merged back at once
    assert json.loads(jq.payload(kept))["w"] == [A]
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM routes WHERE route_hash LIKE 'c0nf%'")).scalar_one() == 3


def test_owner_verification_deletes_an_unowned_route_only_once_it_left_the_schedule(jq, job_settings, owners_db,
                                                                                      redis_client):
    engine, (A, _B) = owners_db
    h = "c0nf" + "4" * 20
    rid = _route(engine, h, [])
    add_history(engine, [rid])
    rep = run_job("route_ownership", job_settings, engine=engine, redis=redis_client)
    assert rep["status"] == "ok" and rep["result"]["deleted"] == 1, rep
    assert jq.payloads([h]) == [None]
    assert rid not in history_by_route(engine)  # its history went with it


def test_interval_change_converges_on_every_provider(make_queue, job_settings, redis_client, pg_url):
    from magpie.maintenance import interval as iv

    old = job_settings.schedule.interval_ms
    q = make_queue(shards=job_settings.schedule.shards, interval_ms=old)
    q.schedule([(f"c0nf{i:020x}", Payload(i, Route("http", "127.0.0.1", 9), f"c0nf{i:020x}", [1]).encode())
                for i in range(30)])
    engine = sa.create_engine(pg_url)
    try:
        rep = run_job("interval_respread", job_settings, engine=engine, redis=redis_client)
        assert rep["status"] == "ok" and rep["result"]["action"] == "recorded", rep
        new = job_settings.model_copy(update={"check_interval": old / 2000})
        rep = run_job("interval_respread", new, engine=engine, redis=redis_client)
        assert rep["status"] == "ok" and rep["result"]["action"] == "done", rep
        st = iv.read_interval_state(make_queue(shards=job_settings.schedule.shards, interval_ms=old // 2))
        assert st["effective_ms"] == old // 2 and st["converged"] and st["respreads"] == 1
        assert st["last"]["moved"] == 30
    finally:
        with engine.begin() as c:
            c.execute(sa.text("DELETE FROM maintenance_runs WHERE job = 'interval_respread'"))
        engine.dispose()


def test_rebuild_restores_a_lost_schedule_on_every_provider(jq, job_settings, owners_db, redis_client):
    engine, (A, _B) = owners_db
    h = "c0nf" + "5" * 20
    _route(engine, h, [A])
    rep = run_job("rebuild", job_settings, engine=engine, redis=redis_client)
    assert rep["status"] == "ok" and rep["result"]["rebuilt"] and rep["result"]["new"] == 1, rep
    assert json.loads(jq.payload(h))["w"] == [A] and jq.score(h) is not None
    rep = run_job("rebuild", job_settings, engine=engine, redis=redis_client)
    assert rep["status"] == "ok" and rep["result"]["rebuilt"] is False, rep  # the marker is set


def test_orphan_routes_leave_the_schedule_and_the_database_on_every_provider(jq, job_settings, owners_db,
                                                                             redis_client, clock):
    engine, (A, _B) = owners_db
    orphan, owned = "c0nf" + "6" * 20, "c0nf" + "7" * 20
    ids = {orphan: _route(engine, orphan, []), owned: _route(engine, owned, [A])}
    jq.schedule([(h, Payload(ids[h], Route("http", "127.0.0.1", 9), h, [A]).encode()) for h in ids])
    add_history(engine, ids.values())
    rep = run_job("orphan_routes", job_settings, engine=engine, redis=redis_client)
    assert rep["status"] == "ok" and rep["result"]["deleted"] == 1, rep
    history = history_by_route(engine)
    assert ids[orphan] not in history and history[ids[owned]] == 2  # the deleted route's history went too
    assert jq.payloads([orphan, owned])[0] is None and jq.score(orphan) is None
    assert jq.score(owned) is not None
    with engine.connect() as c:
        left = set(c.execute(sa.text("SELECT route_hash FROM routes WHERE route_hash LIKE 'c0nf%'")).scalars())
    assert {x.strip() for x in left} == {owned}


def test_blacklist_refresh_takes_a_skipped_route_off_every_schedule_and_back(jq, job_settings, db, redis_client,
                                                                            tmp_path):
    from magpie.blacklists.sources import add_source, set_policy
    from magpie.base.crypto import get_keyring
    from magpie.db.repo import upsert_routes
    from magpie.queue.payload import schedule_item

    s = job_settings.model_copy(update={"enrich_allow_private": "127.0.0.0/8"})
    rows = upsert_routes(db, get_keyring(s.encryption_key), "gamma",
                         [Route("http", h, 8080) for h in ("127.0.0.1", "127.0.0.2")]).routes
    jq.schedule([schedule_item(r) for r in rows])
    listed, kept = (r.route_hash.strip() for r in sorted(rows, key=lambda r: r.route.host, reverse=True))
    set_policy(db, "gamma", "skip")
    source = tmp_path / "bad.txt"
    source.write_text("127.0.0.2\n")
    add_source(db, "local", str(source))
    rep = run_job("blacklist_refresh", s, engine=db, redis=redis_client)
    assert rep["status"] == "ok" and rep["result"]["unscheduled"] == 1, rep
    assert jq.payloads([listed, kept])[0] is None and jq.score(kept) is not None
    source.write_text("127.0.0.9\n")
    rep = run_job("blacklist_refresh", s, engine=db, redis=redis_client)
    assert rep["status"] == "ok" and rep["result"]["rescheduled"] == 1, rep
    assert jq.score(listed) is not None


def test_promote_shares_its_budget_and_the_engines_on_every_provider(jq, job_settings):
    from magpie.pipeline.promote import promote_with_settings

    jq.schedule([(f"c0nf{i:020x}", Payload(i, Route("http", "127.0.0.1", 9), f"c0nf{i:020x}", [1]).encode())
                 for i in range(40)])
    for i in range(40):
        jq.enqueue_in(f"c0nf{i:020x}", 0)
    registry = jq.capacity_registry()
    registry.announce("engine-a", 10, 10_000)
    registry.announce("engine-b", 10, 10_000)
    messages: list = []
    s = job_settings.model_copy(update={"promote_budget": 30})
    claimed = promote_with_settings(jq, s.schedule, messages.append, capacity=registry.total())
    assert claimed == 20  # capped by the engines' slots, not the budget
    # messages of the smaller of the grant (30) and the slots (20), divided by the live engines: one
    # engine never gets more than its share of what the pass could claim
    assert [len(m) for m in messages] == [10, 10]
    assert len(jq.in_flight(100)) == 20
