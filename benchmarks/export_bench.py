"""Measure ``stream_export`` against the local PostgreSQL, with PostgreSQL's own ``COPY`` as the baseline.

Creates a throwaway database, migrates it, bulk-inserts ``--routes`` routes into one workspace (server-side
``INSERT ... SELECT generate_series``) with a ``route_health`` row each (two thirds alive, latency,
anonymity, exit address), a country (``route_enrichment``) and a reputation score, one route in ten with
encrypted credentials. Then, each in a fresh child process so that its peak RSS is its own, it streams
every route to ``/dev/null``:

* ``stream_export`` for each of ``--formats`` (and ``txt``, ``jsonl`` with credentials, which decrypts
  them);
* beside each, the baseline: ``COPY (<the query that export runs>) TO STDOUT`` (CSV, psycopg2
  ``copy_expert``), the same rows, columns and joins with PostgreSQL doing the formatting and no Python.

Prints, per run, routes per second, seconds, the time as a ratio of the baseline's, and the child's peak
RSS next to its RSS before streaming (the flat-memory claim: the difference must not grow with
``--routes``). The database is dropped afterwards.

    .venv/bin/python benchmarks/export_bench.py [--routes 1000000] [--formats txt,url,csv,jsonl,json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import uuid

os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only
import sqlalchemy as sa  # noqa: E402

ADMIN = os.environ.get("MAGPIE_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/x").rsplit("/", 1)[0] \
    + "/postgres"
KEY = "bench-key-0123456789abcdef"


def populate(engine, routes: int) -> None:
    from magpie.base.crypto import get_keyring

    token_user, token_pw = (get_keyring(KEY).encrypt(v) for v in ("bench-user", "bench-p@ss"))
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('bench')"))
        c.execute(sa.text("""
            INSERT INTO routes (route_hash, protocol, host, port, username_enc, password_enc)
            SELECT lpad(to_hex(g), 24, '0'), (ARRAY['http','https','socks4','socks5'])[1 + g % 4],
                   '10.' || (g >> 16 & 255) || '.' || (g >> 8 & 255) || '.' || (g & 255), 1024 + g % 60000,
                   CASE WHEN g % 10 = 0 THEN :u END, CASE WHEN g % 10 = 0 THEN :p END
            FROM generate_series(1, :n) g"""), {"n": routes, "u": token_user, "p": token_pw})
        c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) SELECT id, 1 FROM routes"))
        c.execute(sa.text("""
            INSERT INTO route_health (route_id, last_checked_at, alive, latency_ms, anonymity, exit_ip,
                                      exit_country, checks_total, alive_total)
            SELECT id, now(), id % 3 <> 0, CASE WHEN id % 3 <> 0 THEN 50 + id % 2000 END,
                   CASE WHEN id % 3 <> 0 THEN (ARRAY['elite','anonymous','transparent'])[1 + id % 3] END,
                   CASE WHEN id % 3 <> 0 THEN '198.51.' || (id >> 8 & 255) || '.' || (id & 255) END,
                   CASE WHEN id % 3 <> 0 THEN (ARRAY['DE','NL','US','FR'])[1 + id % 4] END, 10, 7
            FROM routes"""))
        c.execute(sa.text("INSERT INTO route_enrichment (route_id, country) "
                          "SELECT id, (ARRAY['DE','NL','US','FR','JP'])[1 + id % 5] FROM routes"))
        c.execute(sa.text("""
            INSERT INTO route_reputation (route_id, score, label, uptime, recency, latency, anonymity, streak,
                                          checks)
            SELECT id, id % 101, 'neutral', 0.5, 0.5, 0.5, 0.5, 0.5, 10 FROM routes"""))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(sa.text("VACUUM ANALYZE"))


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(url: str, fmt: str, creds: bool) -> dict:
    """One measured run in this process: returns rows, seconds, RSS before and peak RSS (KiB)."""
    from magpie.config import load_settings
    from magpie.db.session import get_engine
    from magpie.admin.export import ExportFilter, export_sql, stream_export

    settings = load_settings(database_url=url, encryption_key=KEY)
    engine = get_engine(url)
    with engine.connect() as c:  # warm the pool and the catalogue, outside the timing
        c.execute(sa.text("SELECT count(*) FROM workspaces"))
    before = _rss_kib()
    rows = 0
    with open(os.devnull, "w") as out:
        t0 = time.perf_counter()
        if fmt.startswith("copy:"):  # copy:<the format whose query is copied>
            sql = export_sql({}, None, creds, full=fmt[5:] not in ("txt", "url")).replace("%(wid)s", "1")
            raw = engine.raw_connection()
            try:
                cur = raw.cursor()
                cur.copy_expert(f"COPY ({sql}) TO STDOUT WITH (FORMAT csv)", out)
                rows = cur.rowcount
            finally:
                raw.close()
        else:
            for chunk in stream_export(settings, ExportFilter("bench"), fmt, creds):
                out.write(chunk)
                rows += chunk.count("\n")
            rows -= {"csv": 1, "json": 2}.get(fmt, 0)  # the header line; the array's brackets
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rows": rows, "seconds": seconds, "rss_before_kib": before, "peak_rss_kib": peak}


def run_child(url: str, fmt: str, creds: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", url, "--format", fmt] + (["--with-credentials"] if creds else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", type=int, default=1_000_000)
    ap.add_argument("--formats", default="txt,url,csv,jsonl,json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--format", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--with-credentials", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.format, a.with_credentials)))
        return
    import logging

    logging.getLogger("magpie.audit").setLevel(logging.WARNING)
    from magpie.db.migrate import ensure_database, upgrade

    name = f"magpie_bench_{uuid.uuid4().hex[:8]}"
    url = ADMIN.rsplit("/", 1)[0] + "/" + name
    ensure_database(url)
    upgrade(url)
    engine = sa.create_engine(url)
    try:
        t0 = time.monotonic()
        populate(engine, a.routes)
        print(f"population: {a.routes:,} routes with health, country and score in one workspace "
              f"({time.monotonic() - t0:.1f} s to store)")
        runs = [(fmt, fmt, False) for fmt in a.formats.split(",") if fmt]
        runs += [("txt --with-credentials", "txt", True), ("jsonl --with-credentials", "jsonl", True)]
        print("each run beside its baseline: COPY (the same query, same rows and columns) TO STDOUT")
        print(f"{'run':<26} {'routes':>10} {'s':>7} {'routes/s':>10} {'x copy':>7} {'RSS before':>11} {'peak RSS':>9}")
        bases: dict = {}
        for label, fmt, creds in runs:
            key = (fmt in ("txt", "url"), creds)
            if key not in bases:
                bases[key] = base = run_child(url, f"copy:{fmt}", creds)
                print(f"{'  copy ' + ('address' if key[0] else 'all') + (' +creds' if creds else ''):<26} "
                      f"{base['rows']:>10,} {base['seconds']:>7.2f} {base['rows'] / base['seconds']:>10,.0f} "
                      f"{1.0:>7.2f} {base['rss_before_kib'] / 1024:>9.1f}MB {base['peak_rss_kib'] / 1024:>7.1f}MB")
            got = run_child(url, fmt, creds)
            print(f"{label:<26} {got['rows']:>10,} {got['seconds']:>7.2f} {got['rows'] / got['seconds']:>10,.0f} "
                  f"{got['seconds'] / bases[key]['seconds']:>7.2f} {got['rss_before_kib'] / 1024:>9.1f}MB "
                  f"{got['peak_rss_kib'] / 1024:>7.1f}MB")
    finally:
        engine.dispose()
        admin = sa.create_engine(ADMIN, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


if __name__ == "__main__":
    main()
