"""Check engine benchmark: CPU per check of :class:`magpie.checker.engine.CheckEngine` alone, per route kind.

The pipeline's capacity on one node is CPU per check, and the engine is the largest part of a check
process's share. This script measures the engine without Celery, Redis or PostgreSQL: a child process runs
one engine on one uvloop event loop, keeps ``--concurrency`` checks in flight against the lab's fault
servers (a separate process, so their CPU is not counted) and reports the child's own CPU time (user +
system, every thread) per finished check, for each kind of route:

  tarpit-http / tarpit-socks5   the proxy's kernel completes the handshake, nothing ever answers: every
                                attempt runs to the deadline (2 attempts)
  refused                       connection refused: one attempt, final
  echo-http / echo-socks5       a live proxy (the lab's echo stand-in answers as proxy and judge)

On loopback the kernel's work for both ends of a connection (handshake, reset) runs in the checking
process's system calls, so ``sys_share`` (system time over CPU time) is partly the lab's: a remote proxy's
side of the handshake costs the checker nothing.

It runs the work tree's engine and, as the baseline in the same run, the engine of ``--baseline-ref``
(extracted with ``git archive``), alternating for ``--rounds`` rounds and keeping the lowest figure of
each (the shared machine's load swings; CPU time, not wall time, is compared). Printed: one
``engine_bench`` line per tree and kind (``cpu_us_per_check``, ``checks``) and one ``engine_ratio`` line
per kind (work tree / baseline).

    .venv/bin/python benchmarks/engine_bench.py [--baseline-ref HEAD] [--checks 6000] [--concurrency 2000]
        [--timeout 0.5] [--rounds 3]

Traffic stays on 127.0.0.0/8 (``MAGPIE_EGRESS_ONLY`` is set for the child).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
KINDS = ("tarpit-http", "tarpit-socks5", "refused", "echo-http", "echo-socks5")


def measure(args) -> None:
    """Child: check ``args.checks`` routes of ``args.kind`` with ``args.concurrency`` in flight; print JSON."""
    import asyncio

    from magpie.checker.check import new_event_loop
    from magpie.checker.engine import CheckEngine

    try:  # the package layout of the tree measured (a baseline may predate magpie.base)
        from magpie.base.egress import EgressPolicy
        from magpie.base.routes import Route
    except ImportError:
        from magpie.egress import EgressPolicy
        from magpie.routes import Route

    addrs = json.loads(args.lab)
    kind, _, proto = args.kind.partition("-")
    proto = proto or "http"
    targets = addrs["tarpits"] if kind == "tarpit" else [addrs[kind]]
    routes = []
    for i in range(args.checks):
        host, port = targets[i % len(targets)].rsplit(":", 1)
        routes.append(Route(proto, host, int(port), f"u{i}" if proto == "socks5" else None,
                            "p" if proto == "socks5" else None))
    engine = CheckEngine(args.judge, args.timeout, 2, 2048, own_addresses={"127.0.0.1"},
                         egress=EgressPolicy("127.0.0.0/8", "MAGPIE_CHECK_ALLOW_PRIVATE"))

    async def run() -> dict:
        sem = asyncio.Semaphore(args.concurrency)
        alive = 0

        async def one(r: Route) -> None:
            nonlocal alive
            async with sem:
                res = await engine.check(r)
                alive += res.alive

        await asyncio.gather(*(one(r) for r in routes[: min(200, len(routes))]))  # warm-up, not counted
        t0, w0 = os.times(), time.perf_counter()
        alive = 0
        await asyncio.gather(*(one(r) for r in routes))
        t1, wall = os.times(), time.perf_counter() - w0
        user, system = t1.user - t0.user, t1.system - t0.system
        return {"cpu_us_per_check": (user + system) / len(routes) * 1e6, "checks": len(routes),
                "alive": alive, "wall_s": wall, "sys_share": system / max(user + system, 1e-9)}

    loop = new_event_loop()
    try:
        print(json.dumps(loop.run_until_complete(run())), flush=True)
    finally:
        loop.close()


def run_child(tree: Path, kind: str, lab: dict, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "MAGPIE_EGRESS_ONLY": "127.0.0.0/8,::1"}
    p = subprocess.run([PY, str(Path(__file__).resolve()), "--measure", "--kind", kind, "--lab", json.dumps(lab),
                        "--judge", args.judge, "--checks", str(args.checks), "--concurrency",
                        str(args.concurrency), "--timeout", str(args.timeout)],
                       env=env, cwd=tree, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"engine_bench child failed ({tree}, {kind}): {p.stderr.strip()[-800:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lab", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--judge", default="http://127.0.0.1:8899/", help=argparse.SUPPRESS)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"route kinds to measure (default: all of {KINDS})")
    ap.add_argument("--baseline-ref", default="HEAD", help="git ref of the baseline engine (default HEAD)")
    ap.add_argument("--checks", type=int, default=6000, help="checks per kind and round (default 6000)")
    ap.add_argument("--concurrency", type=int, default=2000, help="checks in flight (default 2000)")
    ap.add_argument("--timeout", type=float, default=0.5, help="seconds per attempt (default 0.5)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per tree (default 3)")
    args = ap.parse_args(argv)
    if args.measure:
        measure(args)
        return 0
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if bad := [k for k in kinds if k not in KINDS]:
        ap.error(f"unknown kind(s): {', '.join(bad)}")

    from pipeline_bench import extract_ref  # the pipeline benchmark's git archive of a ref

    base, sha = extract_ref(args.baseline_ref, "engine-bench-")
    lab_proc = subprocess.Popen(
        [PY, "-m", "magpie.lab.faults", "--host-base", "127.0.0.60", "--tarpit-ports", "8",
         "--judge-port", "8899"], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "MAGPIE_EGRESS_ONLY": "127.0.0.0/8,::1"})
    try:
        lab = json.loads(lab_proc.stdout.readline())
        print(f"# engine_bench checks={args.checks} concurrency={args.concurrency} timeout_s={args.timeout} "
              f"attempts=2 rounds={args.rounds} baseline={args.baseline_ref} ({sha[:10]}) cores={os.cpu_count()}")
        best: dict[tuple[str, str], dict] = {}
        for _ in range(args.rounds):
            for kind in kinds:
                for name, tree in (("baseline", base), ("tree", ROOT)):
                    fig = run_child(tree, kind, lab, args)
                    key = (name, kind)
                    if key not in best or fig["cpu_us_per_check"] < best[key]["cpu_us_per_check"]:
                        best[key] = fig
        for kind in kinds:
            for name in ("tree", "baseline"):
                f = best[(name, kind)]
                print(f"engine_bench tree={name} kind={kind} cpu_us_per_check={f['cpu_us_per_check']:.1f} "
                      f"sys_share={f['sys_share']:.2f} checks={f['checks']} alive={f['alive']} wall_s={f['wall_s']:.2f}")
            ratio = best[("tree", kind)]["cpu_us_per_check"] / best[("baseline", kind)]["cpu_us_per_check"]
            print(f"engine_ratio kind={kind} cpu_per_check_tree_over_baseline={ratio:.2f}")
    finally:
        lab_proc.terminate()
        try:
            lab_proc.wait(10)
        except subprocess.TimeoutExpired:
            lab_proc.kill()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
