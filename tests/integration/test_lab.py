"""The lab's proxies, checked for real by the checker over loopback.

One lab per module on a free port block (slow proxy delay 1 s); a check of each lab proxy must report
exactly what the lab says to expect.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from magpie.checker import CONNECTION_ERRORS, Checker, check_many
from magpie.lab import LAB_PASSWORD, LAB_USER, Lab, LabError, find_free_base_port, start_free_lab
from magpie.lab.forward import ForwardProxy, is_loopback_host
from magpie.lab.lab import egress_host, listen_host
from magpie.base.routes import Route

SLOW = 1.0
TIMEOUT = 3.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lab():
    lab = start_free_lab(slow_delay=SLOW)
    yield lab
    lab.stop()


@pytest.fixture
def checker(lab):
    return Checker(lab.judge_url, timeout=TIMEOUT, attempts=2)


@pytest.fixture
def held_port():
    """A 127.0.0.1 port bound but not listening: connections to it are refused, nobody else can take it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


def _names():
    return [p.name for p in Lab(20000).proxies]


def test_lab_proxies_and_judge_run_on_uvloop(lab):
    import uvloop

    assert isinstance(lab._loop, uvloop.Loop)
    assert lab.judge_url == f"http://127.0.0.1:{lab._judge.sockets[0].getsockname()[1]}/"


def test_layout_has_the_eight_expected_proxies():
    lab = Lab(30000)
    got = [(p.name, p.route.protocol, p.route.host, p.route.port, p.expect_alive, p.expect_anonymity)
           for p in lab.proxies]
    assert got == [
        ("http-elite", "http", "127.0.0.2", 30000, True, "elite"),
        ("socks4-elite", "socks4", "127.0.0.3", 30001, True, "elite"),
        ("socks5-elite", "socks5", "127.0.0.4", 30002, True, "elite"),
        ("socks5-auth", "socks5", "127.0.0.5", 30003, True, "elite"),
        ("http-transparent", "http", "127.0.0.6", 30004, True, "transparent"),
        ("http-anonymous", "http", "127.0.0.7", 30005, True, "anonymous"),
        ("http-slow", "http", "127.0.0.8", 30006, True, "elite"),
        ("dead", "http", "127.0.0.9", 30007, False, None),
    ]
    assert lab.judge_url == "http://127.0.0.1:8899/"
    egress = {p.egress for p in lab.proxies if p.expect_alive}
    assert len(egress) == 7 and "127.0.0.1" not in egress


def test_learn_own_address_is_loopback(checker):
    assert checker.learn_own_address() == {"127.0.0.1"}


@pytest.mark.parametrize("name", _names())
def test_each_lab_proxy_is_classified_as_expected(lab, checker, name):
    p = lab.proxy(name)
    r = checker.check(p.route)
    assert r.alive is p.expect_alive, r
    assert r.anonymity == p.expect_anonymity, r
    assert r.judge == lab.judge_url
    assert abs(r.checked_at_ms - time.time() * 1000) < 5000
    if p.expect_alive:
        assert (r.status, r.error, r.attempts) == (200, None, 1)
        # the judge saw the proxy's own outbound address, not the checker's 127.0.0.1
        assert json.loads(r.body)["remote_addr"] == p.egress == egress_host(lab.proxies.index(p))
        assert r.latency_ms is not None and r.latency_ms > 0
    else:
        # a refused connection is final: no second attempt in the same check
        assert r.error in CONNECTION_ERRORS and r.attempts == 1 and r.latency_ms is None


def test_check_many_keeps_order_and_matches_expectations(lab, checker):
    results = check_many([p.route for p in lab.proxies], checker, concurrency=8)
    expected = [(p.expect_alive, p.expect_anonymity) for p in lab.proxies]
    assert [(r.alive, r.anonymity) for r in results] == expected


def test_slow_proxy_latency_includes_its_delay(lab, checker):
    slow = checker.check(lab.proxy("http-slow").route)
    fast = checker.check(lab.proxy("http-elite").route)
    assert slow.alive and slow.latency_ms >= SLOW * 1000
    assert fast.latency_ms < SLOW * 1000 / 2


