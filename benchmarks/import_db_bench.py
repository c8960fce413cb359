"""Measure :func:`magpie.db.repo.upsert_routes` on 100,000 routes against the local PostgreSQL.

Creates a throwaway database, migrates it, and times:
  1. the first import into workspace "bench-a" (hashing + encryption + inserts),
  2. re-importing the same routes into "bench-a" (all routes and memberships exist),
  3. importing them into a second workspace "bench-b" (membership merge only),
and, for scale, hashing and encryption alone. The database is dropped afterwards (unless --keep).

    .venv/bin/python benchmarks/import_db_bench.py [--routes 100000] [--creds 1.0] [--chunk 5000]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

import sqlalchemy as sa

os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only
from magpie.base.crypto import get_keyring
from magpie.db.migrate import ensure_database, upgrade
from magpie.db.repo import upsert_routes
from magpie.base.routes import Route

# the server of MAGPIE_DATABASE_URL; the benchmark creates and drops its own database there
ADMIN = os.environ.get("MAGPIE_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/x").rsplit("/", 1)[0] + "/postgres"


def make_routes(n: int, creds_ratio: float) -> list[Route]:
    with_creds = int(n * creds_ratio)
    out = []
    for i in range(n):
        user, pw = (f"user{i}", f"pw-{i:08d}-secret") if i < with_creds else (None, None)
        proto = ("http", "https", "socks4", "socks5")[i % 4]
        out.append(Route(proto, f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 1024 + i % 60000, user, pw))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", type=int, default=100_000)
    ap.add_argument("--creds", type=float, default=1.0, help="fraction of routes with username+password")
    ap.add_argument("--chunk", type=int, default=5000)
    ap.add_argument("--keep", action="store_true", help="keep the database")
    args = ap.parse_args()

    name = f"magpie_bench_{uuid.uuid4().hex[:8]}"
    url = ADMIN.rsplit("/", 1)[0] + "/" + name
    ensure_database(url)
    upgrade(url)
    engine = sa.create_engine(url)
    keyring = get_keyring("bench-key-0123456789abcdef")
    routes = make_routes(args.routes, args.creds)
    n = len(routes)
    try:
        t = time.perf_counter()
        for r in routes:
            keyring.route_hash(r)
        t_hash = time.perf_counter() - t
        sample = routes[: min(n, 20_000)]
        t = time.perf_counter()
        for r in sample:
            if r.username is not None:
                keyring.encrypt(r.username)
                keyring.encrypt(r.password)
        t_enc = (time.perf_counter() - t) * n / len(sample)

        timings = []
        for label, ws in (
            ("first import (new routes)", "bench-a"),
            ("re-import, same workspace", "bench-a"),
            ("import into second workspace", "bench-b"),
        ):
            t = time.perf_counter()
            res = upsert_routes(engine, keyring, ws, routes, chunk=args.chunk)
            dt = time.perf_counter() - t
            timings.append((label, dt, res))

        with engine.connect() as c:
            counts = {
                t: c.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one()
                for t in ("routes", "route_workspaces", "workspaces")
            }
            size = c.execute(sa.text("SELECT pg_size_pretty(pg_total_relation_size('routes'))")).scalar_one()

        print(f"routes: {n:,}  with credentials: {args.creds:.0%}  chunk: {args.chunk:,}")
        print(f"route_hash alone:            {t_hash:7.2f} s  ({n / t_hash:,.0f} routes/s)")
        print(f"encryption alone (est.):     {t_enc:7.2f} s  (2 Fernet tokens per route with credentials)")
        for label, dt, res in timings:
            print(
                f"{label:28s} {dt:7.2f} s  ({n / dt:,.0f} routes/s)  inserted={res.inserted:,} "
                f"new_members={len(res.new_members):,} already={len(res.already_members):,}"
            )
        first = timings[0][1]
        print(f"first import vs 60 s budget: {first / 60:.1%}")
        print(f"rows: {counts}  routes table+indexes: {size}")
    finally:
        engine.dispose()
        if not args.keep:
            admin = sa.create_engine(ADMIN, isolation_level="AUTOCOMMIT")
            with admin.connect() as c:
                c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
            admin.dispose()
        else:
            print(f"kept database {name}")


if __name__ == "__main__":
    main()
