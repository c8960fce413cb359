"""CPU per check of the check path with judge pools and profiles on, against the plain engine, same run.

The pipeline benchmark's figures on a shared machine move by more than the difference asked about, so
this one isolates the check path: one process runs the same checks through

  plain     ``CheckEngine`` (one judge, ``MAGPIE_JUDGE_URL``), the way the check pool used it before;
  profiles  ``ProfiledEngine`` with a two-judge pool and a workspace profile on every route (plan lookup,
            round robin, per-owner attribution; the failure probe path included),

against a judge and the lab's fault servers in their own processes (their CPU is not counted), alternating
the two paths (and their order) for ``--rounds`` rounds per population and reporting the median CPU
microseconds per check (``time.process_time`` of this process) and the ratio. The ``overhead-bench`` line
is the profiled path's own work per check without the network (both paths over an engine that answers at
once), the figure least disturbed by a busy machine. It also times the ingestion side: applying a
batch of results with failure tracking (``route_failures``) against the same batch's history and health
writes, in a private PostgreSQL database.

    .venv/bin/python benchmarks/profiles_bench.py [--checks 3000] [--rounds 5] [--concurrency 500]

Prints one ``profiles-bench`` line per population and one ``ingest-bench`` line. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import sqlalchemy as sa  # noqa: E402

os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only
from magpie.checker.check import new_event_loop  # noqa: E402
from magpie.checker.engine import CheckEngine  # noqa: E402
from magpie.config import load_settings  # noqa: E402
from magpie.base.egress import EgressPolicy  # noqa: E402
from magpie.judges.cache import ConfigCache  # noqa: E402
from magpie.judges.checking import ProfiledEngine  # noqa: E402
from magpie.judges.store import JudgeInfo, Profile, Snapshot  # noqa: E402
from magpie.queue import Payload  # noqa: E402
from magpie.base.routes import Route  # noqa: E402

PG_ADMIN = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"


def start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)


async def run_checks(check, items, concurrency: int) -> float:
    """CPU seconds of this process while ``check`` runs over ``items``."""
    it = iter(items)

    async def lane():
        for item in it:
            await check(item)

    t0 = time.process_time()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return time.process_time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checks", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=500)
    ap.add_argument("--ingest-batch", type=int, default=500)
    args = ap.parse_args(argv)

    judge = start(["-c", "from magpie.checker.judge import run_judge; run_judge('127.0.0.1', 0)"])
    url = re.search(r"(http://\S+/)", judge.stdout.readline()).group(1)
    faults = start(["-m", "magpie.lab.faults", "--host-base", "127.0.0.120", "--judge-port", url.rsplit(":", 1)[1][:-1]])
    lab = json.loads(faults.stdout.readline())
    try:
        settings = load_settings(judge_url=url, check_allow_private="127.0.0.0/8")
        c = settings.checks
        plain = CheckEngine(url, c.timeout, c.attempts, c.body_cap, connect_timeout=c.connect_timeout,
                            egress=EgressPolicy("127.0.0.0/8", "MAGPIE_CHECK_ALLOW_PRIVATE"))
        cache = ConfigCache(None)
        cache.snapshot = Snapshot(1, judges=(JudgeInfo(1, url, "http"), JudgeInfo(2, url + "?pool=2", "http")),
                                  profiles={1: Profile(1, timeout=c.timeout, attempts=c.attempts)})
        profiled = ProfiledEngine(settings, cache)

        async def plain_check(p):
            res = await plain.check(p.route)
            if not res.alive:
                await plain.judge_reachable()

        async def profiled_check(p):
            await profiled.check_payload(p)

        loop = new_event_loop()
        print(f"# profiles_bench checks={args.checks} rounds={args.rounds} concurrency={args.concurrency} "
              f"judge={url} lab={lab.get('echo')},{lab.get('refused')}", flush=True)
        for kind in ("echo", "refused"):
            host, port = lab[kind].rsplit(":", 1)
            items = [Payload(i + 1, Route("http", host, int(port), f"u{i}", "x"), f"{i:024x}", [1])
                     for i in range(args.checks)]
            loop.run_until_complete(run_checks(plain_check, items[:200], 50))  # warm both paths
            loop.run_until_complete(run_checks(profiled_check, items[:200], 50))
            per = {"plain": [], "profiles": []}
            paths = [("plain", plain_check), ("profiles", profiled_check)]
            for r in range(args.rounds):  # the order alternates: the second run of a round costs more
                for name, fn in (paths if r % 2 == 0 else paths[::-1]):
                    cpu = loop.run_until_complete(run_checks(fn, items, args.concurrency))
                    per[name].append(cpu / len(items) * 1e6)
            a, b = statistics.median(per["plain"]), statistics.median(per["profiles"])
            print(f"profiles-bench population={kind} plain_cpu_us_per_check={a:.1f} "
                  f"profiles_cpu_us_per_check={b:.1f} ratio={b / a:.3f} "
                  f"plain_rounds={'/'.join(f'{x:.0f}' for x in per['plain'])} "
                  f"profiles_rounds={'/'.join(f'{x:.0f}' for x in per['profiles'])}", flush=True)
        print(overhead(settings, url, loop, args.rounds), flush=True)
        loop.close()
        ingest(args.ingest_batch, args.rounds)
    finally:
        for p in (faults, judge):
            p.terminate()
            p.wait(10)
    return 0


def overhead(settings, url: str, loop, rounds: int, n: int = 20_000) -> str:
    """The profiled path's own CPU per check, without the network: both paths over an engine whose check
    returns a failed result at once (the judge probe cached), as an ``overhead-bench`` line."""
    async def instant(self, route, before_attempt=None):
        return CheckResult(False, None, None, 1, "ProxyError", None, None, self.judge_url, 0)

    from magpie.checker.result import CheckResult

    class Instant(CheckEngine):
        check = instant

    judges = (JudgeInfo(1, url, "http"), JudgeInfo(2, url + "?pool=2", "http"))
    cache = ConfigCache(None)
    cache.snapshot = Snapshot(1, judges=judges, profiles={1: Profile(1, timeout=10.0, attempts=2)})
    profiled = ProfiledEngine(settings, cache)
    plain = Instant(url, 10.0, 2)
    engines = [plain]
    for j in judges:
        key = (j.url, 10.0, 2, j.rule)
        profiled._engines[key] = Instant(j.url, 10.0, 2)
        engines.append(profiled._engines[key])
    for e in engines:
        e._probe_at, e._probe_ok = float("inf"), True  # the shared judge probe is fresh
    items = [Payload(i, Route("http", "127.0.0.1", 9), "h", [1]) for i in range(n)]

    async def plain_check(p):
        res = await plain.check(p.route)
        if not res.alive:
            await plain.judge_reachable()

    async def timed(fn):
        t0 = time.process_time()
        for p in items:
            await fn(p)
        return (time.process_time() - t0) / n * 1e6

    a = statistics.median(loop.run_until_complete(timed(plain_check)) for _ in range(rounds))
    b = statistics.median(loop.run_until_complete(timed(profiled.check_payload)) for _ in range(rounds))
    return (f"overhead-bench plain_us_per_check={a:.2f} profiles_us_per_check={b:.2f} "
            f"added_us_per_check={b - a:.2f} (no network: the path's own work)")


def ingest(batch: int, rounds: int) -> None:
    """Time ``apply_results`` of a batch whose entries carry per-owner outcomes (``wf``, a route checked
    differently for its owners) and, within it, the failure tracking; entries without ``wf`` (every owner
    checked alike, the default) add nothing."""
    from magpie.checker.result import CheckResult
    from magpie.db.migrate import upgrade
    from magpie.judges.failures import update_failures
    from magpie.stats.entry import entry_fields, parse_entry
    from magpie.stats.store import apply_results

    name = f"magpie_pfbench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN.rsplit("/", 1)[0] + "/" + name
    engine = sa.create_engine(url)
    try:
        upgrade(url)
        with engine.begin() as conn:
            ws = conn.execute(sa.text("INSERT INTO workspaces (name) VALUES ('b') RETURNING id")).scalar_one()
            conn.execute(sa.text("INSERT INTO routes (route_hash, protocol, host, port) "
                                 "SELECT lpad(to_hex(g), 24, '0'), 'http', '127.0.0.1', 9 FROM generate_series(1, :n) g"),
                         {"n": batch})
            conn.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) SELECT id, :w FROM routes"),
                         {"w": ws})
            ids = dict(conn.execute(sa.text("SELECT id, route_hash FROM routes")).all())
        totals, tracking = [], []
        for r in range(rounds):
            entries = []
            for i, (rid, h) in enumerate(sorted(ids.items())):
                res = CheckResult(i % 3 == 0, None, None, 1, None, None, None, "j", 1_700_000_000_000 + r * 10_000 + i)
                f = entry_fields(res, rid, h)
                f["wf"] = f"{ws}:{1 if res.alive else 0}"
                entries.append(parse_entry(f"{1_700_000_000_000 + r}-{i}", f))
            t0 = time.perf_counter()
            apply_results(engine, entries)
            totals.append(time.perf_counter() - t0)
            with engine.begin() as conn:  # the failure tracking alone, on the same batch
                t0 = time.perf_counter()
                update_failures(conn, entries)
                tracking.append(time.perf_counter() - t0)
        tot, trk = statistics.median(totals), statistics.median(tracking)
        print(f"ingest-bench batch={batch} apply_ms={tot * 1000:.1f} failure_tracking_ms={trk * 1000:.1f} "
              f"tracking_share={trk / tot:.3f}", flush=True)
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                         {"n": name})
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


if __name__ == "__main__":
    raise SystemExit(main())
