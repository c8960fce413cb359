"""Priority lane under overload: lateness of new imports and check-now against the recurring backlog,
with the lane (``MAGPIE_PRIORITY_SHARE``) and without it (baseline), measured in one run on the local Redis.

    .venv/bin/python benchmarks/priority_bench.py [--routes 20000] [--interval 60] [--capacity 0.75]
        [--seconds 180] [--imports 2000] [--share 0.5]

No workers: a simulated clock (the scripts' clock override) advances one second per step; each step claims
(``pop.lua``, batches of 64) at most ``capacity`` x demand routes and completes them at once. ``--imports``
new routes arrive at one third of the run, spread over the interval as an import spreads them, and every
second one backlog route gets ``check-now``. Lateness = claim time - due time, per class: backlog (recurring
routes), new (first check of an imported route), check-now. Each variant uses its own key prefix and
deletes it at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

import redis

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from magpie.queue import Payload, QueueKeys, RouteQueue  # noqa: E402
from magpie.base.routes import Route  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def item(i: int) -> tuple[str, str]:
    h = f"{i:024x}"
    return h, Payload(i, Route("http", "127.0.0.1", 1024 + i % 60000, None, None), h, [1]).encode()


def run(client, args, share: float) -> dict:
    prefix = f"bench-prio-{uuid.uuid4().hex[:8]}:"
    keys = QueueKeys(prefix, 16)
    clock = {"now": 1_800_000_000_000}
    interval = int(args.interval * 1000)
    q = RouteQueue(client, keys, interval_ms=interval, lease_ms=600_000, clock=lambda: clock["now"],
                   priority_share=share)
    try:
        plain = RouteQueue(client, keys, interval_ms=interval, clock=lambda: clock["now"])
        plain.schedule([item(i) for i in range(args.routes)])  # the recurring backlog: no lane
        demand = args.routes / args.interval
        cap = int(demand * args.capacity)
        new = {h for h, _ in (item(args.routes + j) for j in range(args.imports))}
        first_seen: set[str] = set()
        urgent: set[str] = set()
        late = {"backlog": [], "new": [], "check_now": []}
        import_at = args.seconds // 3
        for sec in range(args.seconds):
            if sec == import_at:
                q.schedule([item(args.routes + j) for j in range(args.imports)])
            if sec >= 10:  # an operator's check-now on a backlog route every second
                h = f"{(sec * 7919) % args.routes:024x}"
                try:
                    q.enqueue_in(h, 0)
                    urgent.add(h)
                except Exception:  # noqa: BLE001 - leased right now: skip
                    pass
            got = 0
            while got < cap:
                leases = q.pop(min(64, cap - got))
                if not leases:
                    break
                got += len(leases)
                for le in leases:
                    lat = (clock["now"] - float(le.previous_score)) / 1000
                    if le.member in urgent:
                        urgent.discard(le.member)
                        late["check_now"].append(lat)
                    elif le.member in new and le.member not in first_seen:
                        first_seen.add(le.member)
                        late["new"].append(lat)
                    elif sec >= import_at:
                        late["backlog"].append(lat)
                q.complete(leases)
            clock["now"] += 1000
        return {"share": share, "capacity": cap, "demand": demand, "late": late,
                "new_checked": len(first_seen)}
    finally:
        for k in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", type=int, default=20_000)
    ap.add_argument("--interval", type=float, default=60.0)
    ap.add_argument("--capacity", type=float, default=0.75, help="claims per second as a share of demand")
    ap.add_argument("--seconds", type=int, default=180)
    ap.add_argument("--imports", type=int, default=2_000)
    ap.add_argument("--share", type=float, default=0.5)
    args = ap.parse_args()
    client = redis.Redis.from_url(os.environ.get("MAGPIE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    rows = [run(client, args, 0.0), run(client, args, args.share)]
    print(f"routes={args.routes} interval={args.interval:g}s demand={rows[0]['demand']:.0f}/s "
          f"capacity={rows[0]['capacity']}/s ({args.capacity:.0%}) imports={args.imports} at "
          f"t={args.seconds // 3}s, run {args.seconds}s (simulated)")
    print(f"{'variant':<14}{'class':<11}{'n':>7}{'p50 s':>9}{'p95 s':>9}{'max s':>9}")
    for r in rows:
        name = "baseline" if r["share"] == 0 else f"lane {r['share']:g}"
        for cls, xs in r["late"].items():
            print(f"{name:<14}{cls:<11}{len(xs):>7}{pct(xs, 50):>9.1f}{pct(xs, 95):>9.1f}"
                  f"{(max(xs) if xs else float('nan')):>9.1f}")
    b, p = rows
    print(f"summary new_p95_baseline={pct(b['late']['new'], 95):.1f}s new_p95_lane={pct(p['late']['new'], 95):.1f}s "
          f"backlog_p95_baseline={pct(b['late']['backlog'], 95):.1f}s "
          f"backlog_p95_lane={pct(p['late']['backlog'], 95):.1f}s "
          f"new_checked_baseline={b['new_checked']} new_checked_lane={p['new_checked']}")


if __name__ == "__main__":
    main()
