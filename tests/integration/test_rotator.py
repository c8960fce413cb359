"""Rotating listeners against real PostgreSQL, Redis, lab proxies and judge, all on loopback.

Routes are seeded straight into ``routes`` / ``route_health`` (the checker's side is tested elsewhere); the
dead lab proxy is seeded as alive so that the rotator meets a failing upstream.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest
import requests
import sqlalchemy as sa

from helpers import wait_until

from magpie.base.crypto import get_keyring
from magpie.errors import Refusal, RefusedError
from magpie.lab.lab import start_free_lab
from magpie.rotator.pool import RoutePool, Upstream
from magpie.rotator.process import RotatorProcess, assign, read_states, state_key
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
    return settings.model_copy(update={"rotator_ports": free_range(), "rotator_reconcile": 0.3, "instance_heartbeat": 0.3,
                                           "instance_ttl": 1.5, "rotator_pool_refresh": 0.5, "rotator_connect_timeout": 2.0,
                                           "rotator_allow_private": "127.0.0.0/8", "rotator_allowed_ports": "1-65535"})


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
    from magpie.coordination.instances import Heartbeat, InstanceRegistry

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
               MAGPIE_INSTANCE_HEARTBEAT="0.5", MAGPIE_INSTANCE_TTL="2", MAGPIE_ROTATOR_POOL_REFRESH="1",
               MAGPIE_ROTATOR_ALLOW_PRIVATE="127.0.0.0/8", MAGPIE_ROTATOR_ALLOWED_PORTS="1-65535")
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
    res = run(main, ["rotators", "add", "c", "--workspace", "ws"])  # no credentials: it says where it serves
    assert res.exit_code == 0 and "open rotator (no credentials): served on loopback only" in res.output
    monkeypatch.setenv("MAGPIE_ROTATOR_HOST", "0.0.0.0")
    get_settings.cache_clear()
    res = run(main, ["rotators", "update", "c", "--policy", "next"])
    assert res.exit_code == 0 and "refused on MAGPIE_ROTATOR_HOST 0.0.0.0" in res.output
    get_settings.cache_clear()


def test_pool_filters_by_country_reputation_latency_and_credentials(db, keyring, lab):
    from magpie.base.egress import EgressPolicy
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


# -- not an open relay -----------------------------------------------------------------------------------
def connect_status(port: int, target: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        return s.recv(1024).split(b"\r\n", 1)[0]


def socks5_connect(port: int, host: str, dport: int, creds: tuple[str, str] | None = None) -> int:
    """SOCKS5 CONNECT by hand; returns the reply code (0 = granted, -1 = authentication refused)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"\x05\x01" + (b"\x02" if creds else b"\x00"))
        assert s.recv(2)[0] == 5
        if creds:
            u, p = (x.encode() for x in creds)
            s.sendall(bytes([1, len(u)]) + u + bytes([len(p)]) + p)
            if s.recv(2) != b"\x01\x00":
                return -1
        name = host.encode()
        s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + dport.to_bytes(2, "big"))
        return s.recv(10)[1]


