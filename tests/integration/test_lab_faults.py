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
import struct
import time
from pathlib import Path

import pytest
import requests

from helpers import TimedOut, wait_until

from magpie.checker import parse_echo
from magpie.base.crypto import get_keyring
from magpie.importer.parse import parse_lines
from magpie.lab import find_free_base_port
from magpie.lab.faults import (
    KINDS,
    TRICKLE_HEADER,
    FaultLab,
    mix_counts,
    mix_lines,
    population_lines,
    spread_lines,
    start_free_fault_lab,
)
from magpie.lab.tarpit import REAP_INTERVAL, queue_info
from magpie.base.routes import Route

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
    assert FaultLab("127.0.0.50", 30000, tarpit_ports=3).tarpit_addresses == [
        "127.0.0.50:30000", "127.0.0.50:30005", "127.0.0.50:30006"]
    with pytest.raises(ValueError):
        FaultLab("127.0.0.50", 30000, tarpit_ports=0)


# -- tarpit ------------------------------------------------------------------------------------------


def test_tarpit_accepts_and_sends_nothing(faults):
    with socket.create_connection(_hp(faults.addresses["tarpit"]), timeout=2) as s:
        s.sendall(_request())
        s.settimeout(1.0)
        with pytest.raises(socket.timeout):
            s.recv(1)  # b"" (closed) or any byte would fail too


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _abort(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_never_accepting_tarpit_keeps_clients_waiting_without_an_fd_per_connection():
    import resource

    n = 1500
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < n + 500:
        pytest.skip("file descriptor limit too low for this test")
    lab = start_free_fault_lab(host_base="127.0.0.70", slow_delay=0.1)
    socks = []
    try:
        base = _fds()
        addr = _hp(lab.addresses["tarpit"])
        for _ in range(n):
            s = socket.create_connection(addr, timeout=5)
            s.sendall(_request())
            socks.append(s)
        assert _wait_for(lambda: lab.connections()["tarpit"] == n), lab.connections()
        # the test's own sockets only (give or take a few the process opens or closes meanwhile): the lab
        # holds none per connection, which would double the count
        assert abs(_fds() - (base + n)) <= 8, (_fds(), base, n)
        poller = select.poll()  # select() cannot take fds above 1023
        for s in socks:
            poller.register(s, select.POLLIN)
        assert poller.poll(300) == []  # nothing sent, nothing closed
        for s in socks:
            _abort(s)
        socks.clear()
        # a connection its client reset stays queued until accepted: only the reaper removes it
        time.sleep(0.3)  # the behaviour under test is that nothing changes while time passes
        assert lab.connections()["tarpit"] == n
        assert lab.tarpit_stats()["reaped"] == 0
    finally:
        for s in socks:
            s.close()
        lab.stop()


def test_reaper_closes_the_oldest_queued_connections_first():
    lab = start_free_fault_lab(host_base="127.0.0.70", slow_delay=0.1, tarpit_backlog=40)
    old, new = [], []
    try:
        addr = _hp(lab.addresses["tarpit"])
        assert queue_info(lab._tarpits[0].sock) == (0, 40)
        for _ in range(30):  # 75 % of the maximum: under the reaper's threshold
            old.append(socket.create_connection(addr, timeout=5))
        for s in old:
            _abort(s)  # these clients gave up
        time.sleep(3 * REAP_INTERVAL)
        assert lab.connections()["tarpit"] == 30 and lab.tarpit_stats()["reaped"] == 0
        for _ in range(6):  # 36 > 85 % (34): reaped down to 70 % (28), oldest first
            s = socket.create_connection(addr, timeout=5)
            s.sendall(_request())
            new.append(s)
        assert _wait_for(lambda: lab.tarpit_stats()["reaped"] >= 7), lab.tarpit_stats()  # 7 if it ran at 35
        stats = lab.tarpit_stats()
        assert stats["queued"] + stats["reaped"] == 36 and 28 <= stats["queued"] <= 29, stats
        assert (stats["capacity"], stats["reaped_waiting"]) == (40, 0), stats  # only clients that gave up
        poller = select.poll()
        for s in new:
            poller.register(s, select.POLLIN)
        assert poller.poll(0) == []  # the waiting clients were not touched
    finally:
        for s in old + new:
            s.close()
        lab.stop()


def test_reaper_keeps_a_never_accepting_queue_from_filling():
    lab = start_free_fault_lab(host_base="127.0.0.70", slow_delay=0.1, tarpit_backlog=40)
    try:
        addr = _hp(lab.addresses["tarpit"])
        peak = 0
        for i in range(150):  # far more than the queue holds: every connect still completes
            s = socket.create_connection(addr, timeout=5)
            _abort(s)
            peak = max(peak, lab.connections()["tarpit"])
            if lab.connections()["tarpit"] > 34:
                assert _wait_for(lambda: lab.connections()["tarpit"] <= 28), (i, lab.tarpit_stats())
        stats = lab.tarpit_stats()
        assert peak <= 41 and stats["queued"] <= 34, (peak, stats)
        assert stats["reaped"] >= 150 - 34 and stats["reaped_waiting"] == 0, stats
    finally:
        lab.stop()


def test_tarpit_listens_on_several_ports():
    lab = start_free_fault_lab(host_base="127.0.0.70", slow_delay=0.1, tarpit_ports=3)
    try:
        assert len(lab.tarpit_addresses) == 3 and lab.tarpit_addresses[0] == lab.addresses["tarpit"]
        for address in lab.tarpit_addresses:
            with socket.create_connection(_hp(address), timeout=2) as s:
                s.sendall(_request())
        assert _wait_for(lambda: lab.tarpit_stats()["queued"] == 3), lab.tarpit_stats()
        assert lab.tarpit_stats()["listeners"] == 3
    finally:
        lab.stop()


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


def test_mix_spreads_tarpits_over_their_ports_alternating_http_and_socks5():
    tarpits = [f"127.0.0.20:{30000 + i}" for i in range(4)]
    addresses = {"tarpit": tarpits, "echo": "127.0.0.23:30003"}
    pairs = mix_lines(addresses, 1000, {"tarpit": .7, "echo": .3}, protocols={"tarpit": ("http", "socks5")})
    routes = parse_lines([line for _, line in pairs]).routes
    assert len(routes) == 1000
    tar = [r for (kind, _), r in zip(pairs, routes) if kind == "tarpit"]
    assert [r.protocol for r in tar[:4]] == ["http", "socks5", "http", "socks5"]
    per_port = {(r.port, r.protocol): 0 for r in tar}
    for r in tar:
        per_port[(r.port, r.protocol)] += 1
    assert len(per_port) == 8 and set(per_port.values()) <= {87, 88}, per_port  # every port, both protocols
    assert {r.protocol for (kind, _), r in zip(pairs, routes) if kind == "echo"} == {"http"}
    assert spread_lines(["127.0.0.23:1"], 5) == population_lines("127.0.0.23:1", 5)
    with pytest.raises(ValueError):
        spread_lines([], 1)


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


def test_runner_prints_its_addresses_and_exits_0_on_sigterm(tmp_path):
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    low = min(256, hard)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # started with a low soft fd limit (exec keeps the pid)
    stats_file = tmp_path / "stats.json"
    cmd = (f'ulimit -Sn {low} && exec "$0" -m magpie.lab.faults --host-base 127.0.0.40 --slow-delay 0.2 '
           f'--tarpit-ports 3 --stats-file {stats_file}')
    proc = subprocess.Popen(
        ["/bin/sh", "-c", cmd, sys.executable],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )
    try:
        doc = json.loads(_Lines(proc).get(20))
        assert set(doc) == {*KINDS, "tarpits", "pid"} and doc["pid"] == proc.pid
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        soft_now = next(x.split()[3] for x in limits.splitlines() if x.startswith("Max open files"))
        assert soft_now != str(low) and (hard == resource.RLIM_INFINITY or soft_now == str(hard)), limits
        base = _hp(doc["tarpit"])[1]
        for i, kind in enumerate(KINDS):
            assert doc[kind] == f"127.0.0.{40 + i}:{base + i}"
        assert doc["tarpits"] == [f"127.0.0.40:{p}" for p in (base, base + 5, base + 6)]
        with socket.create_connection(_hp(doc["tarpits"][2]), timeout=2):
            def queued():
                try:
                    return json.loads(stats_file.read_text())["tarpit"]["queued"]
                except (OSError, ValueError):
                    return None
            assert _wait_for(lambda: queued() == 1, 5), queued()
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
