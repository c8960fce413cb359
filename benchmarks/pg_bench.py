"""``queue_bench.py --backend postgresql``: the same schedule workload on Redis and on the PostgreSQL schedule,
with ratios, and a sustained run reporting dead tuples and table growth per table layout.

Creates a private database (``magpie_bench_<id>``) on ``MAGPIE_BENCH_PG_ADMIN_URL`` and its own Redis prefix
(database 14); removes both at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time
import uuid

import redis
import sqlalchemy as sa
from workload import SHARDS, URL, payload_for  # sets MAGPIE_EGRESS_ONLY before magpie is imported

from magpie.queue import QueueKeys, RouteQueue

ADMIN = os.environ.get("MAGPIE_BENCH_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")


def make(backend: str, prefix: str, url: str):
    """A provider on ``backend`` with interval 1 ms (a completed route is due again at once)."""
    if backend == "redis":
        return RouteQueue(redis.Redis.from_url(URL), QueueKeys(prefix, SHARDS), interval_ms=1, lease_ms=300_000)
    from magpie.queue.pg import PgSchedule

    q = PgSchedule(url, QueueKeys(prefix, SHARDS), interval_ms=1, lease_ms=300_000,
                   redis_client=redis.Redis.from_url(URL))
    q.check_layout()
    return q


def cycles(backend: str, prefix: str, url: str, batch: int, seconds: float, out=None, beat: bool = False) -> float:
    """Claim+complete routes/s, ``batch`` per call (``beat``: plus a start mark and a heartbeat per batch)."""
    q = make(backend, prefix, url)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        leases = q.pop(batch)
        if beat and leases:
            q.mark_started(leases)
            q.renew_many(leases)
        n += sum(1 for c in q.complete(leases) if c == 1)
    rate = n / (time.perf_counter() - t0)
    if out is not None:
        out.put(rate)
    return rate


def parallel(backend, prefix, url, batch, seconds, procs) -> float:
    out = mp.Queue()
    ps = [mp.Process(target=cycles, args=(backend, prefix, url, batch, seconds, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    rates = [out.get() for _ in ps]
    for p in ps:
        p.join()
    return sum(rates)


def table_stats(engine) -> dict:
    """``pg_stat_user_tables`` figures of ``schedule_routes`` and its size (bytes, heap and total)."""
    with engine.connect() as c:
        c.exec_driver_sql("SELECT pg_stat_force_next_flush()")
        row = c.execute(sa.text(
            "SELECT n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd, autovacuum_count, "
            "pg_relation_size('schedule_routes'), pg_total_relation_size('schedule_routes') "
            "FROM pg_stat_user_tables WHERE relname = 'schedule_routes'")).one()
    return dict(zip(("live", "dead", "upd", "hot", "autovacuums", "heap_bytes", "total_bytes"), row))


def sustained(engine, url, prefix, batch, seconds, fillfactor: int, hold: bool) -> dict:
    """Rebuild the table with ``fillfactor``, run claim + mark + heartbeat + complete for ``seconds``
    (``hold``: while another transaction keeps a snapshot open), and report the table's figures."""
    auto = engine.execution_options(isolation_level="AUTOCOMMIT")
    with auto.connect() as c:
        c.exec_driver_sql(f"ALTER TABLE schedule_routes SET (fillfactor = {int(fillfactor)})")
        c.exec_driver_sql("VACUUM FULL schedule_routes")
        c.exec_driver_sql("SELECT pg_stat_reset_single_table_counters('schedule_routes'::regclass)")
    before = table_stats(engine)
    holder, peak = None, {"dead": 0}
    if hold:
        holder = engine.connect()
        holder.exec_driver_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.exec_driver_sql("SELECT count(*) FROM schedule_routes")
    stop = threading.Event()

    def sample():
        while not stop.wait(1.0):
            peak["dead"] = max(peak["dead"], table_stats(engine)["dead"])

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    rate = cycles("postgresql", prefix, url, batch, seconds, beat=True)
    stop.set()
    t.join()
    with auto.connect() as c:
        c.exec_driver_sql("VACUUM schedule_routes")  # what a vacuum can reclaim now
    after = table_stats(engine)
    if holder is not None:
        holder.rollback()
        holder.close()
    return {"fillfactor": fillfactor, "hold": hold, "routes_per_s": rate, "peak_dead": max(peak["dead"], after["dead"]),
            "dead_after_vacuum": after["dead"], "live": after["live"], "updates": after["upd"],
            "hot_pct": 100.0 * after["hot"] / max(after["upd"], 1), "autovacuums": after["autovacuums"],
            "growth_mib": (after["total_bytes"] - before["total_bytes"]) / 2**20,
            "total_mib": after["total_bytes"] / 2**20}