def test_a_rotator_refuses_loopback_private_and_unlisted_port_destinations(db, rset, keyring, redis_client, lab):
    seed(db, keyring, lab, names=("http-elite", "socks5-elite"))
    strict = rset.model_copy(update={"rotator_allow_private": "false", "rotator_allowed_ports": "80,443"})
    got = add_rotator(db, keyring, name="strict", workspace="ws", ports=rset.rotator_ports)
    judge = lab.judge_url[7:].rstrip("/")
    judge_port = int(judge.rsplit(":", 1)[1])
    run = Running(make_proc(strict, db, redis_client, keyring))
    try:
        wait_for(lambda: serving(redis_client, rset.redis_prefix, got["id"]), what="listener")
        port = got["port"]
        for target in ("127.0.0.1:6379", "127.0.0.1:5432", "localhost:443", "10.0.0.1:443", "169.254.169.254:80",
                       "[::1]:443", judge):
            assert connect_status(port, target) == b"HTTP/1.1 403 Forbidden", target
        r = requests.get(f"{lab.judge_url}api/status", proxies={"http": f"http://127.0.0.1:{port}"}, timeout=10)
        assert r.status_code == 403
        assert socks5_connect(port, "127.0.0.1", 6379) == 2  # connection not allowed by ruleset
        assert socks5_connect(port, "localhost", 80) == 2
    finally:
        run.close()
    # loopback allowed back, ports still limited; a rotator's own list replaces the deployment's
    ports_only = rset.model_copy(update={"rotator_allowed_ports": "80,443"})
    redis_client.delete(state_key(rset.redis_prefix, got["id"]))
    run = Running(make_proc(ports_only, db, redis_client, keyring))
    try:
        wait_for(lambda: serving(redis_client, rset.redis_prefix, got["id"]), what="listener")
        assert connect_status(got["port"], judge) == b"HTTP/1.1 403 Forbidden"
        update_rotator(db, keyring, "strict", filters={"allowed_ports": str(judge_port)}, redis=redis_client,
                       prefix=rset.redis_prefix)
        wait_for(lambda: connect_status(got["port"], judge) == b"HTTP/1.1 200 Connection established",
                 what="the rotator's own ports")
        assert connect_status(got["port"], "127.0.0.1:6379") == b"HTTP/1.1 403 Forbidden"
        assert judge_via(f"http://127.0.0.1:{got['port']}", lab.judge_url)
    finally:
        run.close()
    with pytest.raises(RotatorError, match="allowed_ports"):
        update_rotator(db, keyring, "strict", filters={"allowed_ports": "70000"})


def test_an_open_rotator_serves_loopback_only(db, rset, keyring, redis_client, lab, caplog):
    import logging

    seed(db, keyring, lab, names=("socks5-elite",))
    got = add_rotator(db, keyring, name="open", workspace="ws", ports=rset.rotator_ports)
    wide = rset.model_copy(update={"rotator_host": "0.0.0.0"})
    run = Running(make_proc(wide, db, redis_client, keyring))
    try:
        st = wait_for(lambda: read_states(redis_client, rset.redis_prefix, [got["id"]]).get(got["id"]),
                      what="state")
        assert st["state"] == "error" and "no password" in st["error"] and "loopback" in st["error"]
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", got["port"]), timeout=2).close()
        # with credentials it may listen there
        update_rotator(db, keyring, "open", username="u", password="long-secret-1", redis=redis_client,
                       prefix=rset.redis_prefix)
        wait_for(lambda: serving(redis_client, rset.redis_prefix, got["id"]), what="listener with a password")
    finally:
        run.close()
    update_rotator(db, keyring, "open", username=None, password=None)
    redis_client.delete(state_key(rset.redis_prefix, got["id"]))
    with caplog.at_level(logging.INFO, logger="magpie.rotator.process"):
        run = Running(make_proc(rset, db, redis_client, keyring))
        try:
            wait_for(lambda: serving(redis_client, rset.redis_prefix, got["id"]), what="loopback listener")
        finally:
            run.close()
    assert any("open (no credentials): loopback only" in r.getMessage() for r in caplog.records)


def test_upstream_names_are_resolved_and_checked_before_every_dial(lab):
    from magpie.base.egress import EgressPolicy
    from magpie.rotator.listener import Listener, ListenerSpec

    proxy = lab.proxy("socks5-elite").route
    judge = lab.judge_url[7:].rstrip("/")
    asked = []

    async def flipped(host, port):  # a name that passed its first check and now points at loopback
        asked.append(host)
        return [proxy.host]

    async def through(egress) -> bytes:
        spec = ListenerSpec(1, "dns", 0, frozenset({"http"}), None, None, "next", 0, 1, 1, {})
        pool = RoutePool([Upstream(7, "socks5", "rebound.invalid", proxy.port)])
        lis = Listener(spec, pool, upstream_egress=egress, resolver=flipped, connect_timeout=5)
        lis.spec.port = 0
        await lis.start()
        port = lis._server.sockets[0].getsockname()[1]
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(f"CONNECT {judge} HTTP/1.1\r\n\r\n".encode())
            line = await asyncio.wait_for(r.readline(), 10)
            w.close()
            return line.strip()
        finally:
            await lis.stop()

    assert asyncio.run(through(EgressPolicy(False))) == b"HTTP/1.1 502 Bad Gateway"  # loopback: never dialled
    assert asked == ["rebound.invalid"]
    assert asyncio.run(through(EgressPolicy("127.0.0.0/8"))) == b"HTTP/1.1 200 Connection established"
    assert asked == ["rebound.invalid"] * 2  # resolved again for the dial, and the checked address dialled


