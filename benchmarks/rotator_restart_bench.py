"""Rotator restart benchmark: seconds without service after a SIGKILL of ``magpie rotator`` under client load.

Creates a throwaway database, the lab's judge and proxies on loopback, and one rotator over two lab
proxies; starts ``magpie rotator`` with the default cadences (``MAGPIE_ROTATOR_RECONCILE`` 10 s,
``MAGPIE_INSTANCE_TTL`` 30 s), keeps ``--clients`` client threads fetching the judge through it, kills the
process with SIGKILL and restarts it at once, as a supervisor would. Prints the gap between the kill and
the first successful request after it, the restarted process's start-up share of that gap, and the
requests refused in the phase. Everything is removed afterwards.

    python benchmarks/rotator_restart_bench.py [--clients 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import redis
import requests
import sqlalchemy as sa

from magpie.base.crypto import get_keyring
from magpie.db.migrate import ensure_database, upgrade
from magpie.lab.lab import start_free_lab
from magpie.rotator.service import add_rotator

ADMIN = os.environ.get("MAGPIE_BENCH_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")
REDIS = os.environ.get("MAGPIE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
KEY = "bench-key-0123456789abcdef"


def seed(engine, keyring, lab) -> None:
    with engine.begin() as c:
        wid = c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('bench') RETURNING id")).scalar()
        for i, name in enumerate(("http-elite", "socks5-elite")):
            r = lab.proxy(name).route
            rid = c.execute(sa.text("INSERT INTO routes (route_hash, protocol, host, port) VALUES (:h, :p, :host, "
                                    ":port) RETURNING id"),
                            {"h": keyring.route_hash(r), "p": r.protocol, "host": r.host, "port": r.port}).scalar()
            c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) VALUES (:r, :w)"),
                      {"r": rid, "w": wid})
            c.execute(sa.text("INSERT INTO route_health (route_id, alive, latency_ms, anonymity, last_checked_at) "
                              "VALUES (:r, true, :l, 'elite', now())"), {"r": rid, "l": 10.0 + i})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    name = f"magpie_bench_{uuid.uuid4().hex[:8]}"
    url = ADMIN.rsplit("/", 1)[0] + "/" + name
    prefix = f"magpie-bench:{uuid.uuid4().hex[:8]}:"
    ensure_database(url)
    upgrade(url)
    engine = sa.create_engine(url)
    r = redis.Redis.from_url(REDIS)
    lab = start_free_lab()
    keyring = get_keyring(KEY)
    procs: list[subprocess.Popen] = []
    try:
        seed(engine, keyring, lab)
        lo = random.randint(40000, 44000)
        ports = f"{lo}-{lo + 20}"
        rot = add_rotator(engine, keyring, name="bench", workspace="bench", ports=ports)
        env = dict(os.environ, MAGPIE_DATABASE_URL=url, MAGPIE_REDIS_URL=REDIS, MAGPIE_REDIS_PREFIX=prefix,
                   PROXY_ENCRYPTION_KEY=KEY, MAGPIE_ROTATOR_PORTS=ports,
                   MAGPIE_CHECK_ALLOW_PRIVATE="127.0.0.0/8", MAGPIE_ROTATOR_ALLOW_PRIVATE="127.0.0.0/8",
                   MAGPIE_ROTATOR_ALLOWED_PORTS="1-65535")
        proxy = {"http": f"http://127.0.0.1:{rot['port']}"}
        log: list[tuple[float, bool]] = []  # (request start, succeeded)
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                began = time.monotonic()
                try:
                    ok = requests.get(lab.judge_url, proxies=proxy, timeout=5).status_code == 200
                except requests.RequestException:
                    ok = False
                log.append((began, ok))  # by start time: a request begun before the kill proves nothing
                if not ok:
                    time.sleep(0.05)

        def start() -> subprocess.Popen:
            p = subprocess.Popen([sys.executable, "-m", "magpie", "rotator"], env=env, start_new_session=True,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(p)
            return p

        def first_ok_after(t: float, deadline: float = 120.0) -> float | None:
            end = time.monotonic() + deadline
            while time.monotonic() < end:
                hits = [ts for ts, ok in list(log) if ok and ts > t]
                if hits:
                    return min(hits)
                time.sleep(0.02)
            return None

        cur = start()
        threads = [threading.Thread(target=client, daemon=True) for _ in range(a.clients)]
        for t in threads:
            t.start()
        assert first_ok_after(0.0, 60) is not None, "the rotator never served"
        print(f"{'round':>5} {'gap s':>7} {'refused':>8} {'requests':>9}")
        for i in range(a.rounds):
            time.sleep(1.0)
            killed = time.monotonic()
            os.killpg(cur.pid, signal.SIGKILL)
            cur.wait(10)
            cur = start()
            back = first_ok_after(killed)
            phase = [ok for ts, ok in list(log) if killed <= ts <= (back or time.monotonic())]
            gap = f"{back - killed:7.2f}" if back else "   >120"
            print(f"{i + 1:>5} {gap} {phase.count(False):>8} {len(phase):>9}")
        stop.set()
        for t in threads:
            t.join(10)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
        lab.stop()
        engine.dispose()
        keys = list(r.scan_iter(match=prefix + "*"))
        if keys:
            r.delete(*keys)
        r.close()
        admin = sa.create_engine(ADMIN, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                      {"n": name})
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


if __name__ == "__main__":
    main()
