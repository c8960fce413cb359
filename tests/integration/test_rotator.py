"""Rotating listeners against real PostgreSQL, Redis, lab proxies and judge, all on loopback.

Routes are seeded straight into ``routes`` / ``route_health`` (the checker's side is tested elsewhere); the
dead lab proxy is seeded as alive so that the rotator meets a failing upstream.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading

import pytest
import requests
import sqlalchemy as sa

from helpers import wait_until

from magpie.crypto import get_keyring
from magpie.errors import Refusal, RefusedError
from magpie.lab.lab import start_free_lab
from magpie.rotator.pool import RoutePool, Upstream
from magpie.rotator.process import RotatorProcess, assign, read_states
from magpie.rotator.service import RotatorError, add_rotator, list_rotators, remove_rotator, update_rotator

NAMES = ("http-elite", "socks4-elite", "socks5-elite", "socks5-auth", "dead")


def free_range(n: int = 6) -> str:
    for _ in range(50):
        lo = random.randint(30000, 39000)
        ok = True
        for p in range(lo, lo + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return f"{lo}-{lo + n - 1}"
    raise RuntimeError("no free port range")


@pytest.fixture(scope="module")
def lab():
    lab = start_free_lab()
    yield lab
    lab.stop()


@pytest.fixture
def rset(settings):
    return settings.model_copy(update=dict(rotator_ports=free_range(), rotator_reconcile=0.3, instance_heartbeat=0.3,
                                           instance_ttl=1.5, rotator_pool_refresh=0.5, rotator_connect_timeout=2.0))


@pytest.fixture
def keyring(settings):
    return get_keyring(settings.encryption_key)


def seed(db, keyring, lab, names=NAMES, workspace="ws"):
    """Workspace ``workspace`` owning the named lab proxies, each recorded alive."""
    with db.begin() as c:
        wid = c.execute(sa.text("INSERT INTO workspaces (name) VALUES (:n) ON CONFLICT (name) DO UPDATE "
                                "SET name = EXCLUDED.name RETURNING id"), {"n": workspace}).scalar()
        for i, name in enumerate(names):
            r = lab.proxy(name).route
            rid = c.execute(sa.text(
                "INSERT INTO routes (route_hash, protocol, host, port, username_enc, password_enc) "
                "VALUES (:h, :p, :host, :port, :u, :pw) RETURNING id"),
                {"h": keyring.route_hash(r), "p": r.protocol, "host": r.host, "port": r.port,
                 "u": keyring.encrypt(r.username) if r.username else None,
                 "pw": keyring.encrypt(r.password) if r.password else None}).scalar()
            c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) VALUES (:r, :w)"),
                      {"r": rid, "w": wid})
            c.execute(sa.text("INSERT INTO route_health (route_id, alive, latency_ms, anonymity, last_checked_at) "
                              "VALUES (:r, true, :l, 'elite', now())"), {"r": rid, "l": 10.0 + i})
    return wid


class Running:
    """A :class:`RotatorProcess` on its own event loop thread."""

    def __init__(self, proc: RotatorProcess):
        self.proc = proc
        self.loop = None
        self.stop_ev = None
        ready = threading.Event()

        async def main():
            self.loop = asyncio.get_running_loop()
            self.stop_ev = asyncio.Event()
            ready.set()
            await proc.run(self.stop_ev)

        self.thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def close(self):
        self.loop.call_soon_threadsafe(self.stop_ev.set)
        self.thread.join(15)
        assert not self.thread.is_alive()


def make_proc(rset, db, redis_client, keyring):
    return RotatorProcess(rset, engine=db, redis=redis_client, keyring=keyring)


def wait_for(pred, timeout=10.0, what="condition"):
    return wait_until(pred, timeout=timeout, what=what)


def serving(redis_client, prefix, rid):
    return read_states(redis_client, prefix, [rid]).get(rid, {}).get("state") == "serving"


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def judge_via(proxy_url: str, judge_url: str) -> str:
    r = requests.get(judge_url, proxies={"http": proxy_url, "https": proxy_url}, timeout=10)
    r.raise_for_status()
    return r.json()["remote_addr"]


# -- rotators as data ------------------------------------------------------------------------------------
def test_add_list_update_remove_with_refusals(db, settings, keyring, redis_client):
    with db.begin() as c:
        c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('ws')"))
    got = add_rotator(db, keyring, name="r1", workspace="ws", ports="21000-21001", username="u", password="s3cret!",
                      filters={"protocols": "socks5,http", "max_latency_ms": 500})
    assert got["port"] == 21000 and got["auth"] and got["filters"]["protocols"] == ["socks5", "http"]
    assert "s3cret!" not in json.dumps(list_rotators(db))
    with db.connect() as c:
        stored = c.execute(sa.text("SELECT password_enc FROM rotators")).scalar()
    assert "s3cret!" not in stored and keyring.decrypt(stored) == "s3cret!"
    with pytest.raises(RefusedError) as exc:
        add_rotator(db, keyring, name="r2", workspace="ws", ports="21000-21001", port=21000)
    assert exc.value.code is Refusal.PORT_TAKEN
    add_rotator(db, keyring, name="r2", workspace="ws", ports="21000-21001")
    with pytest.raises(RefusedError) as exc:
        add_rotator(db, keyring, name="r3", workspace="ws", ports="21000-21001")
    assert exc.value.code is Refusal.RANGE_EXHAUSTED
    with pytest.raises(RefusedError) as exc:
        add_rotator(db, keyring, name="r3", workspace="nope", ports="21000-21009")
    assert exc.value.code is Refusal.NO_SUCH_WORKSPACE
    with pytest.raises(RotatorError, match="filter anonymity"):
        add_rotator(db, keyring, name="r3", workspace="ws", ports="21000-21009", filters={"anonymity": "super"})
    rev = got["revision"]
    upd = update_rotator(db, keyring, "r1", policy="sticky", sticky_seconds=30)
    assert upd["policy"] == "sticky" and upd["revision"] == rev + 1
    with pytest.raises(RefusedError) as exc:
        update_rotator(db, keyring, "r1", port=21001)
    assert exc.value.code is Refusal.PORT_TAKEN
    remove_rotator(db, "r2")
    assert [r["name"] for r in list_rotators(db)] == ["r1"]
    with pytest.raises(RotatorError, match="no rotator named"):
        remove_rotator(db, "r2")


def test_pool_round_robin_sticky_and_failure_penalty():
    ups = [Upstream(i, "socks5", "127.0.0.1", 1000 + i) for i in range(3)]
    pool = RoutePool(ups)
    assert [pool.pick("c", set()).route_id for _ in range(4)] == [0, 1, 2, 0]
    pool.failed(ups[1])
    assert [pool.pick("c", set()).route_id for _ in range(3)] == [2, 0, 2]
    assert pool.pick("c", {0, 2}) is None
    now = [0.0]
    sticky = RoutePool(ups, "sticky", 10, clock=lambda: now[0])
    first = sticky.pick("a", set()).route_id
    assert all(sticky.pick("a", set()).route_id == first for _ in range(5))
    assert sticky.pick("b", set()).route_id != first
    now[0] = 11.0
    assert sticky.pick("a", set()).route_id != first


# -- through a rotator -----------------------------------------------------------------------------------
def test_http_connect_and_socks5_clients_rotate_over_the_pool_and_skip_the_dead(db, rset, keyring, redis_client,
                                                                               lab):
    seed(db, keyring, lab)
    got = add_rotator(db, keyring, name="rot", workspace="ws", ports=rset.rotator_ports)
    run = Running(make_proc(rset, db, redis_client, keyring))
    try:
        wait_for(lambda: serving(redis_client, rset.redis_prefix, got["id"]), what="listener")
        url = f"http://127.0.0.1:{got['port']}"
        seen = [judge_via(url, lab.judge_url) for _ in range(20)]
        assert len(set(seen)) >= 2 and "127.0.0.1" not in seen  # egress from the lab proxies' addresses
        socks = [judge_via(f"socks5h://127.0.0.1:{got['port']}", lab.judge_url) for _ in range(6)]
        assert len(set(socks)) >= 2
        # CONNECT by hand: tunnel to the judge, then speak HTTP inside it
        judge_host, judge_port = lab.judge_url[7:].rstrip("/").split(":")
        with socket.create_connection(("127.0.0.1", got["port"]), timeout=10) as s:
            s.sendall(f"CONNECT {judge_host}:{judge_port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert s.recv(1024).startswith(b"HTTP/1.1 200")
            s.sendall(b"GET /inside HTTP/1.1\r\nHost: judge\r\nConnection: close\r\n\r\n")
            body = read_all(s)
        assert b'"path":"/inside"' in body
        def published():  # the state is published once per reconcile cadence
            st = read_states(redis_client, rset.redis_prefix, [got["id"]])[got["id"]]
            return st if st["connections"] >= 27 else None

        stats = wait_for(published, what="state")
        assert stats["pool"] == len(NAMES) and stats["upstream_failures"] >= 1  # the dead one was tried, skipped
        assert stats["no_route"] == 0
    finally:
        run.close()


def test_credentials_are_required_when_set(db, rset, keyring, redis_client, lab):
    seed(db, keyring, lab, names=("socks5-elite",))
    got = add_rotator(db, keyring, name="auth", workspace="ws", ports=rset.rotator_ports, username="alice",
                      password="p@ss:w0rd")
    run = Running(make_proc(rset, db, redis_client, keyring))
    try:
        wait_for(lambda: serving(redis_client, rset.redis_prefix, got["id"]), what="listener")
        port = got["port"]
        r = requests.get(lab.judge_url, proxies={"http": f"http://127.0.0.1:{port}"}, timeout=10)
        assert r.status_code == 407
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"\x05\x01\x00")  # no-auth only: refused
            assert s.recv(2) == b"\x05\xff"
        good = f"http://alice:p%40ss%3Aw0rd@127.0.0.1:{port}"
        assert judge_via(good, lab.judge_url) == lab.proxy("socks5-elite").egress
        assert judge_via(f"socks5h://alice:p%40ss%3Aw0rd@127.0.0.1:{port}", lab.judge_url)
        with pytest.raises(requests.exceptions.RequestException):
            judge_via(f"socks5h://alice:wrong@127.0.0.1:{port}", lab.judge_url)
        hdr = base64.b64encode(b"alice:p@ss:w0rd").decode()
        assert hdr not in json.dumps(read_states(redis_client, rset.redis_prefix, [got["id"]]))
    finally:
        run.close()


def test_a_filter_change_applies_without_a_restart(db, rset, keyring, redis_client, lab):
    seed(db, keyring, lab, names=("http-elite", "socks5-elite", "socks4-elite"))
    got = add_rotator(db, keyring, name="f", workspace="ws", ports=rset.rotator_ports)
    run = Running(make_proc(rset, db, redis_client, keyring))
    try:
        wait_for(lambda: serving(redis_client, rset.redis_prefix, got["id"]), what="listener")
        url = f"http://127.0.0.1:{got['port']}"
        # an open tunnel survives the change
        s = socket.create_connection(("127.0.0.1", got["port"]), timeout=10)
        judge_host, judge_port = lab.judge_url[7:].rstrip("/").split(":")
        s.sendall(f"CONNECT {judge_host}:{judge_port} HTTP/1.1\r\n\r\n".encode())
        assert s.recv(1024).startswith(b"HTTP/1.1 200")
        update_rotator(db, keyring, "f", filters={"protocols": ["socks5"]}, redis=redis_client,
                       prefix=rset.redis_prefix)
        only = lab.proxy("socks5-elite").egress
        wait_for(lambda: all(judge_via(url, lab.judge_url) == only for _ in range(4)), what="filter applied")
        s.sendall(b"GET /still HTTP/1.1\r\nHost: j\r\nConnection: close\r\n\r\n")
        assert b"/still" in read_all(s)
        s.close()
    finally:
        run.close()


def test_assigner_balances_and_reassigns_orphans(db, settings, keyring, redis_client):
    from magpie.instances import Heartbeat, InstanceRegistry

    with db.begin() as c:
        c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('ws')"))
    for i in range(5):
        add_rotator(db, keyring, name=f"r{i}", workspace="ws", ports="22000-22010")
    reg = InstanceRegistry(redis_client, settings.redis_prefix)
    a = Heartbeat("rotator", redis_client, settings.redis_prefix, interval=1, ttl=30, instance_id="rot-a")
    b = Heartbeat("rotator", redis_client, settings.redis_prefix, interval=1, ttl=30, instance_id="rot-b")
    a.beat_once()
    assert assign(db, reg, None)["assigned"] == 5
    b.beat_once()
    for _ in range(3):
        assign(db, reg, None)
    with db.connect() as c:
        counts = dict(c.execute(sa.text("SELECT instance_id, count(*) FROM rotators GROUP BY 1")).all())
    assert sorted(counts.values()) == [2, 3]
    a.registry.withdraw("rot-a")  # a vanished: its rotators are orphans
    assert assign(db, reg, None)["assigned"] == counts["rot-a"]
    with db.connect() as c:
        assert c.execute(sa.text("SELECT DISTINCT instance_id FROM rotators")).scalars().all() == ["rot-b"]
    b.registry.withdraw("rot-b")


@pytest.mark.e2e
def test_a_killed_rotator_instance_hands_its_rotators_to_another(db, rset, keyring, redis_client, lab, pg_url):
    seed(db, keyring, lab, names=("http-elite", "socks5-elite"))
    got = add_rotator(db, keyring, name="ha", workspace="ws", ports=rset.rotator_ports)
    env = dict(os.environ, MAGPIE_DATABASE_URL=pg_url, MAGPIE_REDIS_URL=rset.redis_url,
               MAGPIE_REDIS_PREFIX=rset.redis_prefix, PROXY_ENCRYPTION_KEY=rset.encryption_key,
               MAGPIE_ROTATOR_PORTS=rset.rotator_ports, MAGPIE_ROTATOR_RECONCILE="0.5",
               MAGPIE_INSTANCE_HEARTBEAT="0.5", MAGPIE_INSTANCE_TTL="2", MAGPIE_ROTATOR_POOL_REFRESH="1")
    procs = [subprocess.Popen([sys.executable, "-m", "magpie", "rotator"], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        url = f"http://127.0.0.1:{got['port']}"
        state = wait_for(lambda: read_states(redis_client, rset.redis_prefix, [got["id"]]).get(got["id"]),
                         timeout=20, what="first assignment")
        assert judge_via(url, lab.judge_url)
        owner = state["instance"]
        pids = {json.loads(redis_client.get(f"{rset.redis_prefix}instance:{i}"))["pid"]: i
                for i in [owner]}
        victim = next(p for p in procs if p.pid in pids)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(10)

        def moved():
            st = read_states(redis_client, rset.redis_prefix, [got["id"]]).get(got["id"], {})
            if st.get("instance") not in (None, owner) and st.get("state") == "serving":
                try:
                    return judge_via(url, lab.judge_url)
                except requests.RequestException:
                    return None
            return None

        # heartbeat TTL (2 s) + the assigner lock's TTL (3 s) + a reconcile cadence, with room for a loaded machine
        assert wait_for(moved, timeout=20, what="failover")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


def test_rotator_scoped_alert_rules_read_its_pool_and_its_upstream_protocols(db, settings, keyring, lab):
    from datetime import UTC, datetime, timedelta

    from magpie.alerts.measure import measure_workspace
    from magpie.alerts.rules import create_rule

    seed(db, keyring, lab, names=("http-elite", "socks4-elite", "socks5-elite", "socks5-auth"))
    with db.begin() as c:
        c.execute(sa.text("UPDATE route_health SET anonymity = 'anonymous' WHERE route_id = "
                          "(SELECT id FROM routes WHERE port = :p)"), {"p": lab.proxy("socks5-auth").route.port})
        now = datetime.now(UTC)
        for proto, alive in (("socks5", True), ("socks5", True), ("http", False), ("http", False)):
            c.execute(sa.text("INSERT INTO check_history (route_id, checked_at, alive, latency_ms) "
                              "SELECT id, :t, :a, 50 FROM routes WHERE protocol = :p"),
                      {"t": now - timedelta(seconds=30), "a": alive, "p": proto})
    add_rotator(db, keyring, name="s5", workspace="ws", ports="23000-23010",
                filters={"protocols": ["socks5"], "anonymity": ["elite"]})
    pool_rule = create_rule(db, "ws", "pool", "usable_routes", 2, rotator="s5")
    ws_rule = create_rule(db, "ws", "all", "usable_routes", 2)
    rate_rule = create_rule(db, "ws", "rate", "success_rate", 90, rotator="s5", min_samples=1)
    ws_rate = create_rule(db, "ws", "ws-rate", "success_rate", 90, min_samples=1)
    assert "[rotator s5]" in pool_rule.describe()
    snap = measure_workspace(db, pool_rule.workspace_id, settings)
    m = snap.measurements
    # the pool: socks5 and elite -> one route (socks5-auth is anonymous); the workspace has four
    assert (m[pool_rule.id].outcome, m[pool_rule.id].value) == ("breach", 1.0)
    assert (m[ws_rule.id].outcome, m[ws_rule.id].value) == ("healthy", 4.0)
    # history of the upstream protocol (socks5): every check alive, whatever the anonymity filter says
    assert (m[rate_rule.id].outcome, m[rate_rule.id].value) == ("healthy", 100.0)
    assert m[ws_rate.id].outcome == "breach"
    with pytest.raises(LookupError, match="no rotator"):
        create_rule(db, "ws", "x", "usable_routes", 1, rotator="missing")


def test_rotators_commands(db, settings, monkeypatch):
    from click.testing import CliRunner

    from magpie.cli import main
    from magpie.config import get_settings

    for k, v in {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
                 "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
                 "MAGPIE_ROTATOR_PORTS": "24000-24000", "ROT_PW": "hunter2!"}.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    with db.begin() as c:
        c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('ws')"))
    run = CliRunner().invoke
    res = run(main, ["rotators", "add", "a", "--workspace", "ws", "--username", "u", "--password-env", "ROT_PW",
                     "--protocols", "socks5", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["port"] == 24000
    res = run(main, ["rotators", "add", "b", "--workspace", "ws"])
    assert res.exit_code == 3 and "refused: range_exhausted" in res.output
    res = run(main, ["rotators", "add", "b", "--workspace", "nope"])
    assert res.exit_code == 3 and "no_such_workspace" in res.output
    res = run(main, ["rotators", "add", "b", "--workspace", "ws", "--listen", "ftp"])
    assert res.exit_code == 2 and "listen" in res.output
    res = run(main, ["rotators", "update", "a", "--max-latency", "800", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["filters"] == {"protocols": ["socks5"],
                                                                         "max_latency_ms": 800.0}
    res = run(main, ["rotators", "list", "--json"])
    [row] = json.loads(res.output)
    assert row["state"] == "unassigned" and row["auth"] and "hunter2" not in res.output
    res = run(main, ["rotators", "list"])
    assert res.exit_code == 0 and "24000" in res.output and "hunter2" not in res.output
    assert run(main, ["rotators", "remove", "a"]).exit_code == 0
    assert run(main, ["rotators", "remove", "a"]).exit_code == 2
    get_settings.cache_clear()


def test_pool_filters_by_country_reputation_latency_and_credentials(db, keyring, lab):
    from magpie.egress import EgressPolicy
    from magpie.rotator.pool import load_pool

    wid = seed(db, keyring, lab, names=("http-elite", "socks5-elite", "socks5-auth"))
    port = {n: lab.proxy(n).route.port for n in ("http-elite", "socks5-elite", "socks5-auth")}
    with db.begin() as c:
        ids = dict(c.execute(sa.text("SELECT port, id FROM routes")).all())
        c.execute(sa.text("INSERT INTO route_enrichment (route_id, country) VALUES (:a, 'DE'), (:b, 'NL')"),
                  {"a": ids[port["socks5-elite"]], "b": ids[port["http-elite"]]})
        c.execute(sa.text("INSERT INTO route_reputation (route_id, score, label, uptime, recency, latency, anonymity, "
                          "streak, checks) VALUES (:a, 90, 'good', 1, 1, 1, 1, 1, 10), "
                          "(:b, 30, 'poor', 0, 0, 0, 0, 0, 10)"),
                  {"a": ids[port["socks5-auth"]], "b": ids[port["socks5-elite"]]})

    def ports(filters, **kw):
        return sorted(u.port for u in load_pool(db, keyring, wid, filters, **kw))

    assert ports({"country": ["DE"]}) == [port["socks5-elite"]]
    assert ports({"reputation": "good"}) == [port["socks5-auth"]]
    assert ports({"protocols": ["socks5"], "max_latency_ms": 11.5}) == [port["socks5-elite"]]
    [auth] = load_pool(db, keyring, wid, {"reputation": "good"})
    assert (auth.username, auth.password) == (lab.proxy("socks5-auth").route.username,
                                              lab.proxy("socks5-auth").route.password)
    assert lab.proxy("socks5-auth").route.password not in repr(auth)
    assert ports({}, egress=EgressPolicy(False)) == []  # loopback routes refused by the default guard