def test_slow_proxy_beyond_timeout_is_a_read_timeout(lab):
    c = Checker(lab.judge_url, timeout=0.3, attempts=2)
    t0 = time.monotonic()
    r = c.check(lab.proxy("http-slow").route)
    assert (r.alive, r.error, r.attempts) == (False, "ReadTimeout", 2)
    assert time.monotonic() - t0 < 2 * SLOW


def test_transparent_proxy_leaks_client_address_in_headers(lab, checker):
    r = checker.check(lab.proxy("http-transparent").route)
    headers = json.loads(r.body)["headers"]
    assert headers["X-Forwarded-For"] == "127.0.0.1" and "Via" in headers
    r = checker.check(lab.proxy("http-anonymous").route)
    headers = json.loads(r.body)["headers"]
    assert "Via" in headers and "X-Forwarded-For" not in headers


def test_credentials_are_percent_encoded_in_the_list(lab):
    p = lab.proxy("socks5-auth")
    assert p.route.username == LAB_USER and p.route.password == LAB_PASSWORD
    assert f"socks5://magpie:p%40ss%3Aw0rd@127.0.0.5:{p.route.port}" in lab.proxy_list_text().splitlines()


def test_wrong_or_missing_credentials_are_not_alive(lab, checker):
    good = lab.proxy("socks5-auth").route
    wrong = Route(good.protocol, good.host, good.port, LAB_USER, "p@ss:w0rD")
    missing = Route(good.protocol, good.host, good.port)
    # good first: pproxy would otherwise remember 127.0.0.1 as authenticated and wave the rest through
    assert checker.check(good).alive
    for route in (wrong, missing):
        r = checker.check(route)
        assert (r.alive, r.error, r.attempts) == (False, "SOCKSError", 2), route
    assert checker.check(good).alive


def test_before_attempt_false_aborts_before_any_attempt(lab, checker):
    calls = []

    def lost(n):
        calls.append(n)
        return False

    r = checker.check(lab.proxy("http-elite").route, before_attempt=lost)
    assert (r.alive, r.error, r.attempts, r.anonymity) == (False, "Aborted", 0, None)
    assert calls == [1]


def test_before_attempt_false_between_attempts_counts_attempts_made(lab):
    c = Checker(lab.judge_url, timeout=0.3, attempts=3)  # the slow proxy times out: not final, unlike refused
    calls = []

    def lease_lost_after_two(n):
        calls.append(n)
        return n <= 2

    r = c.check(lab.proxy("http-slow").route, before_attempt=lease_lost_after_two)
    assert (r.alive, r.error, r.attempts) == (False, "Aborted", 2)
    assert calls == [1, 2, 3]


def test_before_attempt_called_once_when_first_attempt_succeeds(lab, checker):
    calls = []
    r = checker.check(lab.proxy("socks4-elite").route, before_attempt=lambda n: calls.append(n) or True)
    assert r.alive and r.attempts == 1 and calls == [1]


@pytest.mark.parametrize("name", ["http-elite", "socks4-elite", "socks5-elite", "socks5-auth"])
def test_judge_down_is_not_alive_with_a_connection_error(lab, held_port, name):
    c = Checker(f"http://127.0.0.1:{held_port}/", timeout=TIMEOUT, attempts=2)
    assert c.learn_own_address() is None
    r = c.check(lab.proxy(name).route)
    assert (r.alive, r.anonymity, r.attempts, r.status) == (False, None, 2, None), r
    assert r.error in CONNECTION_ERRORS, r


def test_judge_down_behind_a_polite_http_proxy_is_its_502(lab, held_port):
    c = Checker(f"http://127.0.0.1:{held_port}/", timeout=TIMEOUT, attempts=1)
    r = c.check(lab.proxy("http-anonymous").route)
    assert (r.alive, r.error, r.status, r.anonymity) == (False, "BadStatus", 502, None), r


