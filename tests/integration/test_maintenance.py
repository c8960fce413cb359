"""Maintenance jobs against real PostgreSQL and Redis: leader exclusivity, status recording, partitions,
retention, daily counters, orphan routes, token expiry, outbox cleanup and the schedule rebuild."""

from __future__ import annotations

import threading
import time
from datetime import UTC, date, datetime, timedelta

import pytest
import sqlalchemy as sa

from helpers import add_history, history_by_route, wait_until

from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.queue.payload import schedule_item
from magpie.coordination.leader import LeaderLock
from magpie.wiring.jobs import run_job
from magpie.maintenance.base import Job
from magpie.maintenance.partitions import create_month_partition, list_partitions
from magpie.maintenance.rebuild import marker_key, rebuild_schedule
from magpie.maintenance.runner import read_job_status
from magpie.wiring.jobs import job_status
from magpie.queue import QueueError, RouteQueue
from magpie.base.routes import Route

KEY = "test-key-0123456789abcdef"


@pytest.fixture
def s(settings, pg_url):
    return settings


@pytest.fixture
def partitions_cleanup(db):
    """Drops every check_history partition a test created (the session database outlives the test)."""
    with db.begin() as c:
        before = {p.name for p in list_partitions(c)}
    yield
    with db.begin() as c:
        for p in list_partitions(c):
            if p.name not in before and not p.is_default:
                c.exec_driver_sql(f"DROP TABLE {p.name}")


def _routes(db, n=3, ws="maint", host="10.3.0.1"):
    return upsert_routes(db, get_keyring(KEY), ws, [Route("http", host, 7000 + i) for i in range(n)]).routes


def _history(db, rows):
    """Insert (route_id, checked_at, alive, latency_ms, body) rows into check_history."""
    with db.begin() as c:
        for rid, at, alive, lat, body in rows:
            c.execute(
                sa.text(
                    "INSERT INTO check_history (route_id, checked_at, alive, latency_ms, body) "
                    "VALUES (:r, :t, :a, :l, :b)"
                ),
                {"r": rid, "t": at, "a": alive, "l": lat, "b": body},
            )


def _where(db, at) -> str:
    with db.connect() as c:
        return c.execute(
            sa.text("SELECT tableoid::regclass::text FROM check_history WHERE checked_at = :t"), {"t": at}
        ).scalar_one()


# ----------------------------------------------------------------------------------- leader and records


class _SlowJob(Job):
    name = "slow_probe"
    every = 0

    def __init__(self):
        self.active = 0
        self.max_active = 0
        self.runs = 0
        self._lock = threading.Lock()

    def run(self, ctx):
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.runs += 1
        time.sleep(0.4)  # the behaviour: a job that takes a while, so two contenders overlap
        with self._lock:
            self.active -= 1
        return {"slept": 0.4}


def test_only_one_holder_runs_a_job_then_it_hands_over(s, db, redis_client):
    job = _SlowJob()
    results = []
    barrier = threading.Barrier(2)

    def contender():
        barrier.wait()
        results.append(run_job(job, s, engine=db))

    threads = [threading.Thread(target=contender) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r["status"] for r in results) == ["ok", "skipped"]
    assert job.max_active == 1 and job.runs == 1
    # The lock was released: the next pass (the other contender's next trigger) runs.
    assert run_job(job, s, engine=db)["status"] == "ok"
    # A holder that died without releasing blocks others only until its lease runs out.
    dead = LeaderLock(redis_client, s.redis_prefix, job.lock, ttl_ms=300)
    assert dead.acquire()
    assert run_job(job, s, engine=db)["status"] == "skipped"
    wait_until(lambda: not redis_client.exists(dead.key), timeout=5, what="the dead holder's lease run out")
    assert run_job(job, s, engine=db)["status"] == "ok"
    assert job.runs == 3
    [row] = [r for r in read_job_status(db) if r["job"] == "slow_probe"]
    assert row["runs_total"] == 3 and row["failures_total"] == 0 and row["last_success_at"] is not None


def test_failures_are_recorded_and_success_keeps_counting(s, db):
    class Boom(Job):
        name = "boom_probe"
        fail = True

        def run(self, ctx):
            if self.fail:
                raise RuntimeError("disk on fire")
            return {"fine": True}

    job = Boom()
    r = run_job(job, s, engine=db)
    assert r["status"] == "error" and "disk on fire" in r["error"]
    job.fail = False
    assert run_job(job, s, engine=db)["status"] == "ok"
    [row] = [r for r in read_job_status(db) if r["job"] == "boom_probe"]
    assert (row["runs_total"], row["failures_total"]) == (2, 1)
    assert "disk on fire" in row["last_error"] and row["last_success_at"] >= row["last_error_at"]
    assert row["last_result"] == {"fine": True, "complete": True}