class Forwarder:
    """Relays 127.0.0.1:<port> to ``target`` (so that the name ``localhost`` reaches a lab proxy)."""

    def __init__(self, target: tuple[str, int]):
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._accept, args=(target,), daemon=True).start()

    def _accept(self, target):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.accepted += 1
            u = socket.create_connection(target)
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self):
        self.srv.close()


def test_a_route_named_localhost_is_not_dialled_when_loopback_is_refused(db, rset, keyring, redis_client, lab):
    seed(db, keyring, lab, names=("socks5-elite",))
    route = lab.proxy("socks5-elite").route
    fwd = Forwarder((route.host, route.port))
    with db.begin() as c:
        c.execute(sa.text("UPDATE routes SET host = 'localhost', port = :p"), {"p": fwd.port})
    judge = lab.judge_url[7:].rstrip("/")
    got = add_rotator(db, keyring, name="named", workspace="ws", ports=rset.rotator_ports)
    try:
        run = Running(make_proc(rset, db, redis_client, keyring))  # loopback upstreams allowed: dialled
        try:
            wait_for(lambda: serving(redis_client, rset.redis_prefix, got["id"]), what="listener")
            assert connect_status(got["port"], judge) == b"HTTP/1.1 200 Connection established"
        finally:
            run.close()
        before = fwd.accepted
        redis_client.delete(state_key(rset.redis_prefix, got["id"]))
        guarded = rset.model_copy(update={"check_allow_private": "false"})
        run = Running(make_proc(guarded, db, redis_client, keyring))
        try:
            wait_for(lambda: serving(redis_client, rset.redis_prefix, got["id"]), what="listener")
            assert connect_status(got["port"], judge) == b"HTTP/1.1 502 Bad Gateway"
        finally:
            run.close()
        assert fwd.accepted == before  # the name resolved to loopback, so nothing was dialled
    finally:
        fwd.close()


def test_password_guessing_is_throttled_per_client_address_and_logged_as_a_rate(db, rset, keyring, redis_client,
                                                                                 lab, caplog):
    import logging

    seed(db, keyring, lab, names=("socks5-elite",))
    got = add_rotator(db, keyring, name="guarded", workspace="ws", ports=rset.rotator_ports, username="alice",
                      password="correct-horse")
    judge_host, judge_port = lab.judge_url[7:].rstrip("/").rsplit(":", 1)
    with caplog.at_level(logging.WARNING, logger="magpie.rotator"):
        run = Running(make_proc(rset, db, redis_client, keyring))
        try:
            wait_for(lambda: serving(redis_client, rset.redis_prefix, got["id"]), what="listener")
            port = got["port"]
            for i in range(30):
                assert socks5_connect(port, judge_host, int(judge_port), ("alice", f"guess-{i}")) == -1
            # the right password is not even checked while this address is blocked
            assert socks5_connect(port, judge_host, int(judge_port), ("alice", "correct-horse")) == -1
            r = requests.get(lab.judge_url, proxies={"http": f"http://alice:correct-horse@127.0.0.1:{port}"},
                             timeout=10)
            assert r.status_code == 407
            from magpie.rotator.metrics import RotatorCollector

            fams = {f.name: f for f in RotatorCollector(run.proc).collect()}
            assert [x.value for x in fams["magpie_rotator_auth_failures"].samples] == [32]
        finally:
            run.close()
    lines = [r.getMessage() for r in caplog.records if "failed client authentications" in r.getMessage()]
    assert lines and "127.0.0.1" in lines[-1]
    counted = [int(re.search(r"authentications: (\d+) in", ln).group(1)) for ln in lines]
    assert sum(counted) == 32  # every failure counted, once
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "guess-" not in text and "correct-horse" not in text


