"""Sizing figures measured on this machine: Redis CPU and memory per route cycle, PostgreSQL cost per result.

    .venv/bin/python benchmarks/sizing.py [--cycles 200000] [--routes 100000] [--results 50000]
        [--pg-routes 20000] [--no-aof] [--skip-redis] [--skip-pg]

**Redis** (a private ``redis-server`` on a free loopback port, ``appendonly yes`` / ``everysec`` as
docs/operations.md asks for production unless ``--no-aof``; stopped by PID at the end). ``--routes`` routes
of 150-byte payloads are imported, then ``--cycles`` route cycles run as the check path runs them:

- claim: ``pop.lua``, ``MAGPIE_POP_BATCH`` (64) routes per call (promote, :mod:`magpie.pipeline.promote`);
- start mark: ``RouteQueue.mark_started`` for the claimed batch (the check pool marks what one loop pass
  started, :mod:`magpie.pipeline.checkpool`);
- renewal: one ``renew.lua`` per lease, pipelined per batch (``renew_many``; every cycle is charged one
  renewal, an upper bound: a check shorter than ``lease - renew_below`` renews none);
- completion: ``complete.lua`` with the results appended to the results stream (``complete_with_results``),
  ``--complete-batch`` leases per call (a 100 ms flush of a busy process; at most 500), plus the flush's
  metric counters (``record_check_batch``, ``record_start_timings``).

The server's CPU is the ``INFO cpu`` delta (``used_cpu_user + used_cpu_sys``, CPU seconds, so robust on
a noisy machine; ``*_main_thread`` is the one core a master can use); ``INFO commandstats`` gives the usec
inside commands. A second, shorter pass takes a ``commandstats`` snapshot around every step to split the
command time by step (``INFO`` itself is left out of the split). Memory: ``used_memory`` per route after
the cycles (payload, shard member, lease and cadence state), and the results stream's bytes per entry.
Baseline: the same data movement with no script, no fencing: ``ZRANGEBYSCORE LIMIT`` + ``MGET`` payloads +
``ZADD`` lease + ``ZADD`` next due + ``XADD`` result, pipelined, same batches.

**PostgreSQL** (a fresh database ``magpie_sizing_<rand>`` on ``MAGPIE_BENCH_PG_ADMIN_URL``, migrated with
the repo's Alembic, dropped at the end). ``--pg-routes`` routes are stored, one result per route is
ingested to create their ``route_health`` rows, then ``--results`` results are published to the private
Redis's results stream and ingested with :func:`magpie.stats.consumer.ingest` (``MAGPIE_STATS_BATCH`` 500),
exactly as the ``stats`` task does. Measured: CPU of the backend serving the ingestion's one connection
(``/proc/<pid>/stat`` utime + stime), WAL bytes per result (``pg_waldump`` of the run's WAL range, counting
only records of this database and of its transactions; the ``pg_current_wal_lsn()`` difference, which the
shared server's other users inflate, is printed beside it), ``check_history`` and ``stats_ledger`` bytes per
row, the ingestion process's own CPU and the private Redis's CPU per result (the consumer's reads and acks).
Baseline: a bare ``INSERT ... SELECT unnest(...)`` of the same rows, 500 per transaction, into a table of
``check_history``'s columns with no index, no partition, no ledger and no health upsert. The backend CPU
and ``pg_waldump`` figures need the PostgreSQL server on this machine (as root or its owner): elsewhere the
first prints ``nan`` and the second is left out.

Every figure is also printed as one ``sizing <name>=<value>`` line (stable names, greppable).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime

import redis
import sqlalchemy as sa

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only
from magpie.base import counters  # noqa: E402
from magpie.checker.result import CheckResult  # noqa: E402
from magpie.queue import QueueKeys, RouteQueue  # noqa: E402
from magpie.queue.completion import StreamTarget  # noqa: E402
from magpie.stats.consumer import ensure_group, ingest  # noqa: E402
from magpie.stats.entry import entry_fields  # noqa: E402
from magpie.queue.streams import GROUP, stream_key  # noqa: E402

from workload import SHARDS, PrivateRedis, payload_for  # noqa: E402

ADMIN = os.environ.get("MAGPIE_BENCH_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")
POP_BATCH = 64  # MAGPIE_POP_BATCH default
STATS_BATCH = 500  # MAGPIE_STATS_BATCH default
JUDGE = "http://judge.example:8080/echo"
BODY = json.dumps({"remote_addr": "203.0.113.7", "method": "GET", "headers": {
    "Host": "judge.example:8080", "User-Agent": "magpie/1", "Accept": "*/*", "Accept-Encoding": "identity",
    "Via": "1.1 proxy", "X-Forwarded-For": "203.0.113.7", "Connection": "close"}, "time": 1764800000.123})
# the real-world mix of docs/design.md: 70 % tarpit, 10 % refused, 15 % live, 5 % slow (live)
MIX = (("ReadTimeout", 70), ("ProxyError", 10), (None, 20))


def figure(name: str, value, unit: str = "", note: str = "") -> None:
    """Print one figure as ``sizing <name>=<value>`` (+ unit and note after ``#``)."""
    v = f"{value:.6g}" if isinstance(value, float) else str(value)
    tail = " ".join(x for x in (unit, note) if x)
    print(f"sizing {name}={v}" + (f"  # {tail}" if tail else ""), flush=True)


def result_fields(i: int, route_id: int, route_hash: str, now_ms: int) -> dict[str, str]:
    """The stream entry of check ``i`` of the mix: dead ones carry an error and no body, live ones the
    judge's echo (~330 bytes)."""
    k = i % 100
    error = next(e for e, share in _CUM if k < share)
    alive = error is None
    res = CheckResult(alive=alive, latency_ms=123.456 + (i % 900) if alive else None,
                      status=200 if alive else None, attempts=1 if alive else 2, error=error,
                      body=BODY if alive else None, anonymity="elite" if alive else None, judge=JUDGE,
                      checked_at_ms=now_ms, exit_ip="203.0.113.7" if alive else None)
    return entry_fields(res, route_id, route_hash)


_CUM, _acc = [], 0
for _e, _s in MIX:
    _acc += _s
    _CUM.append((_e, _acc))


# -------------------------------------------------------------------------------------------- Redis


def cpu(r: redis.Redis) -> tuple[float, float]:
    """``(process CPU s, main-thread CPU s)`` of the server so far (``INFO cpu``)."""
    i = r.info("cpu")
    main = float(i.get("used_cpu_user_main_thread", 0.0)) + float(i.get("used_cpu_sys_main_thread", 0.0))
    return float(i["used_cpu_user"]) + float(i["used_cpu_sys"]), main


def cmd_usec(r: redis.Redis) -> dict[str, tuple[int, int]]:
    """``{command: (calls, usec)}`` from ``INFO commandstats``."""
    out = {}
    for k, v in r.info("commandstats").items():
        out[k.removeprefix("cmdstat_")] = (int(v["calls"]), int(v["usec"]))
    return out


def usec_delta(a: dict, b: dict, skip=("info",)) -> tuple[int, dict[str, tuple[int, int]]]:
    """Command usec between two :func:`cmd_usec` snapshots (``INFO`` left out): ``(total, per command)``."""
    per = {}
    for k, (calls, us) in b.items():
        if k in skip:
            continue
        c0, u0 = a.get(k, (0, 0))
        if us - u0 or calls - c0:
            per[k] = (calls - c0, us - u0)
    return sum(u for _, u in per.values()), per


class CheckPath:
    """The Redis calls of the check path for one process: claim, mark, renew, complete + metrics."""

    def __init__(self, client: redis.Redis, prefix: str, complete_batch: int):
        self.q = RouteQueue(client, QueueKeys(prefix, SHARDS), interval_ms=1, lease_ms=300_000,
                            priority_share=0.5)
        self.r = client
        self.prefix = prefix
        self.stream = StreamTarget(stream_key(prefix), GROUP, 1_000_000, "evict_oldest")
        self.complete_batch = complete_batch
        self.pending: list = []
        self.n = 0

    def claim(self):
        return self.q.pop(POP_BATCH)

    def mark(self, leases) -> None:
        self.q.mark_started(leases)

    def renew(self, leases) -> None:
        self.q.renew_many(leases)

    def complete(self, leases) -> int:
        now = int(time.time() * 1000)
        results = []
        for le in leases:
            self.n += 1
            results.append(result_fields(self.n, self.n, le.member, now))
        comp = self.q.complete_with_results(leases, results, self.stream)
        entries = [f for f, c in zip(results, comp.codes) if c == 1]
        outcomes = {"alive": sum(1 for e in entries if e["alive"] == "1"),
                    "dead": sum(1 for e in entries if e["alive"] != "1"),
                    "lease_lost": 0, "aborted": 0, "malformed": 0, "retried": 0}
        counters.record_check_batch(self.r, self.prefix, outcomes, 0, [])
        return len(entries)

    def timings(self, leases) -> None:
        from magpie.pipeline.checkpool import StartTiming

        now = time.time() * 1000
        counters.record_start_timings(self.r, self.prefix, [StartTiming(now - 5, now - 4, now - 3, now - 2, now,
                                                                         now - 10) for _ in leases])


def run_cycles(path: CheckPath, cycles: int, split: bool = False) -> tuple[int, dict[str, int]]:
    """Run ``cycles`` route cycles; with ``split``, command usec per step from snapshots around each."""
    steps = {"claim": 0, "mark": 0, "renew": 0, "complete": 0, "metrics": 0}
    r = path.r
    done = 0
    snap = cmd_usec(r) if split else None

    def step(name, fn, *args):
        nonlocal snap
        out = fn(*args)
        if split:
            per = usec_delta(snap, cmd_usec(r))[1]
            if name == "metrics":  # plain commands, no script
                steps[name] += sum(us for k, (_, us) in per.items() if k != "evalsha")
            else:  # one script per call: its time holds the commands it called (counted apart too)
                steps[name] += per.get("evalsha", (0, 0))[1]
            snap = cmd_usec(r)
        return out

    while done < cycles:
        leases = step("claim", path.claim)
        if not leases:
            continue
        step("mark", path.mark, leases)
        step("renew", path.renew, leases)
        step("metrics", path.timings, leases)
        path.pending.extend(leases)
        while len(path.pending) >= path.complete_batch:
            chunk, path.pending = path.pending[:path.complete_batch], path.pending[path.complete_batch:]
            done += step("complete", path.complete, chunk)
    if path.pending:
        done += path.complete(path.pending)
        path.pending = []
    return done, steps


def run_baseline(r: redis.Redis, prefix: str, cycles: int, complete_batch: int) -> int:
    """The same data movement with no script and no fencing, pipelined, same batch sizes."""
    k = QueueKeys(prefix, SHARDS)
    shards = k.all_shards()
    skey = stream_key(prefix) + ":baseline"
    done, i, n = 0, 0, 0
    while done < cycles:
        shard = shards[i % len(shards)]
        i += 1
        now = int(time.time() * 1000)
        rows = r.zrange(shard, "-inf", now, byscore=True, offset=0, num=POP_BATCH, withscores=True)
        if not rows:
            continue
        members = [m for m, _ in rows]
        p = r.pipeline(transaction=False)
        p.mget([k.payload_prefix + m.decode() for m in members])
        p.zadd(shard, {m: now + 300_000.5 for m in members})
        p.execute()
        for off in range(0, len(members), complete_batch):
            chunk = members[off: off + complete_batch]
            p = r.pipeline(transaction=False)
            p.zadd(shard, {m: now + 1 for m in chunk})
            for m in chunk:
                n += 1
                p.xadd(skey, result_fields(n, n, m.decode(), now), maxlen=1_000_000, approximate=True)
            p.execute()
        done += len(members)
    r.delete(skey)
    return done


def redis_phase(a, srv: PrivateRedis) -> None:
    r = srv.client
    prefix = f"magpie-sizing:{uuid.uuid4().hex[:8]}:"
    path = CheckPath(r, prefix, a.complete_batch)
    ensure_group(r, prefix)
    mem0 = int(r.info("memory")["used_memory"])
    for off in range(0, a.routes, 10_000):
        path.q.schedule((payload_for(i) for i in range(off, min(off + 10_000, a.routes))), total=a.routes,
                        start_index=off, batch=500)
    mem_import = int(r.info("memory")["used_memory"])
    run_cycles(path, min(a.routes, 20_000))  # warm-up: scripts loaded, priority lane drained
    skey = stream_key(prefix)
    r.xtrim(skey, maxlen=0)

    c0, m0 = cpu(r)
    u0 = cmd_usec(r)
    t0, p0 = time.perf_counter(), time.process_time()
    done, _ = run_cycles(path, a.cycles)
    wall, client = time.perf_counter() - t0, time.process_time() - p0
    c1, m1 = cpu(r)
    _, per_cmd = usec_delta(u0, cmd_usec(r))
    us_cycle = (c1 - c0) / done * 1e6
    us_main = (m1 - m0) / done * 1e6
    figure("redis_cycles", done, "route cycles", f"{wall:.1f} s wall, {done / wall:,.0f} cycles/s from one client")
    figure("redis_cpu_us_per_cycle", us_cycle, "us", "INFO cpu user+sys delta / cycles (whole process)")
    figure("redis_main_thread_cpu_us_per_cycle", us_main, "us", "the one core a master uses")
    for name, (calls, us) in sorted(per_cmd.items(), key=lambda kv: -kv[1][1]):
        if us / done >= 0.05:  # commands called by scripts count here and inside evalsha
            figure(f"redis_cmd_{re.sub(r'[^a-z0-9]+', '_', name)}_us_per_cycle", us / done, "us",
                   f"{calls / done:.3f} calls/cycle, {us / max(calls, 1):.1f} us/call")
    figure("redis_client_cpu_us_per_cycle", client / done * 1e6, "us", "the check path's own CPU for these calls")

    # memory: the routes as they stand after cycling (payload, shard member, cadence/stall state)
    xlen = int(r.xlen(skey))
    stream_bytes = int(r.memory_usage(skey, samples=0) or 0)
    mem_now = int(r.info("memory")["used_memory"])
    figure("redis_bytes_per_route", (mem_now - stream_bytes - mem0) / a.routes, "bytes",
           f"used_memory delta over {a.routes} routes, results stream excluded")
    figure("redis_bytes_per_route_after_import", (mem_import - mem0) / a.routes, "bytes",
           "right after import (priority-lane entries included)")
    figure("redis_stream_bytes_per_entry", stream_bytes / max(xlen, 1), "bytes",
           f"results stream, {xlen} unconsumed entries (MEMORY USAGE)")

    # split by step: command usec only, snapshots around each step
    split_n = max(POP_BATCH * 10, a.cycles // 4)
    sdone, steps = run_cycles(path, split_n, split=True)
    inside = sum(steps.values())
    # commandstats usec is time inside commands (wall clock, inflated on a busy machine): only the steps'
    # shares are used, applied to the CPU figure of the clean pass
    for name, us in steps.items():
        share = us / max(inside, 1)
        figure(f"redis_step_{name}_cpu_us_per_cycle", us_cycle * share, "us",
               f"{100 * share:.0f} % of the command time ({us / sdone:.1f} us inside commands)")
    share = steps["renew"] / max(inside, 1)
    figure("redis_cpu_us_per_cycle_no_renewal", us_cycle * (1 - share), "us",
           "derived: a check shorter than lease - renew_below (180 s by default) never renews")
    r.xtrim(skey, maxlen=0)

    # baseline: the same movement, no scripts
    bprefix = prefix + "base:"
    bq = RouteQueue(r, QueueKeys(bprefix, SHARDS), interval_ms=1, lease_ms=300_000)
    for off in range(0, a.routes, 10_000):
        bq.schedule((payload_for(i) for i in range(off, min(off + 10_000, a.routes))), total=a.routes,
                    start_index=off, batch=500)
    run_baseline(r, bprefix, min(a.routes, 20_000), a.complete_batch)
    c0, _ = cpu(r)
    bdone = run_baseline(r, bprefix, a.cycles, a.complete_batch)
    c1, _ = cpu(r)
    base_us = (c1 - c0) / bdone * 1e6
    figure("redis_baseline_cpu_us_per_cycle", base_us, "us",
           "ZRANGEBYSCORE+MGET+ZADD lease+ZADD due+XADD, pipelined, no scripts")
    figure("redis_ratio_cycle_to_baseline", us_cycle / base_us, "x", "CPU per route cycle, ours / baseline")
    for pfx in (prefix,):
        keys = list(r.scan_iter(match=f"*{pfx}*", count=10_000))
        for i in range(0, len(keys), 10_000):
            r.delete(*keys[i: i + 10_000])


# -------------------------------------------------------------------------------------------- PostgreSQL


def proc_cpu(pid: int) -> float:
    """CPU seconds (utime + stime) of process ``pid`` from ``/proc/<pid>/stat``; NaN when the process is not
    on this machine (a remote PostgreSQL)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_REL = re.compile(r"rel \d+/(\d+)/\d+")
_TX = re.compile(r"tx:\s+(\d+)")
_TOT = re.compile(r"len \(rec/tot\):\s*(\d+)/\s*(\d+)")


def wal_of_database(pg_wal: str, start: str, end: str, dboid: int) -> tuple[int, int] | None:
    """``(bytes, full-page-image bytes)`` of the WAL between LSNs ``start`` and ``end`` that belongs to
    database ``dboid``: records touching its relations plus the other records (commits) of the
    transactions that did; image bytes are ``tot - rec`` of records carrying a full-page write. None when
    ``pg_waldump`` or the WAL directory is not available."""
    exe = shutil.which("pg_waldump") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_waldump"))[-1:]),
                                             None)
    if exe is None or not os.access(pg_wal, os.R_OK):
        return None
    proc = subprocess.Popen([exe, "-p", pg_wal, "-s", start, "-e", end], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    mine, fpi, ours_tx, other_tx = 0, 0, set(), {}
    db = str(dboid)
    for line in proc.stdout:
        tot = _TOT.search(line)
        if not tot:
            continue
        n = int(tot.group(2))
        tx = _TX.search(line)
        xid = tx.group(1) if tx else "0"
        rels = _REL.findall(line)
        if db in rels:
            mine += n
            if "FPW" in line:
                fpi += n - int(tot.group(1))
            if xid != "0":
                ours_tx.add(xid)
        elif xid != "0" and not rels:
            other_tx[xid] = other_tx.get(xid, 0) + n  # commit records and the like: counted if ours
    proc.wait()
    if proc.returncode not in (0, 1) or mine == 0:  # 0: the range's segments were gone
        return None
    return mine + sum(n for x, n in other_tx.items() if x in ours_tx), fpi


def history_bytes(conn, table: str = "check_history") -> int:
    """Total bytes (heap, TOAST, indexes) of ``table`` and all its partitions."""
    return int(conn.exec_driver_sql(
        "SELECT greatest(pg_total_relation_size(%s::regclass), (SELECT coalesce(sum(pg_total_relation_size(relid)), 0) "
        "FROM pg_partition_tree(%s::regclass)))", (table, table)).scalar())


def pg_phase(a, srv: PrivateRedis) -> None:
    name = f"magpie_sizing_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = ADMIN.rsplit("/", 1)[0] + "/" + name
    engine = sa.create_engine(url, pool_size=1, max_overflow=0)
    r = srv.client
    prefix = f"magpie-sizing-pg:{uuid.uuid4().hex[:8]}:"
    holder = None
    try:
        from magpie.db.migrate import upgrade

        upgrade(url)
        with engine.begin() as c:
            c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('sizing')"))
            c.execute(sa.text("""
                INSERT INTO routes (route_hash, protocol, host, port)
                SELECT lpad(to_hex(g), 24, '0'), 'socks5',
                       '10.' || (g >> 16 & 255) || '.' || (g >> 8 & 255) || '.' || (g & 255), 1080
                FROM generate_series(1, :n) g"""), {"n": a.pg_routes})
            c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) SELECT id, 1 FROM routes"))
            ids = c.execute(sa.text("SELECT id, route_hash FROM routes ORDER BY id")).all()
            dboid = int(c.execute(sa.text("SELECT oid FROM pg_database WHERE datname = current_database()")).scalar())
            pg_wal = os.path.join(c.execute(sa.text("SHOW data_directory")).scalar(), "pg_wal")
        ensure_group(r, prefix)
        skey = stream_key(prefix)
        n = 0

        def publish(count: int) -> None:
            nonlocal n
            base = int(time.time() * 1000) - 86_400_000
            for off in range(0, count, 1000):
                p = r.pipeline(transaction=False)
                for _ in range(min(1000, count - off)):
                    rid, h = ids[n % len(ids)]
                    p.xadd(skey, result_fields(n, rid, h, base + n))
                    n += 1
                p.execute()

        def drain(consumer: str) -> int:
            got = 0
            while True:
                rep = ingest(r, engine, prefix, consumer, batch=STATS_BATCH)
                if rep.infra_error:
                    raise SystemExit(f"ingestion failed: {rep.infra_error}")
                got += rep.committed
                if rep.read == 0:
                    return got

        publish(len(ids))  # warm-up: every route gets its route_health row; plans cached
        drain("sizing-1")
        # a temporary physical slot keeps the measured WAL until pg_waldump has read it (a checkpoint by
        # another user of the server would recycle the segments); it goes away with this connection
        holder = admin.connect()
        try:
            holder.exec_driver_sql("SELECT pg_create_physical_replication_slot(%s, true, true)", (name,))
        except sa.exc.DBAPIError as exc:
            print(f"note: no replication slot ({str(exc.orig).strip()[:80]}); WAL may be recycled", file=sys.stderr)
        with engine.connect() as c:
            pid = int(c.exec_driver_sql("SELECT pg_backend_pid()").scalar())
            rows0 = int(c.exec_driver_sql("SELECT count(*) FROM check_history").scalar())
            h0, l0 = history_bytes(c), history_bytes(c, "stats_ledger")
            hr0 = int(c.exec_driver_sql("SELECT pg_total_relation_size('route_health')").scalar())
            lsn0 = c.exec_driver_sql("SELECT pg_current_wal_lsn()").scalar()
        publish(a.results)
        b0, p0, (rc0, _), t0 = proc_cpu(pid), time.process_time(), cpu(r), time.perf_counter()
        got = drain("sizing-1")
        b1, p1, (rc1, _), wall = proc_cpu(pid), time.process_time(), cpu(r), time.perf_counter() - t0
        with engine.connect() as c:
            if int(c.exec_driver_sql("SELECT pg_backend_pid()").scalar()) != pid:
                print("warning: the ingestion connection changed backend; backend CPU is partial", file=sys.stderr)
            lsn1 = c.exec_driver_sql("SELECT pg_current_wal_lsn()").scalar()
            wal_lsn = int(c.exec_driver_sql("SELECT pg_wal_lsn_diff(%s, %s)", (lsn1, lsn0)).scalar())
            rows1 = int(c.exec_driver_sql("SELECT count(*) FROM check_history").scalar())
            h1, l1 = history_bytes(c), history_bytes(c, "stats_ledger")
            hr1 = int(c.exec_driver_sql("SELECT pg_total_relation_size('route_health')").scalar())
        wal_db = wal_of_database(pg_wal, lsn0, lsn1, dboid)
        rows = rows1 - rows0
        figure("pg_results", got, "results", f"{wall:.1f} s wall, {got / wall:,.0f} results/s from one consumer")
        backend_us = (b1 - b0) / got * 1e6
        figure("pg_backend_cpu_us_per_result", backend_us, "us", "utime+stime of the ingestion's backend")
        figure("pg_client_cpu_us_per_result", (p1 - p0) / got * 1e6, "us", "the ingestion process itself")
        figure("pg_consumer_redis_cpu_us_per_result", (rc1 - rc0) / got * 1e6, "us",
               "Redis CPU of the consumer's reads, acks and latency counters")
        if wal_db is not None:
            figure("pg_wal_bytes_per_result", wal_db[0] / got, "bytes", "pg_waldump, this database's records only")
            figure("pg_wal_fpi_bytes_per_result", wal_db[1] / got, "bytes",
                   "of which full-page images (depend on checkpoint spacing)")
        figure("pg_wal_bytes_per_result_lsn", wal_lsn / got, "bytes",
               "pg_current_wal_lsn() diff, includes the shared server's other traffic")
        figure("pg_check_history_bytes_per_row", (h1 - h0) / max(rows, 1), "bytes",
               f"pg_total_relation_size over partitions, {rows} rows (heap + indexes)")
        figure("pg_stats_ledger_bytes_per_row", (l1 - l0) / max(rows, 1), "bytes", "until retired below the replay floor")
        figure("pg_route_health_bytes_per_route", hr1 / len(ids), "bytes", f"{len(ids)} routes after updates")

        # baseline: a bare INSERT of the same rows, 500 per transaction
        with engine.begin() as c:
            c.exec_driver_sql("CREATE TABLE sizing_bare (route_id bigint, checked_at timestamptz, alive boolean, "
                              "latency_ms real, status integer, attempts smallint, error text, anonymity text, "
                              "body text, judge text, stream_id text, exit_ip text)")
        src = [result_fields(i, ids[i % len(ids)][0], ids[i % len(ids)][1], 1_764_000_000_000 + i)
               for i in range(a.results)]
        bare = """INSERT INTO sizing_bare SELECT * FROM unnest(%s::bigint[], %s::timestamptz[], %s::boolean[],
                  %s::real[], %s::integer[], %s::smallint[], %s::text[], %s::text[], %s::text[], %s::text[],
                  %s::text[], %s::text[])"""
        with engine.connect() as c:
            lsn0 = c.exec_driver_sql("SELECT pg_current_wal_lsn()").scalar()
        b0 = proc_cpu(pid)
        for off in range(0, len(src), STATS_BATCH):
            chunk = src[off: off + STATS_BATCH]
            cols = ([int(f["route_id"]) for f in chunk],
                    [datetime.fromtimestamp(int(f["checked_at_ms"]) / 1000, UTC) for f in chunk],
                    [f["alive"] == "1" for f in chunk],
                    [float(f["latency_ms"]) if f["latency_ms"] else None for f in chunk],
                    [int(f["status"]) if f["status"] else None for f in chunk],
                    [int(f["attempts"]) for f in chunk],
                    *([f[k] or None for f in chunk] for k in ("error", "anonymity", "body", "judge")),
                    [f"{off + j}-0" for j in range(len(chunk))],
                    [f.get("exit_ip") for f in chunk])
            with engine.begin() as c:
                c.exec_driver_sql(bare, cols)
        b1 = proc_cpu(pid)
        with engine.connect() as c:
            lsn1 = c.exec_driver_sql("SELECT pg_current_wal_lsn()").scalar()
            bare_bytes = int(c.exec_driver_sql("SELECT pg_total_relation_size('sizing_bare')").scalar())
        bare_wal = wal_of_database(pg_wal, lsn0, lsn1, dboid)
        bare_us = (b1 - b0) / len(src) * 1e6
        figure("pg_baseline_backend_cpu_us_per_row", bare_us, "us", "bare INSERT of the same rows, 500 per transaction")
        figure("pg_ratio_backend_cpu_to_baseline", backend_us / max(bare_us, 1e-9), "x")
        if wal_db is not None and bare_wal:
            figure("pg_baseline_wal_bytes_per_row", bare_wal[0] / len(src), "bytes")
            figure("pg_ratio_wal_to_baseline", (wal_db[0] / got) / (bare_wal[0] / len(src)), "x")
        figure("pg_baseline_bytes_per_row", bare_bytes / len(src), "bytes", "heap only, no index")
        figure("pg_ratio_history_bytes_to_baseline", ((h1 - h0) / max(rows, 1)) / (bare_bytes / len(src)), "x")
    finally:
        if holder is not None:
            holder.close()
        engine.dispose()
        keys = list(r.scan_iter(match=f"*{prefix}*", count=10_000))
        if keys:
            r.delete(*keys)
        with admin.connect() as c:
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
        admin.dispose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=200_000, help="route cycles measured on Redis")
    ap.add_argument("--routes", type=int, default=100_000, help="routes in the Redis schedule")
    ap.add_argument("--complete-batch", type=int, default=128, help="leases per complete.lua call (<= 500)")
    ap.add_argument("--results", type=int, default=50_000, help="results ingested into PostgreSQL")
    ap.add_argument("--pg-routes", type=int, default=20_000, help="routes in the PostgreSQL database")
    ap.add_argument("--no-aof", action="store_true", help="run the private Redis without AOF")
    ap.add_argument("--skip-redis", action="store_true")
    ap.add_argument("--skip-pg", action="store_true")
    a = ap.parse_args()
    for name in ("cycles", "routes", "results", "pg_routes"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 1 <= a.complete_batch <= 500:
        ap.error("--complete-batch must be within 1..500")
    srv = PrivateRedis(aof=not a.no_aof)
    try:
        info = srv.client.info("server")
        figure("redis_version", info["redis_version"])
        figure("redis_aof", 0 if a.no_aof else 1)
        figure("pop_batch", POP_BATCH)
        figure("complete_batch", a.complete_batch)
        figure("payload_bytes", len(payload_for(12345)[1]))
        figure("mix_alive_pct", 100 - sum(s for e, s in MIX if e))
        if not a.skip_redis:
            redis_phase(a, srv)
        if not a.skip_pg:
            pg_phase(a, srv)
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