def main(argv) -> int:
    ap = argparse.ArgumentParser(description="PostgreSQL schedule against Redis")
    ap.add_argument("--backend", choices=["postgresql"], default="postgresql")
    ap.add_argument("--routes", type=int, default=100_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--sustain", type=float, default=0.0, help="seconds per layout of the sustained run")
    a = ap.parse_args(argv)
    name = f"magpie_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = ADMIN.rsplit("/", 1)[0] + "/" + name
    prefix = f"magpie-bench:{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(URL)
    engine = sa.create_engine(url)
    try:
        from magpie.db.migrate import upgrade

        upgrade(url)
        print(f"routes={a.routes} shards={SHARDS} batch={a.batch} seconds_per_figure={a.seconds} procs={a.procs}")
        rates: dict[str, dict[str, float]] = {}
        for backend in ("redis", "postgresql"):
            q = make(backend, prefix, url)
            t0 = time.perf_counter()
            for off in range(0, a.routes, 10_000):
                q.schedule((payload_for(i) for i in range(off, min(off + 10_000, a.routes))), total=a.routes,
                           start_index=off, batch=500)
            imp = a.routes / (time.perf_counter() - t0)
            time.sleep(0.01)
            rates[backend] = {
                "import": imp,
                "single": cycles(backend, prefix, url, 1, a.seconds),
                "batched": cycles(backend, prefix, url, a.batch, a.seconds),
                "multi": parallel(backend, prefix, url, a.batch, a.seconds, a.procs),
            }
            print(f"{backend}: import {imp:,.0f} routes/s; claim+complete 1/call {rates[backend]['single']:,.0f}, "
                  f"{a.batch}/call {rates[backend]['batched']:,.0f}, {a.procs} procs {rates[backend]['multi']:,.0f} "
                  "routes/s")
        ratio = {k: rates["redis"][k] / max(rates["postgresql"][k], 1e-9) for k in rates["redis"]}
        print("ratio redis/postgresql (target <= 3 on batched): " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()))
        rows = []
        if a.sustain > 0:
            for ff, hold in ((100, False), (70, False), (70, True)):
                res = sustained(engine, url, prefix, a.batch, a.sustain, ff, hold)
                rows.append(res)
                print(f"sustained {a.sustain:g} s fillfactor={ff}{' snapshot held' if hold else ''}: "
                      f"{res['routes_per_s']:,.0f} routes/s, peak dead tuples {res['peak_dead']:,}, after vacuum "
                      f"{res['dead_after_vacuum']:,} (live {res['live']:,}), HOT {res['hot_pct']:.0f} % of "
                      f"{res['updates']:,} updates, autovacuums {res['autovacuums']}, growth {res['growth_mib']:.1f} MiB "
                      f"(total {res['total_mib']:.1f} MiB)")
        print(f"summary routes={a.routes} redis_batched={rates['redis']['batched']:.0f} "
              f"pg_batched={rates['postgresql']['batched']:.0f} ratio_batched={ratio['batched']:.2f} "
              f"ratio_single={ratio['single']:.2f} ratio_multi={ratio['multi']:.2f} "
              f"ratio_import={ratio['import']:.2f}"
              + "".join(f" ff{x['fillfactor']}{'_held' if x['hold'] else ''}_dead_after_vacuum={x['dead_after_vacuum']}"
                        f" ff{x['fillfactor']}{'_held' if x['hold'] else ''}_growth_mib={x['growth_mib']:.1f}"
                        for x in rows))
    finally:
        engine.dispose()
        keys = list(r.scan_iter(match=f"*{prefix}*", count=10_000))
        for i in range(0, len(keys), 10_000):
            r.delete(*keys[i: i + 10_000])
        with admin.connect() as c:
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
    return 0