def test_job_that_loses_its_lock_stops_at_the_next_batch(s, db, redis_client):
    fast = s.model_copy(update={"maintenance_lock_ttl": 1.0})

    class Long(Job):
        name = "long_probe"

        def run(self, ctx):
            n = 0
            while not ctx.should_stop():
                if n == 2:  # another process took over the lock meanwhile
                    redis_client.set(f"{s.redis_prefix}leader:{self.name}", "thief")
                    time.sleep(fast.maintenance_lock_ttl / 3 + 0.3)  # the behaviour: past one renewal
                ctx.tick()
                n += 1
            return {"batches": n, "complete": False}

    r = run_job(Long(), fast, engine=db)
    assert (
        r["status"] == "ok" and r["result"]["stopped"] == "leader lock lost" and r["result"]["batches"] == 3
    )
    assert redis_client.get(f"{s.redis_prefix}leader:long_probe") == b"thief"  # not released by the loser


# -------------------------------------------------------------------------------------------- partitions


def test_partitions_are_prepared_ahead_and_default_rows_moved_into_them(s, db, partitions_cleanup):
    [r] = _routes(db, 1)
    now = datetime(2093, 3, 10, 12, tzinfo=UTC)
    past, future = datetime(2093, 2, 14, tzinfo=UTC), datetime(2093, 4, 2, tzinfo=UTC)
    _history(db, [(r.route_id, past, True, 5.0, "b"), (r.route_id, future, False, None, None)])
    assert _where(db, past) == _where(db, future) == "check_history_default"

    res = run_job("partitions", s.model_copy(update={"partition_months_ahead": 2}), engine=db, now=now)
    assert res["status"] == "ok", res
    assert res["result"]["created"] == [
        "check_history_p209303",
        "check_history_p209304",
        "check_history_p209305",
        "check_history_p209302",
    ]
    assert res["result"]["moved"] == 2
    assert _where(db, past) == "check_history_p209302" and _where(db, future) == "check_history_p209304"
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM check_history")).scalar_one() == 2
        assert c.execute(sa.text("SELECT count(*) FROM check_history_default")).scalar_one() == 0
    again = run_job("partitions", s.model_copy(update={"partition_months_ahead": 2}), engine=db, now=now)
    assert again["result"]["created"] == [] and again["result"]["existing"] == 3
    # New rows of a prepared month go straight into its partition.
    at = datetime(2093, 5, 1, tzinfo=UTC)
    _history(db, [(r.route_id, at, True, 1.0, None)])
    assert _where(db, at) == "check_history_p209305"


def test_partition_creation_is_all_or_nothing(s, db, partitions_cleanup):
    [r] = _routes(db, 1)
    at = datetime(2096, 7, 3, tzinfo=UTC)
    _history(db, [(r.route_id, at, True, 1.0, None)])
    with db.begin() as c:  # a competing table name makes the CREATE fail after the detach
        c.exec_driver_sql("CREATE TABLE check_history_p209607 (x int)")
    try:
        with pytest.raises(sa.exc.ProgrammingError):
            create_month_partition(db, at)
        with db.begin() as c:
            parts = {p.name: p for p in list_partitions(c)}
        assert parts["check_history_default"].is_default  # still attached
        assert _where(db, at) == "check_history_default"  # row neither lost nor moved
    finally:
        with db.begin() as c:
            c.exec_driver_sql("DROP TABLE check_history_p209607")
    assert create_month_partition(db, at) == {"name": "check_history_p209607", "created": True, "moved": 1}


# --------------------------------------------------------------------------------------------- retention


