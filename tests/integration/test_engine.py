"""The asyncio check engine against real fault servers on loopback: deadlines hold, nothing blocks anything.

The fault lab (``magpie.lab.faults``) serves a tarpit (accepts, never answers), a trickle proxy (one header
byte a second), a slow proxy, a cheap echo proxy and a refused port.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import pytest

from helpers import TimedOut, await_until

from magpie.checker import CheckEngine, Checker
from magpie.lab.faults import FaultLab
from magpie.base.routes import Route


@pytest.fixture(scope="module")
def faults():
    with FaultLab(slow_delay=1.0) as lab:
        yield lab


def route(faults, kind, protocol="http", user=None):
    host, port = faults.hostport(kind)
    return Route(protocol, host, port, user, "x" if user else None)


def judge_of(faults):
    return f"http://{faults.judge_host}:{faults.judge_port}/"


def engine(faults, **kw):
    kw.setdefault("own_addresses", {"127.0.0.1"})
    return CheckEngine(judge_of(faults), **kw)


def run(coro):
    return asyncio.run(coro)


def test_trickle_proxy_is_cut_at_the_attempt_deadline(faults):
    # each read gets a byte within a second, so only a deadline over the whole attempt can stop it
    eng = engine(faults, timeout=2.0, attempts=1)
    t0 = time.monotonic()
    res = run(eng.check(route(faults, "trickle")))
    took = time.monotonic() - t0
    assert (res.alive, res.error, res.attempts) == (False, "ReadTimeout", 1)
    assert 1.9 <= took < 3.0, took


def test_a_check_never_outlives_attempts_times_deadline(faults):
    eng = engine(faults, timeout=0.5, attempts=3)
    t0 = time.monotonic()
    res = run(eng.check(route(faults, "trickle")))
    assert res.attempts == 3 and res.error == "ReadTimeout"
    assert time.monotonic() - t0 < eng.max_check_seconds


def test_tarpit_is_a_read_timeout_at_the_deadline_for_http_and_for_a_socks5_handshake(faults):
    eng = engine(faults, timeout=0.6, attempts=1, connect_timeout=0.3)

    async def both():
        return await asyncio.gather(eng.check(route(faults, "tarpit")),
                                    eng.check(route(faults, "tarpit", "socks5")))

    http, socks = run(both())
    assert (http.alive, http.error) == (False, "ReadTimeout")
    assert (socks.alive, socks.error) == (False, "ReadTimeout")  # the SOCKS handshake never finished
    assert socks.connect_ms is not None and socks.handshake_ms is None, socks


def test_refused_connection_is_final_within_the_cycle(faults):
    eng = engine(faults, timeout=2.0, attempts=3)
    for protocol, error in (("http", "ProxyError"), ("socks5", "SOCKSError"), ("socks4", "SOCKSError")):
        res = run(eng.check(route(faults, "refused", protocol)))
        assert (res.alive, res.error, res.attempts) == (False, error, 1), protocol


def test_echo_proxy_is_alive_and_graded_through_http_and_socks5(faults):
    eng = engine(faults, timeout=2.0, attempts=1)
    for protocol in ("http", "socks5"):
        res = run(eng.check(route(faults, "echo", protocol, user="u1")))
        assert (res.alive, res.status, res.error, res.anonymity) == (True, 200, None, "elite"), protocol
        assert res.latency_ms is not None and res.latency_ms > 0


def test_one_trickle_route_does_not_hold_back_healthy_ones(faults):
    eng = engine(faults, timeout=3.0, attempts=1)
    done: dict[str, float] = {}

    async def go():
        t0 = time.monotonic()

        async def one(name, r):
            res = await eng.check(r)
            done[name] = time.monotonic() - t0
            return res

        jobs = [one("trickle", route(faults, "trickle"))]
        jobs += [one(f"echo{i}", route(faults, "echo", user=f"u{i}")) for i in range(200)]
        return await asyncio.gather(*jobs)

    results = run(go())
    assert sum(r.alive for r in results) == 200
    assert max(v for k, v in done.items() if k != "trickle") < 2.0  # all healthy ones finished long before
    assert done["trickle"] >= 2.9


def test_thousands_of_tarpit_checks_are_in_flight_at_once(faults):
    eng = engine(faults, timeout=2.0, attempts=1)
    n = 2000
    before = faults.connections()["tarpit"]

    async def go():
        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(eng.check(route(faults, "tarpit", user=f"u{i}"))) for i in range(n)]
        with contextlib.suppress(TimedOut):  # within the 2 s deadline; the count is asserted below
            await await_until(lambda: faults.connections()["tarpit"] - before >= n, timeout=1.5,
                              what="every check's socket held")
        held = faults.connections()["tarpit"] - before
        results = await asyncio.gather(*tasks)
        return held, results, time.monotonic() - t0

    held, results, took = run(go())
    assert held >= 0.95 * n, held  # every check holds its socket at the same time
    assert all(r.error == "ReadTimeout" for r in results), Counter(r.error for r in results)
    assert took < 4.0, took  # one deadline for all of them, not n deadlines


def test_cancelling_a_check_stops_the_attempt_in_flight(faults):
    eng = engine(faults, timeout=30.0, attempts=1)

    async def go():
        before = faults.connections()["tarpit"]
        task = asyncio.ensure_future(eng.check(route(faults, "tarpit")))
        await await_until(lambda: faults.connections()["tarpit"] > before, timeout=5,
                          what="the attempt in flight")
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - t0

    assert run(go()) < 0.5


def test_judge_reachable_is_false_for_a_refused_judge_and_shared_by_callers(faults):
    host, port = faults.hostport("refused")
    eng = CheckEngine(f"http://{host}:{port}/", timeout=1.0, attempts=1)

    async def go():
        return await asyncio.gather(*(eng.judge_reachable() for _ in range(50)))

    assert run(go()) == [False] * 50


def test_sync_checker_checks_many_in_order(faults):
    c = Checker(judge_of(faults), timeout=1.0, attempts=1, own_addresses={"127.0.0.1"})
    try:
        kinds = ["echo", "refused", "echo", "tarpit"]
        res = c.check_many([route(faults, k, user=f"u{i}") for i, k in enumerate(kinds)], concurrency=10)
    finally:
        c.close()
    assert [r.alive for r in res] == [True, False, True, False]
    assert [r.error for r in res] == [None, "ProxyError", None, "ReadTimeout"]


@pytest.mark.parametrize("host", ["169.254.169.254", "10.0.0.1", "192.168.1.1", "fd00::1", "2002:a9fe:a9fe::1",
                                  "localhost"])
def test_egress_guard_refuses_before_any_connection(host, monkeypatch):
    from magpie.base.egress import EgressPolicy

    dialed = []

    async def no_dial(*a, **kw):
        dialed.append(a)
        raise AssertionError("a refused destination was dialed")

    monkeypatch.setattr(asyncio, "open_connection", no_dial)
    eng = CheckEngine("http://8.8.8.8/", timeout=1.0, attempts=2, own_addresses={"127.0.0.1"},
                      egress=EgressPolicy())
    for protocol in ("http", "socks4", "socks5"):
        res = asyncio.run(eng.check(Route(protocol, host, 3128)))
        assert (res.alive, res.error, res.attempts) == (False, "EgressRefused", 1), (protocol, res)
    assert dialed == []


def test_egress_guard_refuses_a_private_judge_too(faults):
    from magpie.base.egress import EgressPolicy

    eng = CheckEngine(judge_of(faults), timeout=1.0, attempts=1, own_addresses={"127.0.0.1"},
                      egress=EgressPolicy("127.0.0.20/30"))  # the echo proxy is allowed, the judge is not
    res = run(eng.check(route(faults, "echo", user="u1")))
    assert res.error == "EgressRefused"
    assert run(eng.judge_reachable(max_age=0)) is False


def test_credentials_a_proxy_forwards_to_the_judge_are_masked_in_the_stored_body(faults):
    import base64

    eng = engine(faults, timeout=2.0, attempts=1)
    r = Route("http", *faults.hostport("echo"), "leaky-user", "Sup3r-Secret")
    token = base64.b64encode(b"leaky-user:Sup3r-Secret").decode()
    raw = ('{"remote_addr": "127.0.0.23", "headers": {"Proxy-Authorization": "Basic %s", "X": "Sup3r-Secret"}}'
           % token).encode()
    body = eng._body(raw, r)
    assert token not in body and "Sup3r-Secret" not in body and body.count("***") == 2
