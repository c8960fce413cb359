"""Checker unit and loopback tests: anonymity grading, result encoding, the judge, bad judges.

Every server here listens on 127.0.0.0/8; nothing leaves the machine.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from magpie.checker import CONNECTION_ERRORS, PROXY_HEADERS, Checker, CheckResult, classify, proxy_url
from magpie.stats.entry import decode_result, entry_fields
from magpie.checker.result import parse_echo
from magpie.checker.judge import JudgeThread, make_judge_server
from magpie.lab import start_free_lab
from magpie.base.routes import Route

OWN = {"203.0.113.9"}


# -- classify ---------------------------------------------------------------------------------------


def echo(remote="198.51.100.7", **headers):
    return {"remote_addr": remote, "headers": {"Host": "judge.example", "User-Agent": "t", **headers}}


def test_classify_without_own_address_claims_no_level():
    assert classify(echo(), set()) is None
    assert classify(echo(remote="203.0.113.9"), []) is None
    assert classify(echo(), {"", "  "}) is None


def test_classify_elite_when_nothing_reveals_a_proxy():
    assert classify(echo(), OWN) == "elite"


@pytest.mark.parametrize(
    "name", ["Via", "via", "X-FORWARDED-FOR", "Forwarded", "X-Real-IP", "Proxy-Connection"]
)
def test_classify_anonymous_on_any_proxy_header_case_insensitive(name):
    assert classify(echo(**{name: "10.1.2.3"}), OWN) == "anonymous"


def test_proxy_headers_cover_the_usual_names():
    for h in ("via", "x-forwarded-for", "forwarded", "x-real-ip", "x-proxy-id", "proxy-connection",
              "x-forwarded-host", "x-forwarded-proto", "client-ip", "x-client-ip", "x-originating-ip",
              "forwarded-for", "x-cluster-client-ip"):
        assert h in PROXY_HEADERS
    assert "user-agent" not in PROXY_HEADERS and "host" not in PROXY_HEADERS


def test_classify_transparent_when_judge_sees_own_address():
    assert classify(echo(remote="203.0.113.9"), OWN) == "transparent"


def test_classify_transparent_on_own_address_inside_comma_list():
    e = echo(**{"X-Forwarded-For": "10.0.0.1,  203.0.113.9 , 10.0.0.2", "Via": "1.1 p"})
    assert classify(e, OWN) == "transparent"
    # the same list without the own address only reveals a proxy
    e = echo(**{"X-Forwarded-For": "10.0.0.1, 203.0.113.99"})
    assert classify(e, OWN) == "anonymous"


def test_classify_transparent_in_any_header_value_with_port():
    assert classify(echo(**{"X-Something": "client=x 203.0.113.9:5123"}), OWN) == "transparent"


def test_classify_forwarded_for_pairs_and_ipv6_own_address():
    own = {"2001:DB8:0:0::17"}  # non-canonical spelling on purpose
    e = echo(**{"Forwarded": 'for=192.0.2.60;proto=http;by=203.0.113.43, for="[2001:db8::17]:4711"'})
    assert classify(e, own) == "transparent"
    assert classify(echo(remote="2001:db8::17"), own) == "transparent"
    assert classify(echo(remote="2001:db8::18"), own) == "elite"


def test_classify_forwarded_by_and_host_do_not_count_as_the_client():
    e = echo(**{"Forwarded": "by=203.0.113.9;host=203.0.113.9"})
    assert classify(e, OWN) == "anonymous"


def test_classify_ipv4_mapped_ipv6_matches_ipv4_own_address():
    assert classify(echo(remote="::ffff:203.0.113.9"), OWN) == "transparent"
    assert classify(echo(remote="198.51.100.7"), {"::ffff:198.51.100.7"}) == "transparent"


def test_classify_ignores_the_judges_own_host_header():
    # loopback lab: the judge is 127.0.0.1 like the checker; its Host header is not a leak
    e = {"remote_addr": "127.0.0.102", "headers": {"Host": "127.0.0.1:8899", "X-Forwarded-Host": "127.0.0.1"}}
    assert classify(e, {"127.0.0.1"}) == "anonymous"
    e["headers"].pop("X-Forwarded-Host")
    assert classify(e, {"127.0.0.1"}) == "elite"


def test_classify_tolerates_odd_types():
    assert classify({"remote_addr": None, "headers": ["x"]}, OWN) == "elite"
    assert classify({"headers": {"Via": None}}, OWN) == "anonymous"
    assert classify({"remote_addr": "203.0.113.9", "headers": None}, OWN) == "transparent"


# -- CheckResult fields -----------------------------------------------------------------------------


def _alive_result():
    return CheckResult(
        True, 123.456, 200, 1, None, '{"remote_addr":"x"}', "elite", "http://127.0.0.1:1/", 1_700_000_000_123,
        exit_ip="127.0.0.7",
    )


def _dead_result():
    return CheckResult(
        False, None, None, 2, "ConnectTimeout", None, None, "http://127.0.0.1:1/", 1_700_000_000_999
    )


@pytest.mark.parametrize("result", [_alive_result(), _dead_result()])
def test_fields_round_trip(result):
    f = entry_fields(result)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in f.items())
    assert set(f) == {
        "alive", "latency_ms", "status", "attempts", "error", "body", "anonymity", "judge", "checked_at_ms"
    } | ({"exit_ip"} if result.exit_ip else set())  # written only when the judge echoed an address
    assert decode_result(f) == result
    # as redis-py returns them: bytes keys and values, plus fields added by other writers
    raw = {k.encode(): v.encode() for k, v in f.items()} | {b"route": b"abc"}
    assert decode_result(raw) == result


def test_fields_encoding_details():
    f = entry_fields(_dead_result())
    assert f["alive"] == "0" and f["latency_ms"] == "" and f["status"] == "" and f["anonymity"] == ""
    f = entry_fields(_alive_result())
    assert f["alive"] == "1" and f["latency_ms"] == "123.456" and f["checked_at_ms"] == "1700000000123"


@pytest.mark.parametrize(
    "change",
    [
        {"alive": "yes"},
        {"attempts": "two"},
        {"latency_ms": "nan"},
        {"latency_ms": "-1"},
        {"status": "2x"},
        {"anonymity": "stealthy"},
        {"checked_at_ms": "12.5"},
        {"judge": ""},
        {"body": b"\xff\xfe"},
        {"exit_ip": "not-an-address"},
        {"exit_ip": "1" * 100},
    ],
)
def test_from_fields_rejects_malformed(change):
    f = entry_fields(_alive_result()) | change
    with pytest.raises(ValueError):
        decode_result(f)


def test_an_entry_without_exit_ip_reads_back_as_none_and_exit_ip_is_normalized():
    f = entry_fields(_alive_result())
    del f["exit_ip"]  # as published before the field existed
    assert decode_result(f).exit_ip is None
    assert decode_result(f | {"exit_ip": "::ffff:127.0.0.7"}).exit_ip == "127.0.0.7"


def test_from_fields_rejects_missing_field():
    f = entry_fields(_alive_result())
    del f["attempts"]
    with pytest.raises(ValueError, match="attempts"):
        decode_result(f)


# -- helpers ----------------------------------------------------------------------------------------


def test_proxy_url_schemes_and_encoding():
    assert proxy_url(Route("http", "127.0.0.2", 8080)) == "http://127.0.0.2:8080"
    assert proxy_url(Route("https", "127.0.0.2", 8080)) == "http://127.0.0.2:8080"
    assert proxy_url(Route("socks4", "127.0.0.2", 1080)) == "socks4://127.0.0.2:1080"
    assert proxy_url(Route("socks5", "::1", 1080, "u", "p@ss:w0rd")) == "socks5h://u:p%40ss%3Aw0rd@[::1]:1080"
    with pytest.raises(ValueError):
        proxy_url(Route("ftp", "127.0.0.2", 21))


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"[1,2]", b'{"remote_addr": 5, "headers": {}}', b'{"remote_addr": "x"}',
     b'{"remote_addr": "x", "headers": []}', b"\xff\xfe{}", b"[" * 50000],
)
def test_parse_echo_rejects_garbage(raw):
    assert parse_echo(raw) is None


def test_checker_rejects_bad_settings():
    with pytest.raises(ValueError):
        Checker("http://127.0.0.1:1/", timeout=0)
    with pytest.raises(ValueError):
        Checker("http://127.0.0.1:1/", attempts=0)
    with pytest.raises(ValueError):
        Checker("http://127.0.0.1:1/", body_cap=-1)


def test_unsupported_protocol_is_a_result_not_a_crash():
    r = Checker("http://127.0.0.1:1/").check(Route("ftp", "127.0.0.2", 21))
    assert (r.alive, r.error, r.attempts) == (False, "UnsupportedProtocol", 0)


# -- the judge --------------------------------------------------------------------------------------


@pytest.fixture(params=["threaded", "event-loop"])
def judge(request):
    """Both judge servers: the threaded one and JudgeProtocol on uvloop must answer alike."""
    if request.param == "event-loop":
        j = JudgeThread("127.0.0.1", 0)
        yield j.url.rstrip("/")
        j.stop()
        return
    server = make_judge_server("127.0.0.1", 0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_judge_echoes_remote_address_path_and_headers(judge):
    with requests.Session() as s:
        s.trust_env = False
        r = s.get(judge + "/some/path?q=1", headers={"X-Test": "hello", "Via": "1.1 x"}, timeout=5)
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "application/json"
    doc = r.json()
    assert doc["remote_addr"] == "127.0.0.1"
    assert isinstance(doc["remote_port"], int) and doc["remote_port"] > 0
    assert doc["method"] == "GET" and doc["path"] == "/some/path?q=1"
    assert doc["headers"]["X-Test"] == "hello" and doc["headers"]["Via"] == "1.1 x"
    assert parse_echo(r.content) == doc


def test_judge_joins_repeated_headers(judge):
    port = int(judge.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\nX-Forwarded-For: 10.0.0.1\r\nx-forwarded-for: 10.0.0.2\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    doc = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert doc["headers"] == {"X-Forwarded-For": "10.0.0.1, 10.0.0.2"}


def test_judge_refuses_other_methods_and_garbage(judge):
    with requests.Session() as s:
        s.trust_env = False
        assert s.post(judge + "/", data=b"x", timeout=5).status_code == 501
        r = s.head(judge + "/h", timeout=5)
        assert r.status_code == 200 and r.content == b"" and int(r.headers["Content-Length"]) > 0
    port = int(judge.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0 extra\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert b"400" in data and b'"remote_addr"' not in data  # the threaded one answers it HTTP/0.9-style


def test_run_judge_serves_on_uvloop_and_stops_on_sigterm():
    import os
    import re
    import signal
    import subprocess
    import sys

    code = "from magpie.checker.judge import run_judge; run_judge('127.0.0.1', 0)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.match(r"judge listening on (http://127\.0\.0\.1:\d+/)$", line.strip())
        assert m, line
        with requests.Session() as s:
            s.trust_env = False
            assert s.get(m.group(1) + "p", timeout=5).json()["path"] == "/p"
        assert "uvloop" in open(f"/proc/{proc.pid}/maps").read()  # the loop is uvloop's
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_learn_own_address_direct_and_cached(judge):
    c = Checker(judge + "/", timeout=2)
    assert c.own_addresses is None
    assert c.learn_own_address() == {"127.0.0.1"}
    assert c.own_addresses == frozenset({"127.0.0.1"})


# -- bad judges, reached through a real lab proxy ---------------------------------------------------


class _BadJudge(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        status, body = {
            "/garbage": (200, b"<html>" + b"x" * 10000),
            "/down": (503, b"busy"),
            "/nat": (200, b'{"remote_addr": "198.51.100.1", "headers": {}}'),  # as if seen through NAT
        }[self.path]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def lab():
    lab = start_free_lab(slow_delay=1.0)
    yield lab
    lab.stop()


@pytest.fixture
def bad_judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BadJudge)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_garbage_body_is_bad_echo_and_body_is_capped(lab, bad_judge):
    c = Checker(bad_judge + "/garbage", timeout=2, attempts=2, body_cap=100, own_addresses={"127.0.0.1"})
    r = c.check(lab.proxy("http-elite").route)
    assert (r.alive, r.status, r.error, r.attempts, r.anonymity) == (False, 200, "BadEcho", 2, None)
    assert r.body == "<html>" + "x" * 94


def test_non_200_is_bad_status(lab, bad_judge):
    c = Checker(bad_judge + "/down", timeout=2, attempts=1)
    r = c.check(lab.proxy("socks5-elite").route)
    assert (r.alive, r.status, r.error, r.latency_ms) == (False, 503, "BadStatus", None)
    assert r.body == "busy"


def test_learn_own_address_keeps_echoed_and_local_address(bad_judge):
    c = Checker(bad_judge + "/nat", timeout=2)
    assert c.learn_own_address() == {"198.51.100.1", "127.0.0.1"}
    e = {"remote_addr": "127.0.0.50", "headers": {"X-Forwarded-For": "127.0.0.1"}}
    assert classify(e, c.own_addresses) == "transparent"


def test_connection_error_classes_are_named():
    assert {"ConnectTimeout", "ProxyError", "SOCKSError", "ConnectionError"} <= CONNECTION_ERRORS