def test_history_retention_drops_whole_old_partitions_and_old_default_rows(s, db, partitions_cleanup):
    [r] = _routes(db, 1)
    now = datetime(2091, 6, 15, tzinfo=UTC)
    for m in (1, 2, 5, 6):
        create_month_partition(db, datetime(2091, m, 1, tzinfo=UTC))
    rows = [
        (r.route_id, datetime(2091, 1, 20, tzinfo=UTC), True, 1.0, None),  # old partition
        (r.route_id, datetime(2091, 2, 27, tzinfo=UTC), True, 1.0, None),  # old partition
        (r.route_id, datetime(2090, 12, 5, tzinfo=UTC), True, 1.0, None),  # DEFAULT, past retention
        (r.route_id, datetime(2091, 4, 1, tzinfo=UTC), True, 1.0, None),  # DEFAULT, kept
        (r.route_id, datetime(2091, 5, 30, tzinfo=UTC), False, None, None),  # kept
    ]
    _history(db, rows)
    with db.begin() as c:
        c.execute(
            sa.text(
                "INSERT INTO route_daily (route_id, day, checks, alive) VALUES "
                "(:r, '2089-01-01', 3, 1), (:r, '2091-06-01', 2, 2)"
            ),
            {"r": r.route_id},
        )
    res = run_job(
        "history_retention",
        s.model_copy(update={"daily_retention_days": 400}),
        engine=db,
        now=now,
        batch_size=1,
    )
    assert res["status"] == "ok", res
    # partitions other tests left in the shared session database are older still and may go too
    ours = sorted(n for n in res["result"]["dropped"] if n.startswith("check_history_p209"))
    assert ours == ["check_history_p209101", "check_history_p209102"]
    assert res["result"]["default_deleted"] == 1 and res["result"]["daily_deleted"] == 1
    with db.connect() as c:
        left = sorted(c.execute(sa.text("SELECT checked_at FROM check_history")).scalars())
        days = list(c.execute(sa.text("SELECT day FROM route_daily")).scalars())
    assert left == [rows[3][1], rows[4][1]] and days == [date(2091, 6, 1)]
    with db.begin() as c:
        names = {p.name for p in list_partitions(c)}
    assert "check_history_p209101" not in names and "check_history_p209105" in names


def test_body_retention_blanks_old_bodies_in_batches_and_keeps_rows(s, db):
    [r] = _routes(db, 1)
    now = datetime(2094, 9, 20, tzinfo=UTC)
    old = [(r.route_id, now - timedelta(days=10, minutes=i), True, 1.0, f"old{i}") for i in range(5)]
    new = [(r.route_id, now - timedelta(days=1), True, 1.0, "fresh")]
    _history(db, old + new)
    res = run_job("body_retention", s, engine=db, now=now, batch_size=2, max_batches=2)
    assert res["result"]["blanked"] == 4 and res["result"]["complete"] is False
    res = run_job("body_retention", s, engine=db, now=now, batch_size=2)
    assert res["result"]["blanked"] == 1 and res["result"]["complete"] is True
    with db.connect() as c:
        bodies = c.execute(sa.text("SELECT body FROM check_history ORDER BY checked_at")).scalars().all()
    assert bodies == [None] * 5 + ["fresh"]


# ------------------------------------------------------------------------------------------ daily counters


def _daily(db) -> dict:
    with db.connect() as c:
        return {
            (rid, d): (n, a, ls, lc, avg)
            for rid, d, n, a, ls, lc, avg in c.execute(
                sa.text(
                    "SELECT route_id, day, checks, alive, latency_sum_ms, latency_count, latency_avg_ms "
                    "FROM route_daily"
                )
            )
        }


def test_daily_counters_compact_idempotently_and_resume_after_interruption(s, db):
    a, b = _routes(db, 2)
    now = datetime(2095, 1, 10, 12, tzinfo=UTC)
    d8, d9, d10 = (datetime(2095, 1, d, 6, tzinfo=UTC) for d in (8, 9, 10))
    _history(
        db,
        [
            (a.route_id, d8, True, 10.0, None),
            (a.route_id, d8 + timedelta(hours=1), False, None, None),
            (b.route_id, d9, True, 30.0, None),
            (b.route_id, d9 + timedelta(hours=2), True, 50.0, None),
            (a.route_id, d10, True, 20.0, None),
        ],
    )
    cfg = s.model_copy(update={"rollup_lookback_days": 1})
    # One route per batch, two batches per pass: the pass stops, keeps a cursor, the next one resumes.
    first = run_job("daily_rollup", cfg, engine=db, now=now, batch_size=1, max_batches=2)
    assert first["result"]["complete"] is False and first["result"]["resume_day"] == "2095-01-08"
    passes = 1
    while True:
        r = run_job("daily_rollup", cfg, engine=db, now=now, batch_size=1, max_batches=2)
        passes += 1
        if r["result"]["complete"]:
            break
        assert passes < 10
    expected = {
        (a.route_id, date(2095, 1, 8)): (2, 1, 10.0, 1, 10.0),
        (b.route_id, date(2095, 1, 9)): (2, 2, 80.0, 2, 40.0),
        (a.route_id, date(2095, 1, 10)): (1, 1, 20.0, 1, 20.0),
    }
    assert _daily(db) == expected
    assert r["result"]["closed_through"] == "2095-01-08"
    # Repeating changes nothing (recomputed, not added).
    run_job("daily_rollup", cfg, engine=db, now=now)
    assert _daily(db) == expected
    # A late result for an open day is picked up; a closed day is not recomputed.
    _history(
        db,
        [
            (b.route_id, d9 + timedelta(hours=5), False, None, None),
            (a.route_id, d8 + timedelta(hours=5), True, 99.0, None),
        ],
    )
    run_job("daily_rollup", cfg, engine=db, now=now)
    got = _daily(db)
    assert got[(b.route_id, date(2095, 1, 9))] == (3, 2, 80.0, 2, 40.0)
    assert got[(a.route_id, date(2095, 1, 8))] == (2, 1, 10.0, 1, 10.0)


