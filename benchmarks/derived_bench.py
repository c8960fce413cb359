"""Measure the derived-data jobs on a synthetic population against the local PostgreSQL and Redis.

Creates a throwaway database, migrates it, stores ``--routes`` routes in ``--workspaces`` workspaces with
``--checks`` history rows per route spread over the last day, then times one full pass of
``daily_rollup`` (the existing compaction, the baseline: it reads the same history) and of each derived
job, and prints routes (or rows) per second and each job's time as a ratio of the baseline's. The
database and the Redis keys are dropped afterwards.

    .venv/bin/python benchmarks/derived_bench.py [--routes 20000] [--checks 12] [--workspaces 20]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from datetime import UTC, datetime

import redis
import sqlalchemy as sa

os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only
from magpie.config import load_settings
from magpie.db.migrate import ensure_database, upgrade
from magpie.wiring.jobs import run_job

ADMIN = os.environ.get("MAGPIE_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/x").rsplit("/", 1)[0] + "/postgres"
REDIS = os.environ.get("MAGPIE_REDIS_URL", "redis://127.0.0.1:6379/15")


def populate(engine, routes: int, checks: int, workspaces: int, now: datetime) -> None:
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO workspaces (name) SELECT 'bench-' || g FROM generate_series(1, :n) g"),
                  {"n": workspaces})
        c.execute(sa.text("""
            INSERT INTO routes (route_hash, protocol, host, port)
            SELECT lpad(to_hex(g), 24, '0'), (ARRAY['http','https','socks4','socks5'])[1 + g % 4],
                   '10.' || (g >> 16 & 255) || '.' || (g >> 8 & 255) || '.' || (g & 255), 1024 + g % 60000
            FROM generate_series(1, :n) g"""), {"n": routes})
        c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) "
                          "SELECT id, 1 + id % :w FROM routes"), {"w": workspaces})
        c.execute(sa.text("INSERT INTO route_sources (route_id, workspace_id, source) "
                          "SELECT route_id, workspace_id, 'list-' || (route_id % 5) FROM route_workspaces"))
        c.execute(sa.text("""
            INSERT INTO check_history (route_id, checked_at, alive, latency_ms, anonymity)
            SELECT r.id, CAST(:now AS timestamptz) - make_interval(secs => k * 86400.0 / :k + r.id % 60),
                   (r.id + k) % 3 = 0, CASE WHEN (r.id + k) % 3 = 0 THEN 100 + r.id % 900 END,
                   CASE WHEN (r.id + k) % 3 = 0 THEN 'elite' END
            FROM routes r, generate_series(1, :k) k"""), {"now": now, "k": checks})
        c.execute(sa.text("""
            INSERT INTO route_health (route_id, last_checked_at, alive, latency_ms, checks_total, alive_total,
                                      consecutive_failures, last_alive_at)
            SELECT id, CAST(:now AS timestamptz), id % 3 = 0, 200, :k, :k / 3, id % 4,
                   CAST(:now AS timestamptz) - interval '1 hour' FROM routes"""), {"now": now, "k": checks})
        c.execute(sa.text("INSERT INTO reputation_dirty (route_id) SELECT id FROM routes"))
        c.execute(sa.text("ANALYZE"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", type=int, default=20_000)
    ap.add_argument("--checks", type=int, default=12)
    ap.add_argument("--workspaces", type=int, default=20)
    a = ap.parse_args()
    name = f"magpie_bench_{uuid.uuid4().hex[:8]}"
    url = ADMIN.rsplit("/", 1)[0] + "/" + name
    prefix = f"magpie-bench:{uuid.uuid4().hex[:8]}:"
    ensure_database(url)
    upgrade(url)
    engine = sa.create_engine(url)
    r = redis.Redis.from_url(REDIS)
    now = datetime.now(UTC)
    try:
        t0 = time.monotonic()
        populate(engine, a.routes, a.checks, a.workspaces, now)
        print(f"population: {a.routes} routes x {a.checks} checks in {a.workspaces} workspaces "
              f"({time.monotonic() - t0:.1f} s to store)")
        s = load_settings(database_url=url, redis_url=REDIS, redis_prefix=prefix,
                          maintenance_max_batches=1_000_000, maintenance_max_run_seconds=3600)
        results = {}
        for job in ("daily_rollup", "reputation", "workspace_snapshots", "hourly_counts", "source_stats",
                    "workspace_usage", "snapshot_retention"):
            t = time.monotonic()
            out = run_job(job, s, engine=engine, redis=r, now=now)
            results[job] = (time.monotonic() - t, out)
            assert out["status"] == "ok", out
        base = results["daily_rollup"][0]
        print(f"{'job':<22} {'seconds':>8} {'routes/s':>10} {'x baseline':>10}  result")
        for job, (sec, out) in results.items():
            res = {k: v for k, v in out["result"].items() if k in ("scored", "rows", "hours", "deleted")}
            print(f"{job:<22} {sec:8.2f} {a.routes / sec:10.0f} {sec / base:10.2f}  {res}")
    finally:
        engine.dispose()
        keys = list(r.scan_iter(match=prefix + "*"))
        if keys:
            r.delete(*keys)
        r.close()
        admin = sa.create_engine(ADMIN, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                      {"n": name})
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


if __name__ == "__main__":
    main()
