"""Dead-route policy: checks a second a real-world mix demands with and without the policy, as the ideal
formula gives it and as measured on the local Redis with a simulated clock.

    .venv/bin/python benchmarks/cadence_bench.py [--routes 10000] [--interval 300] [--after 3] [--factor 4]
        [--seconds 9000]

Mix: 70 % tarpit (dead after a 20 s timeout), 10 % refused (dead at once), 15 % live (0.5 s), 5 % slow
(live, 5 s). Ideal: a route's period is the interval plus its check's duration for tarpits (completion
schedules max(due, now) + interval); under the policy a dead route's period is factor x interval (+ 20 s
for tarpits). Measured: no workers; every simulated second claims every due route (``pop.lua``), finishes
each check after its class's duration and completes it with its verdict (``complete.lua``); checks/s is
counted over the second half of the run (steady state), scaled to 1,000,000 routes.
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import uuid

import redis

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from magpie.queue import Payload, QueueKeys, RouteQueue  # noqa: E402
from magpie.base.routes import Route  # noqa: E402

MIX = (("tarpit", 0.70, 20.0, False), ("refused", 0.10, 0.0, False), ("live", 0.15, 0.5, True),
       ("slow", 0.05, 5.0, True))


def ideal(routes: int, interval: float, factor: int | None) -> float:
    """Checks/s of ``routes`` routes of :data:`MIX` (``factor`` None: no policy), tarpits' period + 20 s."""
    total = 0.0
    for name, share, _dur, alive in MIX:
        period = interval if alive or not factor else interval * factor
        if name == "tarpit":
            period += 20.0
        total += routes * share / period
    return total


def measure(client, args, after: int) -> float:
    prefix = f"bench-cad-{uuid.uuid4().hex[:8]}:"
    clock = {"now": 1_800_000_000_000}
    q = RouteQueue(client, QueueKeys(prefix, 16), interval_ms=int(args.interval * 1000), lease_ms=600_000,
                   clock=lambda: clock["now"], dead_after=after, dead_factor=args.factor)
    cls_of: dict[str, tuple] = {}
    items = []
    bounds, acc = [], 0.0
    for c in MIX:
        acc += c[1]
        bounds.append((acc, c))
    for i in range(args.routes):
        f = (i + 0.5) / args.routes
        c = next(c for b, c in bounds if f <= b + 1e-12)
        h = f"{i:024x}"
        cls_of[h] = c
        items.append((h, Payload(i, Route("http", "127.0.0.1", 1024 + i % 60000, None, None), h, [1]).encode()))
    try:
        q.schedule(items)
        running: list = []
        seq = 0
        counted = 0
        half = args.seconds // 2
        for sec in range(args.seconds):
            while True:
                leases = q.pop(500)
                if not leases:
                    break
                for le in leases:
                    seq += 1
                    heapq.heappush(running, (clock["now"] + int(cls_of[le.member][2] * 1000), seq, le))
                if sec >= half:
                    counted += len(leases)
            clock["now"] += 1000
            done = []
            while running and running[0][0] <= clock["now"]:
                done.append(heapq.heappop(running)[2])
            for i in range(0, len(done), 200):
                chunk = done[i: i + 200]
                q.complete_with_results(chunk, [{"alive": "1" if cls_of[le.member][3] else "0"} for le in chunk],
                                        None)
        return counted / (args.seconds - half) * 1_000_000 / args.routes
    finally:
        for k in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", type=int, default=10_000)
    ap.add_argument("--interval", type=float, default=300.0)
    ap.add_argument("--after", type=int, default=3)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=9000)
    args = ap.parse_args()
    client = redis.Redis.from_url(os.environ.get("MAGPIE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    base_i, pol_i = ideal(1_000_000, args.interval, None), ideal(1_000_000, args.interval, args.factor)
    base_m, pol_m = measure(client, args, 0), measure(client, args, args.after)
    print(f"1,000,000 routes on {args.interval:g}s, mix 70% tarpit (20 s) / 10% refused / 15% live / 5% slow; "
          f"policy: after {args.after} dead checks, every {args.factor}x the interval")
    print(f"{'':<10}{'ideal checks/s':>16}{'measured checks/s':>19}")
    print(f"{'no policy':<10}{base_i:>16.0f}{base_m:>19.0f}")
    print(f"{'policy':<10}{pol_i:>16.0f}{pol_m:>19.0f}")
    print(f"summary ideal_cut={1 - pol_i / base_i:.1%} measured_cut={1 - pol_m / base_m:.1%} "
          f"(measured on {args.routes} routes, {args.seconds}s simulated, second half counted)")


if __name__ == "__main__":
    main()
