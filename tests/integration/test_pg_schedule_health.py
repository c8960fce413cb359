"""The PostgreSQL schedule's health: readiness through ``check_health`` and the vacuum warnings (a long
transaction holding the xmin horizon, dead tuples piling up)."""

from __future__ import annotations


import sqlalchemy as sa

from helpers import elapse

from magpie.observability.health import check_health
from magpie.queue import QueueKeys
from magpie.queue.pg import PgSchedule
from magpie.queue.pg.health import schedule_health


def test_health_reports_the_postgres_schedule_ready(settings, db, pg_url):
    s = settings.model_copy(update={"schedule_url": pg_url})
    q = PgSchedule(pg_url, QueueKeys(s.redis_prefix, s.queue_shards), interval_ms=60_000)
    q.check_layout()
    q.schedule([("a" * 24, '{"w":[1]}')])
    res = check_health(s)["checks"]["queue"]
    assert res["ok"] and "postgresql schedule: 1 routes" in res["detail"], res
    q.close()


def test_a_long_transaction_and_dead_tuples_raise_warnings(db, pg_url, redis_prefix):
    q = PgSchedule(pg_url, QueueKeys(redis_prefix, 4), interval_ms=1, lease_ms=60_000)
    q.check_layout()
    q.schedule([(f"{i:024x}", '{"w":[1]}') for i in range(50)])
    engine = sa.create_engine(pg_url)
    holder = engine.connect()
    try:
        with engine.connect() as c:
            detail, warn = schedule_health(c, q.name, horizon_s=0.5)
        assert not warn, detail
        holder.exec_driver_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.exec_driver_sql("SELECT count(*) FROM schedule_routes")  # takes a snapshot: the xmin horizon
        elapse(1.0)  # the behaviour: the snapshot must grow older than horizon_s
        for _ in range(20):  # churn: every cycle leaves a dead version of each row
            q.complete(q.pop(50))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.exec_driver_sql("VACUUM schedule_routes")  # cannot remove what the snapshot may still see
            c.exec_driver_sql("SELECT pg_stat_force_next_flush()")
            detail, warn = schedule_health(c, q.name, horizon_s=0.5, dead_min=100, dead_ratio=0.1)
        assert warn and "hold the xmin horizon" in detail, detail
        assert "dead tuples outnumber" in detail, detail
    finally:
        holder.rollback()
        holder.close()
        engine.dispose()
        q.close()
