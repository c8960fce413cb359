"""One-shot benchmark: ``magpie check FILE`` on a large list of the real-world mix, against a baseline.

``magpie check`` checks a list once with no Redis or PostgreSQL, spread over forked processes each with its
own event loop. This script starts a judge and two fault labs on loopback (the pipeline benchmark's lab:
``magpie.lab.faults``, tarpits never accept), writes ``--routes`` lines of the mix (70 % tarpit, http and
socks5 alternating, 10 % refused, 15 % live, 5 % live after 2 s), and runs the work tree's ``magpie check``
and then the baseline's (``--baseline-ref``, extracted with ``git archive``) on the same file, one after
the other, with the product's defaults (2 attempts x ``--timeout`` s).

Printed per tree: wall seconds, checks/s (lines / wall), alive count, the CPU of the ``magpie check``
processes (µs per check, from the children's rusage) and the lab's CPU apart; then the ratios tree /
baseline. The one-node goal compares this checks/s with the pipeline's (``pipeline_bench.py``).

    .venv/bin/python benchmarks/oneshot_bench.py [--routes 100000] [--timeout 10] [--baseline-ref 39512dd]

Traffic stays on 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PY = sys.executable
LAB_HOST_BASES = ("127.0.0.20", "127.0.0.40")
MIX = {"tarpit": 0.70, "refused": 0.10, "echo": 0.15, "slow": 0.05}


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def start_lab(tarpit_ports: int) -> tuple[list[subprocess.Popen], str, list[dict]]:
    """A judge and two fault labs; returns the processes, the judge URL and the labs' addresses."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MAGPIE_EGRESS_ONLY": "127.0.0.0/8,::1"}
    judge = subprocess.Popen([PY, "-c", "from magpie.checker.judge import run_judge; run_judge('127.0.0.1', 0)"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    procs = [judge]
    m = re.search(r"(http://[^/\s]+/)", judge.stdout.readline())
    if not m:
        raise SystemExit("the judge printed no URL")
    url = m.group(1)
    port = url.rstrip("/").rsplit(":", 1)[1]
    labs = []
    for base in LAB_HOST_BASES:
        p = subprocess.Popen([PY, "-m", "magpie.lab.faults", "--host-base", base, "--judge-host", "127.0.0.1",
                              "--judge-port", port, "--tarpit-ports", str(tarpit_ports)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, preexec_fn=_raise_nofile)
        procs.append(p)
        labs.append(json.loads(p.stdout.readline()))
    return procs, url, labs


def write_list(path: Path, labs: list[dict], n: int) -> int:
    """The mix over both labs (half the routes each); returns the line count."""
    from magpie.lab.faults import mix_lines

    lines = []
    for i, lab in enumerate(labs):
        addrs = {**lab, "tarpit": lab["tarpits"]}
        share = n // len(labs) + (1 if i < n % len(labs) else 0)
        lines += [line.replace("://u", f"://l{i}u") for _, line in
                  mix_lines(addrs, share, MIX, protocols={"tarpit": ("http", "socks5")})]
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def cpu_of(procs: list[subprocess.Popen]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = psutil.Process(p.pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run_check(tree: Path, list_file: Path, judge: str, timeout: float, labs_procs) -> dict:
    """``magpie check`` of ``list_file`` from ``tree``; wall time, alive count and CPU figures."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAGPIE_", "PROXY_"))}
    env.update({"PYTHONPATH": str(tree), "MAGPIE_EGRESS_ONLY": "127.0.0.0/8,::1",
                "MAGPIE_CHECK_ALLOW_PRIVATE": "127.0.0.0/8", "MAGPIE_JUDGE_URL": judge})
    code = "import sys; from magpie.cli import main; sys.argv = ['magpie'] + sys.argv[1:]; main()"
    lab0 = cpu_of(labs_procs)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run([PY, "-c", code, "check", str(list_file), "--timeout", f"{timeout:g}", "--json"],
                       cwd=tree, env=env, capture_output=True, text=True, preexec_fn=_raise_nofile)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lab = cpu_of(labs_procs) - lab0
    if p.returncode != 0:
        raise SystemExit(f"magpie check failed in {tree}: {p.stderr.strip()[-600:]}")
    rows = json.loads(p.stdout)
    rows = rows.get("results", rows) if isinstance(rows, dict) else rows
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    n = len(rows)
    return {"checks": n, "wall_s": wall, "checks_per_s": n / wall, "alive": sum(1 for r in rows if r.get("alive")),
            "cpu_us_per_check": cpu / max(n, 1) * 1e6, "lab_cpu_us_per_check": lab / max(n, 1) * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routes", type=int, default=100_000, help="lines in the list (default 100,000)")
    ap.add_argument("--timeout", type=float, default=10.0, help="MAGPIE_CHECK_TIMEOUT (default 10 s)")
    ap.add_argument("--baseline-ref", default="39512dd", help="git ref of the baseline (default 39512dd)")
    ap.add_argument("--skip-baseline", action="store_true", help="measure the work tree only")
    args = ap.parse_args(argv)
    tarpits = int(args.routes * MIX["tarpit"])
    ports = max(8, tarpits // 2 // 3000 + 1)  # one accept queue holds a few thousand connections
    procs, judge, labs = start_lab(ports)
    work = Path(tempfile.mkdtemp(prefix="oneshot-bench-list-"))
    base = None
    try:
        n = write_list(work / "routes.txt", labs, args.routes)
        print(f"# oneshot_bench routes={n} mix={MIX} timeout_s={args.timeout:g} attempts=default "
              f"cores={os.cpu_count()} nofile={resource.getrlimit(resource.RLIMIT_NOFILE)}", flush=True)
        trees = [("tree", ROOT)]
        if not args.skip_baseline:
            from pipeline_bench import extract_ref

            base, _sha = extract_ref(args.baseline_ref, "oneshot-bench-")
            trees.append((f"baseline {args.baseline_ref}", base))
        figs = {}
        for name, tree in trees:
            f = figs[name] = run_check(tree, work / "routes.txt", judge, args.timeout, procs[1:])
            print(f"oneshot tree={name.split()[0]} checks={f['checks']} wall_s={f['wall_s']:.1f} "
                  f"checks_per_s={f['checks_per_s']:.0f} alive={f['alive']} "
                  f"cpu_us_per_check={f['cpu_us_per_check']:.0f} lab_cpu_us_per_check={f['lab_cpu_us_per_check']:.0f}",
                  flush=True)
        if len(figs) == 2:
            new, old = figs["tree"], figs[trees[1][0]]
            print(f"oneshot-ratio checks_per_s={new['checks_per_s'] / old['checks_per_s']:.2f} "
                  f"cpu_us_per_check={new['cpu_us_per_check'] / old['cpu_us_per_check']:.2f}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
