"""Rate limits on real Redis: the token bucket script, block grabbing, the judge limiter against a
loopback judge that counts its requests, the per-workspace budget at promote, the rotator's client rate,
and the exported counters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import threading
import time

import pytest
import redis

from helpers import elapse, run_concurrently, wait_until

from magpie.checker.check import LoopThread
from magpie.checker.engine import CheckEngine
from magpie.checker.judge import JudgeHandler, JudgeServer
from magpie.base.counters import read_counters
from magpie.lab.forward import ForwardProxy
from magpie.coordination.ratelimit import BlockLimiter, TokenBucket, WorkspaceBudget, bucket_key, take_many
from magpie.base.routes import Route

REDIS_URL = "redis://127.0.0.1:6379/15"


# -- the bucket ---------------------------------------------------------------------------------------------

def _drain(key: str, rate: float, burst: float, n: int) -> int:
    """Take single tokens ``n`` times from a fresh client; returns how many were granted."""
    r = redis.Redis.from_url(REDIS_URL)
    try:
        b = TokenBucket(r, key, rate, burst)
        return sum(b.take(1)[0] for _ in range(n))
    finally:
        r.close()


def test_bucket_is_atomic_under_concurrent_threads(redis_client, redis_prefix):
    key = bucket_key(redis_prefix, "test", "threads")
    # 16 threads x 40 takes = 640 asks of a 200-token bucket refilling 1 token per 1000 s: exactly 200 pass
    results, errors = run_concurrently(lambda: _drain(key, 0.001, 200, 40), 16)
    assert not errors
    assert sum(results) == 200


def test_bucket_is_atomic_under_concurrent_processes(redis_prefix):
    key = bucket_key(redis_prefix, "test", "procs")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        got = pool.starmap(_drain, [(key, 0.001, 150, 60)] * 4)
    assert sum(got) == 150
    assert all(0 <= g <= 60 for g in got)


def test_bucket_refills_at_its_rate_and_never_above_burst(redis_client, redis_prefix):
    b = TokenBucket(redis_client, bucket_key(redis_prefix, "test", "refill"), rate=40.0, burst=10)
    assert b.take(100)[0] == 10  # a new bucket starts full, capped at burst
    granted, wait_s = b.take(1)
    assert granted == 0 and 0 < wait_s <= 0.03  # next token in 1/40 s
    t0 = time.monotonic()
    elapse(0.2)  # refill over time is the behaviour under test
    got = b.take(100)[0]
    dt = time.monotonic() - t0
    assert 7 <= got <= min(10, int(40 * dt) + 1)  # 40/s over ~0.2 s: ~8 tokens
    elapse(0.5)  # far more than burst / rate: the bucket is full again, not fuller
    assert b.take(100)[0] == 10


def test_block_grab_and_give_back(redis_client, redis_prefix):
    key = bucket_key(redis_prefix, "test", "block")
    (g1, _), (g2, _) = take_many(redis_client, [(key, 0.001, 100, 64), (key, 0.001, 100, 64)])
    assert (g1, g2) == (64, 36)
    take_many(redis_client, [(key, 0.001, 100, -30)])  # unused tokens handed back
    assert take_many(redis_client, [(key, 0.001, 100, 100)])[0][0] == 30
    with pytest.raises(ValueError):
        take_many(redis_client, [(key, 0, 100, 1)])


def test_block_limiter_spends_blocks_locally(redis_client, redis_prefix):
    lim = BlockLimiter(redis_client, redis_prefix, "judge", block=50)

    async def run():
        return await asyncio.gather(*(lim.acquire("j", 1_000_000.0, asyncio.get_running_loop().time() + 5)
                                      for _ in range(1000)))

    try:
        assert all(asyncio.run(run()))
        assert lim.calls <= 1000 // 50 + 5  # one Redis call per block, not per token
    finally:
        lim.close()


def test_block_limiter_hands_back_when_the_deadline_is_too_close(redis_client, redis_prefix):
    lim = BlockLimiter(redis_client, redis_prefix, "judge", block=10)

    async def run():
        loop = asyncio.get_running_loop()
        until = loop.time() + 0.3
        return await asyncio.gather(*(lim.acquire("slow", 10.0, until) for _ in range(40)))

    try:
        got = asyncio.run(run())
        assert 10 <= sum(got) <= 14  # burst 10 plus ~3 refilled in 0.3 s
        lim.flush()
        c = read_counters(redis_client, redis_prefix)["limited"]
        assert c[("judge", "handed_back")] == 40 - sum(got)
        # those that could not make it even after the queue ahead of them were handed back at once
        assert sum(got) <= c[("judge", "waited")] < 40
    finally:
        lim.close()


# -- the judge limiter, end to end through a proxy ---------------------------------------------------------

class _CountingHandler(JudgeHandler):
    def do_GET(self):  # noqa: N802
        self.server.hits.append(time.monotonic())
        super().do_GET()


@pytest.fixture
def counting_judge():
    server = JudgeServer(("127.0.0.1", 0), _CountingHandler)
    server.hits = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def forward_proxy():
    loop = LoopThread("test-proxy")
    p = ForwardProxy()
    server = loop.run(p.start("127.0.0.1", 0))
    yield server.sockets[0].getsockname()[1]
    server.close()
    loop.stop()


def _max_in_window(hits: list[float], window: float) -> int:
    hits = sorted(hits)
    best, j = 0, 0
    for i, t in enumerate(hits):
        while hits[j] < t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def test_judge_limiter_keeps_the_judge_under_its_rate_across_processes(counting_judge, forward_proxy,
                                                                       redis_prefix):
    """Two event loops (as two check processes) with their own limiters share one judge's bucket; 120
    concurrent checks each at 20 requests/s: the judge never sees more than burst + rate in a second, the
    checks that got no token within their deadline come back as judge faults, never as dead routes."""
    rate, url = 20.0, f"http://127.0.0.1:{counting_judge.server_address[1]}/"
    route = Route("http", "127.0.0.1", forward_proxy)
    results: list = []

    def process():
        r = redis.Redis.from_url(REDIS_URL)
        lim = BlockLimiter(r, redis_prefix, "judge", block=8)
        eng = CheckEngine(url, timeout=2.0, attempts=1, limiter=lim, rate=rate, own_addresses={"127.0.0.1"})

        async def run():
            return await asyncio.gather(*(eng.check(route) for _ in range(60)))

        try:
            results.extend(asyncio.run(run()))
        finally:
            lim.close()
            r.close()

    threads = [threading.Thread(target=process) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 120
    alive = [r for r in results if r.alive]
    limited = [r for r in results if not r.alive]
    assert all(r.error == "RateLimited" and r.judge_fault and r.attempts == 0 for r in limited)
    assert len(alive) == len(counting_judge.hits)
    # each check may wait max_check_seconds - timeout = 1 s: burst 20 + ~20 refilled, whatever the processes
    assert 30 <= len(alive) <= 45
    assert limited  # 120 checks cannot all fit
    assert _max_in_window(counting_judge.hits, 1.0) <= rate + rate + 2


def test_judge_limiter_makes_checks_wait_rather_than_fail(counting_judge, forward_proxy, redis_client, redis_prefix):
    url = f"http://127.0.0.1:{counting_judge.server_address[1]}/"
    lim = BlockLimiter(redis_client, redis_prefix, "judge", block=4)
    eng = CheckEngine(url, timeout=2.0, attempts=2, limiter=lim, rate=20.0, own_addresses={"127.0.0.1"})
    route = Route("http", "127.0.0.1", forward_proxy)

    async def run():
        return await asyncio.gather(*(eng.check(route) for _ in range(30)))

    try:
        t0 = time.monotonic()
        got = asyncio.run(run())
        elapsed = time.monotonic() - t0
    finally:
        lim.close()
    assert all(r.alive for r in got)  # 20 at once, 10 more within ~0.5 s: every check waited, none failed
    assert elapsed >= 0.35
    assert len(counting_judge.hits) == 30


def test_unlimited_judge_makes_no_redis_calls(counting_judge, forward_proxy, redis_client, redis_prefix):
    url = f"http://127.0.0.1:{counting_judge.server_address[1]}/"
    lim = BlockLimiter(redis_client, redis_prefix, "judge")
    eng = CheckEngine(url, timeout=2.0, attempts=1, limiter=lim, rate=0.0, own_addresses={"127.0.0.1"})
    try:
        assert asyncio.run(eng.check(Route("http", "127.0.0.1", forward_proxy))).alive
        assert lim.calls == 0
    finally:
        lim.close()


def test_judge_limiter_fails_open_without_redis(counting_judge, forward_proxy, redis_prefix):
    url = f"http://127.0.0.1:{counting_judge.server_address[1]}/"
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    lim = BlockLimiter(dead, redis_prefix, "judge")
    eng = CheckEngine(url, timeout=2.0, attempts=1, limiter=lim, rate=5.0, own_addresses={"127.0.0.1"})
    try:
        res = asyncio.run(eng.check(Route("http", "127.0.0.1", forward_proxy)))
        assert res.alive, res
        assert lim.counts.totals["unavailable"] >= 1
    finally:
        lim.close()


# -- the workspace budget at promote -------------------------------------------------------------------------

class _Lease:
    def __init__(self, i: int, workspaces: list[int]):
        self.member = f"r{i}"
        self.payload = json.dumps({"v": 1, "id": i, "p": "http", "h": "127.0.0.1", "o": 1, "k": "x",
                                   "w": workspaces})


def test_workspace_budget_defers_routes_of_workspaces_over_budget(redis_client, redis_prefix):
    wb = WorkspaceBudget(redis_client, redis_prefix, 0.0, {1: 5.0, 2: 5.0})
    leases = ([_Lease(i, [1]) for i in range(12)] + [_Lease(100 + i, [3]) for i in range(12)]
              + [_Lease(200 + i, [2, 3]) for i in range(3)] + [_Lease(300, [])])
    go, deferred = wb.admit(leases)
    ws1 = [le for le in go if json.loads(le.payload)["w"] == [1]]
    assert len(ws1) == 5  # burst of a 5/s budget
    assert len(deferred) == 7 and all(json.loads(le.payload)["w"] == [1] for le, _ in deferred)
    assert all(ms >= 1000 for _, ms in deferred)
    assert len(go) == 5 + 12 + 3 + 1  # unlimited owners (3), an unlimited co-owner, no owner: all go
    # workspace 2 was asked for 0 tokens: its co-owned routes did not charge it
    assert take_many(redis_client, [(bucket_key(redis_prefix, "workspace", "2"), 5.0, 5.0, 100)])[0][0] == 5
    assert read_counters(redis_client, redis_prefix)["limited"][("workspace", "deferred")] == 7


def test_promote_defers_claims_of_a_workspace_over_budget(settings, redis_client):
    from magpie.pipeline.promote import promote
    from magpie.queue import Payload, QueueKeys, RouteQueue

    q = RouteQueue(redis_client, QueueKeys(settings.redis_prefix, 2), interval_ms=1, lease_ms=60_000)
    items = [(f"{i:024x}", Payload(i + 1, Route("http", "127.0.0.1", 10_000 + i), f"{i:024x}",
                                   [7 if i < 15 else 8]).encode()) for i in range(20)]
    q.schedule(items)  # all due at once
    sent: list[dict] = []
    wb = WorkspaceBudget(redis_client, settings.redis_prefix, 0.0, {7: 4.0})
    n = promote(q, sent.extend, budget=100, max_inflight=1000, admit=wb.admit)
    assert n == len(sent) == 4 + 5  # 4 of workspace 7 (its burst), all 5 of unlimited workspace 8
    # the 11 deferred routes are scheduled again about a second out, not claimable now
    assert promote(q, sent.extend, budget=100, max_inflight=1000, admit=wb.admit) == 0


# -- the rotator's client rate --------------------------------------------------------------------------------

def test_rotator_refuses_connections_above_the_client_rate(redis_client, redis_prefix):
    from magpie.rotator.listener import Listener, ListenerSpec
    from magpie.rotator.pool import RoutePool

    lim = BlockLimiter(redis_client, redis_prefix, "rotator", block=2)

    async def run():
        spec = ListenerSpec(1, "rl", 0, frozenset({"http"}), None, None, "next", 0, 1, 1, {})
        lis = Listener(spec, RoutePool([]), rate_limiter=lim, client_rate=5.0, connect_timeout=1)
        await lis.start()
        port = lis._server.sockets[0].getsockname()[1]
        try:
            answered = 0
            for _ in range(20):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"GET http://127.0.0.1:9/ HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n")
                try:
                    data = await asyncio.wait_for(r.read(), 5)
                except ConnectionResetError:  # closed with our request unread
                    data = b""
                answered += data.startswith(b"HTTP/1.1")
                w.close()
            return answered, lis.stats
        finally:
            await lis.stop()

    try:
        answered, stats = asyncio.run(run())
    finally:
        lim.close()
    assert stats.connections == 20
    assert 12 <= stats.rate_limited <= 15  # burst 5 (+ what refilled at 5/s while the loop ran)
    assert answered == 20 - stats.rate_limited  # a refused connection is closed unanswered
    wait_until(lambda: read_counters(redis_client, redis_prefix)["limited"].get(("rotator", "refused"))
               == stats.rate_limited, timeout=5)


def test_exporter_shows_rate_limit_counters(settings, redis_client):
    from prometheus_client import generate_latest

    from magpie.observability.metrics import build_registry
    from magpie.coordination.ratelimit import EventCounts

    c = EventCounts(redis_client, settings.redis_prefix, "workspace")
    c.add("deferred", 3)
    c.flush()
    text = generate_latest(build_registry(settings, redis=redis_client)).decode()
    assert 'magpie_rate_limited_total{event="deferred",limiter="workspace"} 3.0' in text
    assert 'magpie_rate_limited_total{event="handed_back",limiter="judge"} 0.0' in text


# -- where a judge's rate comes from ---------------------------------------------------------------------------

def test_judge_rate_is_stored_read_by_checkers_and_falls_back_to_the_default(settings, db, redis_client):
    from magpie.judges import store
    from magpie.judges.checking import ProfiledEngine

    a = store.add_judge(db, "http://127.0.0.1:9/a", rate=7)
    b = store.add_judge(db, "http://127.0.0.1:9/b")
    c = store.add_judge(db, "http://127.0.0.1:9/c", rate=0)
    assert (a["rate"], b["rate"]) == (7.0, None)
    assert store.set_judge_rate(db, str(b["id"]), "2.5")["rate"] == 2.5
    assert store.set_judge_rate(db, str(b["id"]), None)["rate"] is None
    with pytest.raises(ValueError, match="judge rate"):
        store.set_judge_rate(db, str(b["id"]), "-1")
    judges = {j.id: j for j in store.load_snapshot(db).judges}
    lim = BlockLimiter(redis_client, settings.redis_prefix, "judge")
    eng = ProfiledEngine(settings.model_copy(update={"judge_rate": 3.0}), cache=None, limiter=lim)
    try:
        got = {k: eng.engine_for(judges[j["id"]], 5.0, 1, None) for k, j in (("a", a), ("b", b), ("c", c))}
        assert (got["a"].rate, got["b"].rate) == (7.0, 3.0)
        assert got["a"].limiter is lim and got["c"].limiter is None  # 0: unlimited, no Redis at all
    finally:
        lim.close()


def test_cli_sets_and_shows_a_judge_rate(settings, db, monkeypatch):
    from click.testing import CliRunner

    from magpie.cli import main
    from magpie.config import get_settings

    for k, v in {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
                 "MAGPIE_DATABASE_URL": settings.database_url,
                 "PROXY_ENCRYPTION_KEY": settings.encryption_key}.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    run = CliRunner()
    try:
        res = run.invoke(main, ["judges", "add", "http://127.0.0.1:9/", "--rate", "40", "--json"])
        assert res.exit_code == 0, res.output
        jid = json.loads(res.output)["result"]["id"]
        res = run.invoke(main, ["judges", "rate", str(jid), "12.5"])
        assert res.exit_code == 0 and "12.5/s" in res.output, res.output
        assert "12.5/s" in run.invoke(main, ["judges", "list"]).output
        res = run.invoke(main, ["judges", "rate", str(jid), "fast"])
        assert res.exit_code != 0 and "judge rate must be a number" in res.output, res.output
        res = run.invoke(main, ["judges", "rate", str(jid), "default"])
        assert "default (MAGPIE_JUDGE_RATE)" in res.output, res.output
    finally:
        get_settings.cache_clear()