# ------------------------------------------------------------------------------------------ orphan routes


def _queue(s, redis_client):
    return RouteQueue.from_settings(s, redis_client)


def test_orphan_routes_leave_postgres_and_redis_except_under_a_live_lease(s, db, redis_client):
    q = _queue(s, redis_client)
    r1, r2, r3, r4 = _routes(db, 4)
    q.schedule([schedule_item(x) for x in (r1, r2, r3, r4)])
    far = q.server_time_ms() + 10_000_000
    for x in (r1, r3, r4):
        q.enqueue_at(x.route_hash, far)
    q.enqueue_in(r2.route_hash, 0)
    [lease] = q.pop(1)
    assert lease.member == r2.route_hash
    with db.begin() as c:  # r1, r2, r4 lose their only workspace
        c.execute(
            sa.text("DELETE FROM route_workspaces WHERE route_id = ANY(:ids)"),
            {"ids": [r1.route_id, r2.route_id, r4.route_id]},
        )
    q.remove_route(r4.route_hash)  # an earlier pass removed it from Redis and died before its commit
    add_history(db, [x.route_id for x in (r1, r2, r3, r4)])

    res = run_job("orphan_routes", s, engine=db, redis=redis_client)
    assert res["result"] == {"deleted": 2, "skipped_leased": 1, "complete": True}
    assert history_by_route(db) == {r2.route_id: 2, r3.route_id: 2}  # the deleted routes' history went too

    def in_pg(x):
        with db.connect() as c:
            return c.execute(
                sa.text("SELECT count(*) FROM routes WHERE id = :i"), {"i": x.route_id}
            ).scalar_one()

    assert (in_pg(r1), in_pg(r2), in_pg(r3), in_pg(r4)) == (0, 1, 1, 0)
    assert q.payload(r1.route_hash) is None and q.score(r1.route_hash) is None
    assert q.payload(r2.route_hash) is not None and q.payload(r3.route_hash) is not None
    # The check finishes; the next pass removes the route.
    q.complete([lease])
    res = run_job("orphan_routes", s, engine=db, redis=redis_client)
    assert res["result"]["deleted"] == 1 and in_pg(r2) == 0 and q.payload(r2.route_hash) is None
    assert history_by_route(db) == {r3.route_id: 2}
    with pytest.raises(QueueError):
        q.remove_route(r2.route_hash)


# ------------------------------------------------------------------------------- tokens and the outbox


