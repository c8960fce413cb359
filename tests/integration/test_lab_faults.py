"""The lab's fault servers (magpie.lab.faults), exercised for real over loopback, and the populations."""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from helpers import TimedOut, wait_until

from magpie.checker import parse_echo
from magpie.crypto import get_keyring
from magpie.importer.parse import parse_lines
from magpie.lab import find_free_base_port
from magpie.lab.faults import (
    KINDS,
    TRICKLE_HEADER,
    FaultLab,
    mix_counts,
    mix_lines,
    population_lines,
    start_free_fault_lab,
)
from magpie.routes import Route

SLOW = 1.0
REPO = Path(__file__).resolve().parents[2]
JUDGE = "127.0.0.1:8899"


@pytest.fixture(scope="module")
def faults():
    lab = start_free_fault_lab(slow_delay=SLOW)
    yield lab
    lab.stop()


def _hp(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _request(path: str = "/x?y=1") -> bytes:
    return (f"GET http://{JUDGE}{path} HTTP/1.1\r\nHost: {JUDGE}\r\n"
            "Proxy-Authorization: Basic dTE6eA==\r\nUser-Agent: t\r\n\r\n").encode()


def _read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _get(url: str, proxy: str, timeout: float = 3.0) -> requests.Response:
    """GET ``url`` through ``proxy`` with environment proxy settings ignored."""
    with requests.Session() as session:
        session.trust_env = False
        return session.get(url, proxies={"http": proxy}, timeout=timeout)


def _wait_for(pred, timeout: float = 3.0) -> bool:
    try:
        return bool(wait_until(pred, timeout=timeout, interval=0.02))
    except TimedOut:
        return False


# -- layout ------------------------------------------------------------------------------------------


def test_layout_addresses():
    lab = FaultLab("127.0.0.50", 30000)
    assert lab.addresses == {
        "tarpit": "127.0.0.50:30000", "trickle": "127.0.0.51:30001", "slow": "127.0.0.52:30002",
        "echo": "127.0.0.53:30003", "refused": "127.0.0.54:30004",
    }
    for bad in ("10.0.0.1", "127.255.255.252", "::1", "nope"):
        with pytest.raises(ValueError):
            FaultLab(bad, 30000)


# -- tarpit ------------------------------------------------------------------------------------------


def test_tarpit_accepts_and_sends_nothing(faults):
    with socket.create_connection(_hp(faults.addresses["tarpit"]), timeout=2) as s:
        s.sendall(_request())
        s.settimeout(1.0)
        with pytest.raises(socket.timeout):
            s.recv(1)  # b"" (closed) or any byte would fail too


def test_tarpit_holds_many_connections_and_releases_them(faults):
    import resource

    n = 2000
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2 * n + 500:
        pytest.skip("file descriptor limit too low for this test")
    addr = _hp(faults.addresses["tarpit"])
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(addr, timeout=5))
        assert _wait_for(lambda: faults.connections()["tarpit"] >= n), faults.connections()
        poller = select.poll()  # select() cannot take fds above 1023
        for s in socks:
            poller.register(s, select.POLLIN)
        assert poller.poll(300) == []  # 300 ms: nothing sent, nothing closed (returns at the first event)
    finally:
        for s in socks:
            s.close()
    assert _wait_for(lambda: faults.connections()["tarpit"] == 0), faults.connections()


# -- trickle -----------------------------------------------------------------------------------------


def test_trickle_sends_status_line_then_a_byte_a_second(faults):
    with socket.create_connection(_hp(faults.addresses["trickle"]), timeout=2) as s:
        s.sendall(_request())
        status = b""
        t0 = time.monotonic()
        while len(status) < 17:
            status += s.recv(17 - len(status))
        assert status == b"HTTP/1.1 200 OK\r\n" and time.monotonic() - t0 < 0.9
        got = b""
        end = time.monotonic() + 2.6
        while (left := end - time.monotonic()) > 0:
            if select.select([s], [], [], left)[0]:
                chunk = s.recv(100)
                assert chunk, "trickle closed the connection"
                got += chunk
        assert 2 <= len(got) <= 4, got
        assert got == TRICKLE_HEADER[: len(got)]
        assert faults.connections()["trickle"] >= 1


# -- slow and echo -----------------------------------------------------------------------------------


