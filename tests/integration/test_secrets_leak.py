"""Leak scan: known, distinctive passwords travel through a real deployment and appear nowhere they
should not.

A route through the lab's authenticated SOCKS5 proxy (its real password) and a canary route with a
password of our own are imported and checked by a real Celery worker and beat (private key prefixes),
watched by a real Flower with basic auth; the database URL carries a password too (PostgreSQL's trust
authentication ignores it). Then Flower's task API and HTML pages, the worker's, beat's and Flower's
log output, the raw broker messages (every key under the test's broker prefix, message bodies decoded),
the results stream and the output of every ``magpie`` command that shows routes are scanned for each
password, plain and percent-encoded.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
import requests

from helpers import TimedOut, spawn_celery, stop_group, wait_until

from magpie.base.crypto import get_keyring
from magpie.db.repo import latest_health
from magpie.lab.lab import LAB_PASSWORD, start_free_lab

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e

CANARY = "Lk4/leak@canary:8%zq"  # the canary route's password: every character class a URL must encode
DB_CANARY = "Db6/leak@canary:3%yw"  # the database URL's password
FLOWER_USER, FLOWER_PASSWORD = "ops", "Fl5-flower-canary"


def _forms(secret: str) -> set[str]:
    return {secret, quote(secret, safe=""), quote(secret), quote_plus(secret), json.dumps(secret)[1:-1]}


SECRETS = {name: _forms(value) for name, value in
           {"lab password": LAB_PASSWORD, "canary password": CANARY, "database password": DB_CANARY}.items()}


def _leaks(where: str, text: str) -> list[str]:
    return [f"{name} ({form!r}) in {where}" for name, forms in SECRETS.items() for form in forms if form in text]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args, env, log):
    return spawn_celery(args, env, log, ROOT)


_stop = stop_group


def _magpie(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "magpie", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def _redis_dump(client, pattern: str) -> str:
    """Every value under ``pattern`` as text, with kombu message bodies (base64) decoded as well."""
    out = []
    for key in client.scan_iter(match=pattern, count=1000):
        kind = client.type(key).decode()
        if kind == "string":
            vals = [client.get(key)]
        elif kind == "list":
            vals = client.lrange(key, 0, -1)
        elif kind == "hash":
            vals = [x for kv in client.hgetall(key).items() for x in kv]
        elif kind == "set":
            vals = list(client.smembers(key))
        elif kind == "zset":
            vals = [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":
            vals = [x for _, fields in client.xrange(key) for kv in fields.items() for x in kv]
        else:
            vals = []
        for v in vals:
            text = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
            out.append(text)
            try:  # a kombu message: {"body": "<base64>", "headers": {...}, ...}
                msg = json.loads(text)
                if isinstance(msg, list):  # the unacked hash holds [message, exchange, routing key]
                    msg = msg[0]
                if isinstance(msg, dict) and isinstance(msg.get("body"), str):
                    out.append(base64.b64decode(msg["body"]).decode("utf-8", "replace"))
            except (ValueError, TypeError, IndexError, KeyError):
                pass
    return "\n".join(out)


def test_no_password_in_flower_logs_broker_messages_or_cli_output(settings, db, pg_url, redis_prefix,
                                                                  redis_client, tmp_path):
    lab = start_free_lab(slow_delay=0.2)
    procs: list[subprocess.Popen] = []
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        auth = lab.proxy("socks5-auth").route
        canary = f"socks5://leakuser:{quote(CANARY, safe='')}@{auth.hostport}"
        listing = tmp_path / "routes.txt"
        listing.write_text(f"{auth.url()}\n{canary}\n{lab.proxy('http-elite').route.url()}\n")
        db_url = pg_url.replace("postgres@", f"postgres:{quote(DB_CANARY, safe='')}@", 1)
        assert db_url != pg_url
        flower_port = _free_port()
        env = dict(os.environ)
        env.update({
            "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": redis_prefix,
            "MAGPIE_BROKER_URL": settings.redis_url, "MAGPIE_BROKER_KEY_PREFIX": redis_prefix + "broker:",
            "MAGPIE_DATABASE_URL": db_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
            "MAGPIE_JUDGE_URL": lab.judge_url, "MAGPIE_CHECK_INTERVAL": "2", "MAGPIE_CHECK_TIMEOUT": "3",
            "MAGPIE_CHECK_ATTEMPTS": "1", "MAGPIE_LEASE_SECONDS": "10", "MAGPIE_RENEW_BELOW_SECONDS": "2",
            "MAGPIE_FLOWER_PORT": str(flower_port), "MAGPIE_FLOWER_BASIC_AUTH": f"{FLOWER_USER}:{FLOWER_PASSWORD}",
        })
        for name in ("MAGPIE_FLOWER_ADDRESS", "MAGPIE_FLOWER_ALLOW_NO_AUTH", "FLOWER_BASIC_AUTH"):
            env.pop(name, None)

        outputs: dict[str, str] = {}

        def run(*args, ok=(0,)):
            res = _magpie(env, *args)
            assert res.returncode in ok, (args, res.returncode, res.stderr[-2000:])
            outputs["magpie " + " ".join(args)] = res.stdout + res.stderr
            return res

        imp = json.loads(run("import", str(listing), "--workspace", "leak", "--json").stdout)
        assert imp["imported"] == 3 and not imp["invalid"], imp
        run("import", str(listing), "--workspace", "leak")  # all duplicates now: the text report
        run("import", str(listing), "--workspace", "leak", "--dry-run", "--json")

        log_files = {n: open(logs / f"{n}.log", "w") for n in ("worker", "beat", "flower")}
        procs.append(_spawn(["worker", "-Q", "promote,checks,stats", "-n", f"leak-{redis_prefix}@%h",
                             "--concurrency=1", "--loglevel=debug", "--without-mingle", "--without-gossip"],
                            env, log_files["worker"]))
        procs.append(_spawn(["beat", "--loglevel=debug", f"--schedule={tmp_path / 'beat'}"], env, log_files["beat"]))
        procs.append(_spawn(["flower"], env, log_files["flower"]))  # flowerconfig.py: loopback, basic auth
        base = f"http://127.0.0.1:{flower_port}"
        basic = (FLOWER_USER, FLOWER_PASSWORD)

        keyring = get_keyring(settings.encryption_key)
        rows, tasks = [], {}

        def checked():
            nonlocal rows, tasks
            dead = [p.args for p in procs if p.poll() is not None]
            assert not dead, (dead, {n: (logs / f"{n}.log").read_text()[-2000:] for n in log_files})
            rows = latest_health(db, "leak", keyring=keyring)
            try:
                tasks = requests.get(f"{base}/api/tasks", params={"taskname": "magpie.check_routes"}, auth=basic,
                                     timeout=5).json()
            except (requests.RequestException, ValueError):
                tasks = {}
            done = [t for t in tasks.values() if t.get("state") == "SUCCESS"]
            return len(rows) == 3 and all((r["checks_total"] or 0) >= 1 for r in rows) and done

        with contextlib.suppress(TimedOut):  # asserted below, with the logs
            wait_until(checked, timeout=40, interval=0.5, what="every route checked and shown by Flower")
        by_user = {r["username"]: r for r in rows}
        assert len(rows) == 3 and all((r["checks_total"] or 0) >= 1 for r in rows), \
            (rows, (logs / "worker.log").read_text()[-3000:])
        assert by_user["magpie"]["alive"] is True, by_user  # the lab password came through the sealed message
        assert by_user["leakuser"]["alive"] is False  # the canary password is wrong for the lab: refused
        assert tasks and any(t.get("state") == "SUCCESS" for t in tasks.values()), tasks

        # Flower: authentication required, loopback only, and no payload in any view of a task
        assert requests.get(f"{base}/api/tasks", timeout=5).status_code == 401
        assert requests.get(f"{base}/tasks", timeout=5).status_code == 401
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", flower_port), timeout=2).close()
        flower = {"/api/tasks": requests.get(f"{base}/api/tasks", auth=basic, timeout=5).text,
                  "/tasks": requests.get(f"{base}/tasks", auth=basic, timeout=5).text,
                  "/api/workers": requests.get(f"{base}/api/workers", params={"refresh": 1}, auth=basic,
                                               timeout=20).text}
        table = requests.get(f"{base}/tasks/datatable", auth=basic, timeout=5, params={
            "draw": 1, "start": 0, "length": 500, "search[value]": "", "order[0][column]": 0,
            "order[0][dir]": "asc", "columns[0][data]": "name"})
        flower["/tasks/datatable"] = table.text
        for task_id in list(tasks)[:5]:
            info = requests.get(f"{base}/api/task/info/{task_id}", auth=basic, timeout=5)
            page = requests.get(f"{base}/task/{task_id}", auth=basic, timeout=5)
            assert info.status_code == 200 and page.status_code == 200
            assert "lease" in info.json()["args"]  # the argsrepr, e.g. "<3 leases>"
            flower[f"/api/task/info/{task_id}"], flower[f"/task/{task_id}"] = info.text, page.text
        for p in procs:
            _stop(p)
        for f in log_files.values():
            f.close()

        # a check message as the broker holds it (no consumer now), sent by the real dispatch
        members = [r["route_hash"] for r in rows]
        send = ("import sys\nfrom magpie.wiring import runtime, tasks\nfrom magpie.queue import Lease\n"
                "q = runtime.route_queue()\n"
                "tasks._dispatch_checks([Lease(m, q.payload(m), '0.00', '1.50', q.keys.shard_of(m)).to_dict() "
                "for m in sys.argv[1:]])\n")
        sent = subprocess.run([sys.executable, "-c", send, *members], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
        assert sent.returncode == 0, sent.stderr[-2000:]
        broker = _redis_dump(redis_client, f"{redis_prefix}broker:*")
        from magpie.queue.seal import SEAL_PREFIX

        assert "lease" in broker and SEAL_PREFIX in broker, broker[:500]  # the queued message was scanned
        stream = _redis_dump(redis_client, f"*{redis_prefix}*stream*")

        # every command that shows routes
        run("status")
        run("status", "--json")
        run("routes")
        run("routes", "--json")
        run("routes", "--workspace", "leak", "--json")
        for m in [r["route_hash"] for r in rows if r["username"]]:  # the routes with credentials
            run("queue", "inspect", m)
            run("queue", "inspect", m, "--json")
            run("queue", "logs", m, "--json")
            run("queue", "progress", m, "--json")
        run("queue", "dead")
        run("queue", "dead", "--json")
        run("check", str(listing), "--judge", lab.judge_url, "--json", "--timeout", "3")
        run("check", str(listing), "--judge", lab.judge_url, "--timeout", "3")
        run("health", "--json", ok=(0, 1))
        bad = dict(env, MAGPIE_DATABASE_URL=db_url.replace("postgresql+psycopg2", "mysql"))
        res = _magpie(bad, "status")
        assert res.returncode == 2 and "MAGPIE_DATABASE_URL" in res.stderr, res.stderr
        outputs["magpie status (bad database URL)"] = res.stdout + res.stderr

        found = []
        for where, text in {**flower, **outputs, "broker": broker, "results stream": stream,
                            **{f"{n} log": (logs / f"{n}.log").read_text() for n in log_files}}.items():
            found += _leaks(where, text)
        assert not found, found
        # the scan would have seen them: the import output names the routes, Flower the check tasks
        assert "leakuser" in outputs["magpie routes --json"] and "magpie.check_routes" in flower["/api/tasks"]
    finally:
        for p in procs:
            _stop(p)
        lab.stop()
