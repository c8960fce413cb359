"""Hand-off benchmark: how fast leases get from a check message into the engine's free slots.

A check process receives messages of many leases (``routes_per_task``, default 250) on its Celery thread and
hands them to the check pool (:meth:`magpie.pipeline.checkpool.CheckPool.submit`); the pool's event loop starts them
as slots free. This script measures that hand-off alone, against real Redis, with a stand-in engine whose
check holds its slot for ``--hold`` seconds (a dead proxy costs a whole timeout; no network is used) after
burning ``--cpu-us`` of CPU on the event loop (a real check's connect, parse and grading), so the figures
are the pool's own: completions, renewals and start marks all run as in production.

One "Celery thread" submits messages back to back, as promote would, never holding more leases out than
the pool has slots, while ``--capacity`` slots turn over. It runs the work
tree's pool and, as the baseline in the same run, the pool of ``--baseline-ref`` (default: the commit before
the inbox hand-off), loaded from ``git show`` into a module of its own.

Printed per pool: leases started/s, the mean of checks in flight over the run (against the capacity), submit
call time p50/p99/max (the Celery thread's wait), and claim-to-start p50/p99 (the time from a lease's claim to
its check's start); then the ratios work tree / baseline.

    .venv/bin/python benchmarks/handoff_bench.py [--capacity 10000] [--hold 2.0] [--seconds 20]
        [--per-task 250] [--cpu-us 250] [--baseline-ref 7adb9e4]

Uses ``MAGPIE_REDIS_URL`` with its own key prefix and deletes every key it wrote at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import redis

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from magpie.checker import CheckResult  # noqa: E402
from magpie.queue import Payload, QueueKeys, RouteQueue  # noqa: E402
from magpie.queue.completion import StreamTarget  # noqa: E402
from magpie.base.routes import Route  # noqa: E402


class HoldEngine:
    """Stand-in engine: every check holds its slot ``hold`` seconds, then answers dead (a tarpit)."""

    judge_url = "http://judge.invalid/"
    attempts = 1

    def __init__(self, hold: float, cpu_us: float = 0.0):
        self.hold = hold
        self.cpu_s = cpu_us / 1e6
        self.max_check_seconds = hold + 1.0
        self.running = 0
        self.samples: list[int] = []

    async def check(self, route, before_attempt=None):
        self.running += 1
        spin = time.perf_counter() + self.cpu_s  # the loop's own work per check (connect, parse, grade)
        while time.perf_counter() < spin:
            pass
        try:
            await asyncio.sleep(self.hold)
        finally:
            self.running -= 1
        return CheckResult(False, None, None, 1, "ReadTimeout", None, None, self.judge_url, int(time.time() * 1000))

    async def check_payload(self, payload, before_attempt=None):
        return await self.check(payload.route, before_attempt)

    async def judge_reachable(self, max_age=2.0):
        return True


def load_baseline(ref: str):
    """The ``magpie.pipeline.checkpool`` module of git ``ref``, imported under a name of its own."""
    text = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:magpie/pipeline/checkpool.py"], check=True,
                          capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="handoff-"), "checkpool_baseline.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("magpie_checkpool_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def seed(q: RouteQueue, n: int) -> None:
    items = []
    for i in range(n):
        h = f"{i:024x}"
        items.append((h, Payload(i + 1, Route("http", "127.0.0.1", 1 + i % 60000), h, [1]).encode()))
    for i in range(0, n, 5000):
        q.schedule(items[i:i + 5000])
    pipe = q.r.pipeline(transaction=False)
    for h, _ in items:  # all due long ago, in import order
        pipe.zadd(q.keys.shard_of(h), {h: 1000 + int(h, 16)})
    for shard in q.keys.all_shards():
        pipe.zadd(q.keys.heads, {shard: 1000})
    pipe.execute()


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


def run(name: str, pool_cls, args, client: redis.Redis) -> dict:
    prefix = f"handoff-bench:{uuid.uuid4().hex[:8]}:"
    q = RouteQueue(client, QueueKeys(prefix, 16), interval_ms=3_600_000, lease_ms=300_000)
    total = int(args.capacity / args.hold * args.seconds * 1.3) + args.capacity * 2
    seed(q, total)
    engine = HoldEngine(args.hold, args.cpu_us)
    kw = dict(capacity=args.capacity, renew_below_ms=60_000, complete_interval=0.1)
    pool = pool_cls(q, engine, StreamTarget(prefix + "results", "g", 1_000_000, "evict_oldest"), **kw).start()
    submits: list[float] = []
    claim_to_start: list[float] = []
    started_at: dict[str, float] = {}
    stop = threading.Event()

    orig_run = pool._run

    async def timed_run(slot, _orig=orig_run):  # the check's start, on the pool's loop
        le = slot.lease
        claimed = started_at.get(le.member)
        if claimed is not None:
            claim_to_start.append(time.time() - claimed)
        return await _orig(slot)

    pool._run = timed_run

    def celery_thread():
        while not stop.is_set():
            st = pool.stats()  # promote's cap: leases out never exceed the engines' slots
            room = args.capacity - st.running - st.pending
            if room < args.per_task:
                time.sleep(0.005)
                continue
            leases = q.pop(args.per_task)
            if not leases:
                return
            now = time.time()
            for le in leases:
                started_at[le.member] = now
            t0 = time.perf_counter()
            pool.submit(leases)
            submits.append(time.perf_counter() - t0)

    lags: list[float] = []

    async def monitor():  # how late the pool's loop runs a 50 ms timer
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(0.05)
            lags.append(loop.time() - t - 0.05)

    asyncio.run_coroutine_threadsafe(monitor(), pool._loop.loop)
    th = threading.Thread(target=celery_thread, daemon=True)
    cpu0 = time.process_time()
    inflight: list[int] = []
    t0 = time.monotonic()
    th.start()
    while time.monotonic() - t0 < args.seconds:
        time.sleep(0.1)
        inflight.append(engine.running)
    stop.set()
    elapsed = time.monotonic() - t0
    cpu = time.process_time() - cpu0
    started = len(claim_to_start)
    th.join(60)
    pool.close(30)
    keys = list(client.scan_iter(match=prefix + "*", count=5000))
    keys += list(client.scan_iter(match="{" + prefix + "*", count=5000))
    for i in range(0, len(keys), 1000):
        client.delete(*keys[i:i + 1000])
    res = {
        "started_per_s": started / elapsed,
        "cpu_us_per_start": cpu / max(1, started) * 1e6,
        "mean_inflight": statistics.fmean(inflight[len(inflight) // 4:]) if inflight else 0.0,
        "submit_p50_ms": pct(submits, 50) * 1000, "submit_p99_ms": pct(submits, 99) * 1000,
        "submit_max_ms": max(submits, default=0.0) * 1000,
        "c2s_p50_s": pct(claim_to_start, 50), "c2s_p99_s": pct(claim_to_start, 99),
        "loop_lag_p50_ms": pct(lags, 50) * 1000, "loop_lag_p99_ms": pct(lags, 99) * 1000,
    }
    print(f"handoff pool={name} capacity={args.capacity} hold_s={args.hold:g} per_task={args.per_task} "
          + " ".join(f"{k}={v:.3f}" for k, v in res.items()), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=int, default=10_000)
    ap.add_argument("--hold", type=float, default=2.0, help="seconds a check holds its slot")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--per-task", type=int, default=250)
    ap.add_argument("--cpu-us", type=float, default=250.0,
                    help="CPU the stand-in check burns on the event loop per check (µs), as a real one does")
    ap.add_argument("--baseline-ref", default="7adb9e4")
    args = ap.parse_args()
    client = redis.Redis.from_url(os.environ.get("MAGPIE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    from magpie.pipeline.checkpool import CheckPool

    ideal = args.capacity / args.hold
    print(f"# ideal started/s = capacity / hold = {ideal:.0f}", flush=True)
    base = run(f"baseline@{args.baseline_ref}", load_baseline(args.baseline_ref).CheckPool, args, client)
    new = run("worktree", CheckPool, args, client)
    print("handoff-ratio " + " ".join(
        f"{k}={new[k] / base[k]:.2f}" for k in ("started_per_s", "mean_inflight", "submit_p99_ms", "c2s_p99_s")
        if base[k]) + f" started_vs_ideal_worktree={new['started_per_s'] / ideal:.2f} "
        f"started_vs_ideal_baseline={base['started_per_s'] / ideal:.2f}", flush=True)


if __name__ == "__main__":
    main()
