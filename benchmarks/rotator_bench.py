"""Rotator benchmark: connections per second and added latency per connection through a rotating listener.

Everything runs on loopback: the lab's judge and proxies, and one :class:`magpie.rotator.listener.Listener`
over the lab's live upstreams (HTTP, SOCKS4, SOCKS5). Each connection opens a tunnel to the judge and
fetches one echo. The baseline, measured in the same run, makes the same fetch straight through the same
upstream proxies (python-socks), so the ratio is the rotator's own cost.

    python benchmarks/rotator_bench.py [--connections 2000] [--concurrency 50] [--quick]

Prints one line per mode (``direct``, ``rotator-http``, ``rotator-socks5``) with connections/s and
p50/p95 latency per connection in ms, then the ratios against ``direct``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from python_socks import ProxyType  # noqa: E402
from python_socks.async_.asyncio import Proxy  # noqa: E402

from magpie.lab.lab import start_free_lab  # noqa: E402
from magpie.rotator.listener import Listener, ListenerSpec  # noqa: E402
from magpie.rotator.pool import RoutePool, Upstream  # noqa: E402

UPSTREAMS = ("http-elite", "socks4-elite", "socks5-elite")
TYPES = {"http": ProxyType.HTTP, "socks4": ProxyType.SOCKS4, "socks5": ProxyType.SOCKS5}


async def fetch(reader, writer) -> None:
    writer.write(b"GET /bench HTTP/1.1\r\nHost: judge\r\nConnection: close\r\n\r\n")
    await writer.drain()
    data = await reader.read()
    writer.close()
    if b" 200 " not in data[:20]:
        raise RuntimeError(f"unexpected answer {data[:40]!r}")


async def direct(ups: list[Upstream], i: int, jhost: str, jport: int) -> None:
    u = ups[i % len(ups)]
    sock = await Proxy.create(TYPES[u.protocol], u.host, u.port).connect(jhost, jport, timeout=10)
    r, w = await asyncio.open_connection(sock=sock)
    await fetch(r, w)


async def via_http(port: int, _i: int, jhost: str, jport: int) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"CONNECT {jhost}:{jport} HTTP/1.1\r\n\r\n".encode())
    await w.drain()
    line = await r.readuntil(b"\r\n\r\n")
    if b" 200 " not in line:
        raise RuntimeError(f"CONNECT refused: {line[:40]!r}")
    await fetch(r, w)


async def via_socks5(port: int, _i: int, jhost: str, jport: int) -> None:
    sock = await Proxy.create(ProxyType.SOCKS5, "127.0.0.1", port).connect(jhost, jport, timeout=10)
    r, w = await asyncio.open_connection(sock=sock)
    await fetch(r, w)


async def run(fn, target, n: int, conc: int, jhost: str, jport: int) -> tuple[float, list[float]]:
    sem = asyncio.Semaphore(conc)
    lat: list[float] = []

    async def one(i):
        async with sem:
            t = time.perf_counter()
            await fn(target, i, jhost, jport)
            lat.append((time.perf_counter() - t) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0), lat


async def main_async(args) -> None:
    lab = start_free_lab()
    try:
        jhost, jport = lab.judge_url[7:].rstrip("/").split(":")
        jport = int(jport)
        ups = [Upstream(i, lab.proxy(n).route.protocol, lab.proxy(n).route.host, lab.proxy(n).route.port)
               for i, n in enumerate(UPSTREAMS)]
        spec = ListenerSpec(1, "bench", 0, frozenset({"http", "socks5"}), None, None, "next", 0, 1, 1, {})
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            spec.port = s.getsockname()[1]
        lis = Listener(spec, RoutePool(ups), tries=3, connect_timeout=10, idle_timeout=30)
        await lis.start()
        try:
            await run(direct, ups, 50, 10, jhost, jport)  # warm-up
            results = {}
            for name, fn, target in (("direct", direct, ups), ("rotator-http", via_http, spec.port),
                                     ("rotator-socks5", via_socks5, spec.port)):
                rate, lat = await run(fn, target, args.connections, args.concurrency, jhost, jport)
                q = statistics.quantiles(lat, n=20)
                results[name] = (rate, statistics.median(lat), q[18])
                print(f"{name:15s} connections/s={rate:8.0f}  p50={results[name][1]:6.2f} ms  "
                      f"p95={results[name][2]:6.2f} ms  (n={args.connections}, concurrency={args.concurrency})")
            base = results["direct"]
            for name in ("rotator-http", "rotator-socks5"):
                rate, p50, p95 = results[name]
                print(f"{name:15s} rate_ratio={rate / base[0]:.2f}  added_p50={p50 - base[1]:+.2f} ms  "
                      f"added_p95={p95 - base[2]:+.2f} ms  vs direct")
            print(f"rotator stats: connections={lis.stats.connections} upstream_failures="
                  f"{lis.stats.upstream_failures} no_route={lis.stats.no_route}")
        finally:
            await lis.stop()
    finally:
        lab.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="400 connections")
    args = ap.parse_args()
    if args.quick:
        args.connections = 400
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