def test_failure_throttle_backs_off_per_address_and_forgets():
    from magpie.coordination.throttle import FailureThrottle

    now = [0.0]
    t = FailureThrottle(free=3, base_s=1, cap_s=8, window_s=100, clock=lambda: now[0])
    assert [t.failed("a") for _ in range(7)] == [0, 0, 0, 1, 2, 4, 8]
    assert t.failed("a") == 8 and t.blocked("a") == 8 and t.blocked("b") == 0
    now[0] += 8
    assert t.blocked("a") == 0 and t.failed("a") == 8  # still within the window: the backoff stays
    t.succeeded("a")
    assert t.failed("a") == 0
    now[0] += 200
    assert t.blocked("a") == 0 and [t.failed("a") for _ in range(4)] == [0, 0, 0, 1]


def test_a_predecessor_counts_as_exited_only_when_this_host_can_tell():
    from magpie.rotator.process import predecessor_dead, process_identity

    me = process_identity()
    rec = {"host": socket.gethostname(), "pid": os.getpid(), "identity": me}
    assert not predecessor_dead(rec, me)  # this very process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    gone = {**rec, "pid": child.pid, "identity": {**me, "pid": child.pid, "proc_start": "1"}}
    assert predecessor_dead(gone, me)
    assert predecessor_dead({**rec, "identity": {**me, "proc_start": "1"}}, me)  # pid reused by this process
    assert not predecessor_dead({**gone, "host": "elsewhere"}, me)
    assert not predecessor_dead({**gone, "identity": {**gone["identity"], "boot_id": "other"}}, me)
    assert not predecessor_dead({"host": socket.gethostname(), "pid": child.pid}, me)  # no identity: unknown


@pytest.mark.e2e
def test_a_restarted_rotator_serves_again_before_its_killed_predecessor_expires(db, rset, keyring, redis_client,
                                                                                lab, pg_url):
    seed(db, keyring, lab, names=("http-elite", "socks5-elite"))
    got = add_rotator(db, keyring, name="back", workspace="ws", ports=rset.rotator_ports)
    env = dict(os.environ, MAGPIE_DATABASE_URL=pg_url, MAGPIE_REDIS_URL=rset.redis_url,
               MAGPIE_REDIS_PREFIX=rset.redis_prefix, PROXY_ENCRYPTION_KEY=rset.encryption_key,
               MAGPIE_ROTATOR_PORTS=rset.rotator_ports, MAGPIE_ROTATOR_RECONCILE="0.5",
               MAGPIE_INSTANCE_HEARTBEAT="0.5", MAGPIE_INSTANCE_TTL="600", MAGPIE_ROTATOR_POOL_REFRESH="1",
               MAGPIE_ROTATOR_ALLOW_PRIVATE="127.0.0.0/8", MAGPIE_ROTATOR_ALLOWED_PORTS="1-65535")

    def start():
        return subprocess.Popen([sys.executable, "-m", "magpie", "rotator"], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    url = f"http://127.0.0.1:{got['port']}"

    def answers():
        try:
            return judge_via(url, lab.judge_url)
        except requests.RequestException:
            return None

    procs = [start()]
    try:
        wait_for(answers, timeout=20, what="first instance serving")
        first = read_states(redis_client, rset.redis_prefix, [got["id"]])[got["id"]]["instance"]
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        procs.append(start())  # a supervisor restarts it at once; the old record lives 600 s more
        assert wait_for(answers, timeout=30, what="the restarted instance serving")
        st = wait_for(lambda: read_states(redis_client, rset.redis_prefix, [got["id"]]).get(got["id"]),
                      what="state")
        assert st["instance"] != first
        assert redis_client.get(f"{rset.redis_prefix}instance:{first}") is None  # the exited one withdrawn
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