def test_expired_tokens_and_dead_invitations_are_deleted_after_retention(s, db):
    now = datetime(2097, 5, 1, tzinfo=UTC)
    long_ago, recently, later = now - timedelta(days=30), now - timedelta(days=1), now + timedelta(days=3)
    with db.begin() as c:
        ws = c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('tok') RETURNING id")).scalar_one()
        c.execute(
            sa.text(
                "INSERT INTO password_reset_tokens (email, token_hash, expires_at, used_at) VALUES "
                "('a@x', 't1', :long, NULL), ('b@x', 't2', :recent, NULL), ('c@x', 't3', :later, :long), "
                "('d@x', 't4', :later, NULL)"
            ),
            {"long": long_ago, "recent": recently, "later": later},
        )
        c.execute(
            sa.text(
                "INSERT INTO invitations "
                "(workspace_id, email, token_hash, expires_at, accepted_at, revoked_at) VALUES "
                "(:w, 'a@x', 'i1', :long, NULL, NULL), (:w, 'b@x', 'i2', :later, NULL, :long), "
                "(:w, 'c@x', 'i3', :long, :long, NULL), (:w, 'd@x', 'i4', :later, NULL, NULL), "
                "(:w, 'e@x', 'i5', :recent, NULL, NULL)"
            ),
            {"w": ws, "long": long_ago, "recent": recently, "later": later},
        )
    res = run_job("token_expiry", s, engine=db, now=now, batch_size=1)
    assert res["result"]["reset_tokens_deleted"] == 2 and res["result"]["invitations_deleted"] == 2
    with db.connect() as c:
        assert sorted(c.execute(sa.text("SELECT token_hash FROM password_reset_tokens")).scalars()) == [
            "t2",
            "t4",
        ]
        assert sorted(c.execute(sa.text("SELECT token_hash FROM invitations")).scalars()) == [
            "i3",
            "i4",
            "i5",
        ]


def test_outbox_cleanup_deletes_terminal_rows_and_tolerates_a_missing_table(s, db):
    now = datetime.now(UTC)
    old = now - timedelta(days=30)
    with db.begin() as c:
        if not c.execute(sa.text("SELECT to_regclass('email_outbox') IS NOT NULL")).scalar_one():
            pytest.skip("email_outbox not in this schema")
        for i, (status, sent_at, updated_at) in enumerate(
            [
                ("sent", old, old),
                ("failed", None, old),
                ("pending", None, old),
                ("sent", now, now),
            ]
        ):
            c.execute(
                sa.text(
                    "INSERT INTO email_outbox "
                    "(recipient, subject, body, kind, message_id, status, sent_at, updated_at) "
                    "VALUES ('r@x', 's', 'b', 'test', :m, :st, :sa, :ua)"
                ),
                {"m": f"<m{i}@test>", "st": status, "sa": sent_at, "ua": updated_at},
            )
    res = run_job("outbox_cleanup", s, engine=db, now=now)
    assert res["result"]["deleted"] == 2
    with db.connect() as c:
        assert sorted(c.execute(sa.text("SELECT status FROM email_outbox")).scalars()) == ["pending", "sent"]
    with db.begin() as c:
        c.exec_driver_sql("ALTER TABLE email_outbox RENAME TO email_outbox_hidden")
    try:
        res = run_job("outbox_cleanup", s, engine=db, now=now)
        assert res["status"] == "ok" and "does not exist" in res["result"]["skipped"]
    finally:
        with db.begin() as c:
            c.exec_driver_sql("ALTER TABLE email_outbox_hidden RENAME TO email_outbox")


# ----------------------------------------------------------------------------------------- schedule rebuild


def _prefix_keys(redis_client, prefix):
    return list(redis_client.scan_iter(match=prefix + "*", count=1000)) + list(
        redis_client.scan_iter(match="{" + prefix + "*", count=1000)
    )


def test_rebuild_after_redis_lost_everything_schedules_every_route_spread(s, db, redis_client):
    q = _queue(s, redis_client)
    routes = _routes(db, 40, host="10.4.0.1")
    q.schedule([schedule_item(x) for x in routes])
    orphan = _routes(db, 1, ws="gone", host="10.4.9.9")[0]
    with db.begin() as c:
        c.execute(sa.text("DELETE FROM route_workspaces WHERE route_id = :i"), {"i": orphan.route_id})
    # Redis loses the data: every key under this test's prefix is gone (never FLUSHDB a shared db).
    redis_client.delete(*_prefix_keys(redis_client, s.redis_prefix))
    assert q.status()["totals"]["scheduled"] == 0

    before = q.server_time_ms()
    res = run_job("rebuild", s, engine=db, redis=redis_client)  # marker gone: the job rebuilds on its own
    assert res["status"] == "ok" and res["result"]["rebuilt"] is True
    assert res["result"]["new"] == 40 and res["result"]["routes"] == 40
    scores = sorted(float(q.score(x.route_hash)) for x in routes)
    interval = s.check_interval * 1000
    assert before <= scores[0] <= before + 1000 and scores[-1] <= before + interval + 1000
    gaps = [b - a for a, b in zip(scores, scores[1:])]
    assert min(gaps) > 0.5 * interval / 40 and max(gaps) < 1.5 * interval / 40  # spread, not a burst
    assert q.payload(orphan.route_hash) is None
    assert redis_client.exists(marker_key(q))
    # Marker present: the job leaves the schedule alone.
    assert run_job("rebuild", s, engine=db, redis=redis_client)["result"]["rebuilt"] is False