def test_slow_answers_an_echo_after_its_delay(faults):
    host, port = _hp(faults.addresses["slow"])
    t0 = time.monotonic()
    r = _get(f"http://{JUDGE}/slow", f"http://u1:x@{host}:{port}", 5)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200 and SLOW <= elapsed < SLOW + 2
    doc = parse_echo(r.content)
    assert doc is not None and doc["remote_addr"] == host != "127.0.0.1"


def test_echo_over_a_plain_socket(faults):
    host, port = _hp(faults.addresses["echo"])
    with socket.create_connection((host, port), timeout=2) as s:
        s.sendall(_request("/a/b?c=d"))
        data = _read_all(s)  # the server closes after one answer
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK"
    assert f"Content-Length: {len(body)}" in lines and "Connection: close" in lines
    doc = parse_echo(body)
    assert doc is not None, body
    assert doc["remote_addr"] == host and doc["remote_addr"] != "127.0.0.1"
    assert doc["method"] == "GET" and doc["path"] == "/a/b?c=d"
    assert doc["headers"]["Host"] == JUDGE and doc["headers"]["User-Agent"] == "t"
    assert not any(k.lower().startswith("proxy-") for k in doc["headers"])


@pytest.mark.parametrize("user", ["u1", "u2"])
def test_echo_through_requests_accepts_any_credentials(faults, user):
    host, port = _hp(faults.addresses["echo"])
    r = _get(f"http://{JUDGE}/r", f"http://{user}:x@{host}:{port}")
    assert r.status_code == 200
    doc = parse_echo(r.content)
    assert doc is not None and doc["remote_addr"] == host != "127.0.0.1" and doc["path"] == "/r"
    assert "Proxy-Authorization" not in doc["headers"]


@pytest.mark.parametrize("scheme", ["socks5h://u7:secret@", "socks5://", "socks4://", "socks4a://"])
def test_echo_over_socks(faults, scheme):
    host, port = _hp(faults.addresses["echo"])
    proxy = f"{scheme}{host}:{port}"
    r = _get(f"http://{JUDGE}/s", proxy, 3)
    doc = parse_echo(r.content)
    assert r.status_code == 200 and doc is not None
    assert doc["remote_addr"] == host and doc["path"] == "/s" and doc["headers"]["Host"] == JUDGE


def test_echo_rejects_garbage(faults):
    with socket.create_connection(_hp(faults.addresses["echo"]), timeout=2) as s:
        s.sendall(b"POST http://x/ HTTP/1.1\r\n\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 405")
    with socket.create_connection(_hp(faults.addresses["echo"]), timeout=2) as s:
        s.sendall(b"nonsense\r\n\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 400")


# -- refused -----------------------------------------------------------------------------------------


def test_refused_refuses_and_its_port_is_held(faults):
    host, port = _hp(faults.addresses["refused"])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, port), timeout=2).close()
    with socket.socket() as s, pytest.raises(OSError):
        s.bind((host, port))


def test_stop_releases_every_port():
    lab = start_free_fault_lab(host_base="127.0.0.60", slow_delay=0.1)
    addresses = lab.addresses
    with socket.create_connection(_hp(addresses["tarpit"]), timeout=2):
        assert _wait_for(lambda: lab.connections()["tarpit"] == 1)
        lab.stop()
    for address in addresses.values():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(_hp(address))
    lab.stop()  # idempotent


# -- populations -------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "socks5"])
def test_population_lines_are_distinct_routes(protocol):
    n = 3000
    lines = population_lines("127.0.0.23:31000", n, protocol)
    parsed = parse_lines(lines)
    assert (parsed.valid, parsed.duplicates, parsed.skipped, parsed.invalid) == (n, 0, 0, [])
    assert {(r.protocol, r.host, r.port) for r in parsed.routes} == {(protocol, "127.0.0.23", 31000)}
    keyring = get_keyring("a test secret of 16+ characters")
    assert len({keyring.route_hash(r) for r in parsed.routes}) == n
    # disjoint index ranges are disjoint routes
    more = parse_lines(population_lines("127.0.0.23:31000", 10, protocol, start=n)).routes
    assert not {keyring.route_hash(r) for r in more} & {keyring.route_hash(r) for r in parsed.routes}
    assert population_lines("127.0.0.23:1", 0) == []
    with pytest.raises(ValueError):
        population_lines("127.0.0.23:1", 1, "ftp")


