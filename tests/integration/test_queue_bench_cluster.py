"""Smoke run of ``benchmarks/queue_bench.py --cluster`` at tiny sizes (slow tier: it starts a private
redis-server and a 3+3 local cluster, ~10 s): every configuration prints its line, the 3 partitions sit on
3 different masters, and every server it started is gone afterwards."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "queue_bench.py"


def fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", line))


def answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cluster_run_prints_every_configuration_and_stops_its_servers():
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server / redis-cli not installed")
    out = subprocess.run([sys.executable, str(SCRIPT), "--cluster", "--routes", "300", "--seconds", "0.3",
                          "--rounds", "1", "--batch", "16", "--procs", "2"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [fields(ln) for ln in out.stdout.splitlines() if ln.startswith("queue_bench config=")]
    got = {(f["config"], f["partitions"], f["batch"], f["procs"]) for f in lines}
    configs = (("single", "1"), ("cluster", "1"), ("cluster", "2"), ("cluster", "3"), ("cluster-wait1", "1"))
    for config, n in configs:
        for batch, procs in (("1", "1"), ("16", "1"), ("16", "2")):
            assert (config, n, batch, procs) in got, (config, n, batch, procs, out.stdout)
    for f in lines:
        assert float(f["routes_per_s"]) > 0 and float(f["redis_cpu_us_per_route"]) > 0, f
        if f["config"] == "single":
            assert f["ratio_to_single"] == "1.00" and float(f["replica_cpu_us_per_route"]) == 0, f
        else:
            assert float(f["replica_cpu_us_per_route"]) > 0, f  # the replicas apply the masters' writes
    placed = [fields(ln) for ln in out.stdout.splitlines()
              if ln.startswith("queue_bench placement partitions=3 ")]
    masters = {f["master"] for f in placed}
    assert len(placed) == 3 and len(masters) == 3, out.stdout
    assert "carries over to bigger machines" in out.stdout
    for m in masters:
        assert not answers(int(m.rsplit(":", 1)[1])), f"{m} still answers after the run"