def test_rebuild_keeps_routes_still_present_and_readds_lost_ones(s, db, redis_client):
    q = _queue(s, redis_client)
    routes = _routes(db, 6, host="10.5.0.1")
    q.schedule([schedule_item(x) for x in routes])
    far = q.server_time_ms() + 50_000_000
    q.enqueue_at(routes[0].route_hash, far)
    q.enqueue_in(routes[1].route_hash, 0)
    [lease] = q.pop(1)
    kept = {x.route_hash: q.score(x.route_hash) for x in routes[:4]}
    for x in routes[4:]:  # partial loss
        q.remove_route(x.route_hash)
    res = rebuild_schedule(s, engine=db, queue=q, chunk=4)
    assert res["ran"] and (res["new"], res["unchanged"], res["routes"]) == (2, 4, 6)
    assert {h: q.score(h) for h in kept} == kept  # due times and the live lease untouched
    assert (
        q.score(routes[0].route_hash) == f"{far:.2f}"
        and q.score(lease.member) == f"{float(lease.lease_score):.2f}"
    )
    assert all(q.payload(x.route_hash) for x in routes[4:])
    # Under the rebuild lock held elsewhere, a rebuild does nothing.
    other = LeaderLock(redis_client, s.redis_prefix, "rebuild", ttl_ms=5000)
    assert other.acquire()
    try:
        assert rebuild_schedule(s, engine=db, queue=q)["ran"] is False
    finally:
        other.release()


# ------------------------------------------------------------------------------------------- everything


def test_run_all_jobs_on_an_empty_deployment_and_report_status(s, db, redis_client):
    from magpie.wiring.jobs import run_all

    results = run_all(s, engine=db, redis=redis_client)
    assert all(r["status"] == "ok" for r in results), results
    status = {r["job"]: r for r in job_status(s, engine=db, redis=redis_client)}
    assert set(status) >= {
        "partitions",
        "history_retention",
        "body_retention",
        "daily_rollup",
        "orphan_routes",
        "token_expiry",
        "outbox_cleanup",
        "stats_ledger",
        "rebuild",
    }
    assert all(
        r["runs_total"] == 1 and r["last_success_at"] and r["leader_active"] is False for r in status.values()
    )


def test_daily_partitions_let_retention_drop_one_day_at_a_time(s, db, partitions_cleanup):
    [r] = _routes(db, 1)
    day = s.model_copy(update={"partition_span": "day", "partition_days_ahead": 2, "history_retention_days": 2})
    now = datetime(2094, 5, 10, 9, tzinfo=UTC)
    early = datetime(2094, 5, 7, 23, tzinfo=UTC)  # in DEFAULT before any partition of its day existed
    _history(db, [(r.route_id, early, True, 1.0, None), (r.route_id, now, True, 1.0, None)])
    res = run_job("partitions", day, engine=db, now=now)
    assert res["status"] == "ok", res
    assert res["result"]["created"] == ["check_history_p20940510", "check_history_p20940511",
                                        "check_history_p20940512"]
    assert _where(db, now) == "check_history_p20940510"
    res = run_job("partitions", day, engine=db, now=now + timedelta(days=1))
    assert res["result"]["created"] == ["check_history_p20940513"]
    # a day-old month boundary is no different: the 7th's row moved into its own day once within retention
    res = run_job("partitions", day.model_copy(update={"history_retention_days": 5}), engine=db, now=now)
    assert "check_history_p20940507" in res["result"]["created"] and _where(db, early) == "check_history_p20940507"
    res = run_job("history_retention", day, engine=db, now=now)
    assert res["status"] == "ok", res
    dropped = res["result"]["dropped"]
    assert "check_history_p20940507" in dropped  # its whole day ended before the cutoff
    assert not {"check_history_p20940508", "check_history_p20940510"} & set(dropped)
    with db.begin() as c:
        names = {p.name for p in list_partitions(c)}
    assert {"check_history_p20940510", "check_history_p20940511"} <= names


def test_an_unknown_partition_span_is_refused():
    from magpie.maintenance.partitions import create_partition

    with pytest.raises(ValueError, match="partition span must be one of month, day"):
        create_partition(None, datetime(2094, 1, 1, tzinfo=UTC), "week")