def test_mix_lines_is_deterministic_spread_and_distinct():
    lab = FaultLab("127.0.0.20", 30000)
    shares = {"tarpit": .70, "refused": .10, "echo": .15, "slow": .05}
    pairs = mix_lines(lab.addresses, 1000, shares)
    assert pairs == mix_lines(lab.addresses, 1000, shares)
    counts = {k: sum(1 for kind, _ in pairs if kind == k) for k in shares}
    assert counts == {"tarpit": 700, "refused": 100, "echo": 150, "slow": 50} == mix_counts(1000, shares)
    routes = parse_lines([line for _, line in pairs]).routes
    assert len(routes) == 1000
    for (kind, _), route in zip(pairs, routes):
        assert route.hostport == lab.addresses[kind]
    first = [kind for kind, _ in pairs[:100]]  # spread evenly, not in blocks
    assert 65 <= first.count("tarpit") <= 75 and 3 <= first.count("slow") <= 7
    assert sum(mix_counts(7, {"a": 1, "b": 1, "c": 1}).values()) == 7
    with pytest.raises(KeyError):
        mix_lines({"echo": "127.0.0.23:1"}, 10, {"echo": .5, "tarpit": .5})


# -- runners -----------------------------------------------------------------------------------------


class _Lines:
    """Lines of a subprocess's stdout, read by a daemon thread; ``get`` returns "" on timeout or EOF."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._q.put(line)
        self._q.put("")

    def get(self, timeout: float) -> str:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return ""


def test_runner_prints_its_addresses_and_exits_0_on_sigterm():
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    low = min(256, hard)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # started with a low soft fd limit (exec keeps the pid)
    cmd = f'ulimit -Sn {low} && exec "$0" -m magpie.lab.faults --host-base 127.0.0.40 --slow-delay 0.2'
    proc = subprocess.Popen(
        ["/bin/sh", "-c", cmd, sys.executable],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )
    try:
        doc = json.loads(_Lines(proc).get(20))
        assert set(doc) == {*KINDS, "pid"} and doc["pid"] == proc.pid
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        soft_now = next(x.split()[3] for x in limits.splitlines() if x.startswith("Max open files"))
        assert soft_now != str(low) and (hard == resource.RLIM_INFINITY or soft_now == str(hard)), limits
        base = _hp(doc["tarpit"])[1]
        for i, kind in enumerate(KINDS):
            assert doc[kind] == f"127.0.0.{40 + i}:{base + i}"
        host, port = _hp(doc["echo"])
        r = _get(f"http://{JUDGE}/", f"http://u1:x@{host}:{port}")
        assert parse_echo(r.content)["remote_addr"] == "127.0.0.43"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(_hp(doc["refused"]), timeout=2).close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_magpie_lab_with_faults_prints_and_serves_them():
    base = find_free_base_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        judge_port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "magpie.lab", "--base-port", str(base), "--judge-port", str(judge_port),
         "--slow-delay", "0.2", "--faults"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )
    try:
        out, lines = [], _Lines(proc)
        while (line := lines.get(20)) and not line.startswith("running"):
            out.append(line)
        faults_lines = [x for x in out if x.startswith("faults: ")]
        assert len(faults_lines) == 1, out
        doc = json.loads(faults_lines[0].split(" ", 1)[1])
        assert doc["tarpit"] == f"127.0.0.20:{base + 8}" and doc["refused"] == f"127.0.0.24:{base + 12}"
        listed = parse_lines([x for x in out if x.startswith(("http://", "socks"))]).routes
        assert sorted(r.host for r in listed) == [f"127.0.0.{i}" for i in range(2, 10)]  # faults not listed
        host, port = _hp(doc["echo"])
        r = _get(f"http://127.0.0.1:{judge_port}/", f"http://{host}:{port}")
        assert parse_echo(r.content)["remote_addr"] == host
        # the ordinary lab still works next to it
        r = _get(f"http://127.0.0.1:{judge_port}/", Route("http", "127.0.0.2", base).url(), 3)
        assert parse_echo(r.content)["remote_addr"] == "127.0.0.102"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