def test_proxy_list_text_and_file(lab, tmp_path):
    text = lab.proxy_list_text()
    lines = text.splitlines()
    assert lines[0].startswith("# magpie lab") and lab.judge_url in lines[0]
    assert lines[1:] == [p.route.url() for p in lab.proxies]
    path = tmp_path / "lab.txt"
    lab.write_list(path)
    assert path.read_text() == text


def _raw_connect(proxy: Route, judge_port: int) -> dict:
    """CONNECT through ``proxy`` to the judge, GET / inside the tunnel, return the echo."""
    with socket.create_connection((proxy.host, proxy.port), timeout=5) as s:
        s.sendall(f"CONNECT 127.0.0.1:{judge_port} HTTP/1.1\r\nHost: 127.0.0.1:{judge_port}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(1)
        assert head.split(b" ", 2)[1] == b"200", head
        s.sendall(b"GET /tunnel HTTP/1.0\r\nHost: judge\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize("name", ["http-elite", "http-transparent"])
def test_connect_tunnels_from_the_egress_address(lab, name):
    p = lab.proxy(name)
    doc = _raw_connect(p.route, int(lab.judge_url.rsplit(":", 1)[1].strip("/")))
    assert doc["path"] == "/tunnel" and doc["remote_addr"] == p.egress
    assert "X-Forwarded-For" not in doc["headers"]  # a tunnel cannot add headers


def test_forward_proxy_refuses_disallowed_destination(lab):
    async def go():
        server = await ForwardProxy(allow=lambda host: False).start("127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"GET {lab.judge_url} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        line = await asyncio.wait_for(r.readline(), 5)
        w.close()
        server.close()
        return line

    assert asyncio.run(go()).startswith(b"HTTP/1.1 403")


def test_is_loopback_host():
    for h in ("127.0.0.1", "127.9.8.7", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback_host(h), h
    for h in ("10.0.0.1", "192.0.2.1", "::2", "example.com", "128.0.0.1", ""):
        assert not is_loopback_host(h), h


def test_taken_port_fails_start_naming_the_port():
    base = find_free_base_port()
    blocker = socket.socket()
    blocker.bind((listen_host(2), base + 2))
    blocker.listen()
    lab = Lab(base, judge_port=0)
    try:
        with pytest.raises(LabError, match=f"127.0.0.4:{base + 2}"):
            lab.start()
    finally:
        blocker.close()
    # everything started before the failure was released: the same lab starts cleanly now
    with lab:
        assert Checker(lab.judge_url, timeout=2).learn_own_address() == {"127.0.0.1"}
    lab.stop()  # idempotent


def test_dead_port_is_held_while_the_lab_runs(lab):
    dead = lab.proxy("dead").route
    with socket.socket() as s, pytest.raises(OSError):
        s.bind((dead.host, dead.port))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((dead.host, dead.port), timeout=2).close()


def test_stop_releases_every_port():
    lab = start_free_lab(slow_delay=SLOW)
    judge_port = int(lab.judge_url.rsplit(":", 1)[1].strip("/"))
    lab.stop()
    for p in lab.proxies:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((p.route.host, p.route.port))
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", judge_port))
    assert threading.active_count() < 50


def test_main_runs_until_sigterm(tmp_path):
    base = find_free_base_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        judge_port = s.getsockname()[1]
    list_file = tmp_path / "proxies.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "magpie.lab", "--base-port", str(base), "--judge-port", str(judge_port),
         "--slow-delay", "0.5", "--list-file", str(list_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )
    try:
        out = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line)
            if line.startswith("running"):
                break
        assert any(line.strip() == f"judge: http://127.0.0.1:{judge_port}/" for line in out), out
        assert list_file.read_text().splitlines()[1] == f"http://127.0.0.2:{base}"
        c = Checker(f"http://127.0.0.1:{judge_port}/", timeout=TIMEOUT, attempts=1)
        assert c.check(Route("socks5", "127.0.0.4", base + 2)).anonymity == "elite"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
