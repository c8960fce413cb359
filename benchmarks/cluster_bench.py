"""Redis Cluster benchmark: claim+complete cycles/s of the Redis schedule on a private local cluster
(3 masters + 3 replicas, :mod:`magpie.lab.cluster`), without and with ``WAIT 1`` after every claim and
completion (``MAGPIE_REDIS_WAIT_REPLICAS=1``), and on one plain private redis-server as the baseline, all
measured in one run. Prints each figure with its ratio to the single-server baseline.

    .venv/bin/python benchmarks/cluster_bench.py [--routes 20000] [--seconds 5] [--batch 1,32]

Starts and stops its own servers by PID on free loopback ports; touches no shared Redis.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")

import redis  # noqa: E402

from magpie import redisconn  # noqa: E402
from magpie.lab.cluster import LocalCluster, wait_for  # noqa: E402
from magpie.queue import Payload, QueueKeys, RouteQueue  # noqa: E402
from magpie.routes import Route  # noqa: E402


def items(n):
    for i in range(n):
        h = f"{i:024x}"
        yield h, Payload(i, Route("socks5", "127.0.0.1", 1 + i % 60000), h, [1]).encode()


def cycles_per_s(client, routes: int, seconds: float, batch: int, wait: int) -> float:
    """Routes claimed and completed per second, ``batch`` routes per call (interval 1 ms: always due)."""
    q = RouteQueue(client, QueueKeys(f"bench:{batch}:{wait}:", 16), interval_ms=1, lease_ms=60_000)
    q.wait_replicas, q.wait_timeout_ms = wait, 1000
    q.schedule(list(items(routes)))
    done, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        leases = q.pop(batch)
        if leases:
            done += sum(1 for c in q.complete(leases) if c == 1)
    rate = done / (time.monotonic() - t0)
    return rate


def plain_server() -> tuple[subprocess.Popen, redis.Redis, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="magpie-bench-")
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c = redis.Redis(port=port)
    wait_for(c.ping, 10, "the plain redis-server")
    return proc, c, d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", type=int, default=20_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--batch", default="1,32", help="routes per claim/complete call, comma-separated")
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batch.split(",")]
    proc, plain, d = plain_server()
    cluster = LocalCluster().start()
    try:
        cc = redisconn.connect(cluster.url)
        summary = []
        for b in batches:
            base = cycles_per_s(plain, a.routes, a.seconds, b, 0)
            on_cluster = cycles_per_s(cc, a.routes, a.seconds, b, 0)
            waited = cycles_per_s(cc, a.routes, a.seconds, b, 1)
            print(f"batch {b:>3}: one server {base:9.0f} routes/s (baseline 1.00); cluster {on_cluster:9.0f} "
                  f"({on_cluster / base:.2f}); cluster + WAIT 1 {waited:9.0f} ({waited / base:.2f}, "
                  f"{waited / on_cluster:.2f} of the cluster without WAIT)")
            summary += [f"b{b}_plain={base:.0f}", f"b{b}_cluster={on_cluster:.0f}", f"b{b}_wait={waited:.0f}"]
        print(" ".join(summary))
    finally:
        cluster.stop()
        proc.terminate()
        proc.wait(5)
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
