"""What the check pool leaves as stall evidence when a write is refused or a quarantined check ends:
a completion Redis refused (``maxmemory``) is no crash, and a crash after a quarantined check ended is
not that check's."""

from __future__ import annotations

import time

import pytest

from magpie.queue import QueueKeys, RouteQueue
from tests.integration.test_cycle import FakeEngine, Published, make_pool, seed
from tests.private_redis import PrivateRedis


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def private_q(tmp_path):
    srv = PrivateRedis(tmp_path)
    r = srv.start()
    r.config_set("maxmemory-policy", "noeviction")
    yield RouteQueue(r, QueueKeys("t:", 4), interval_ms=60_000, lease_ms=1500)
    srv.stop()


def marks(q):
    return {k.decode(): v.decode() for k, v in q.r.hgetall(q.keys.stalls).items() if k.endswith(b"#s")}


def test_a_completion_redis_refused_counts_no_stall(private_q):
    q = private_q
    seed(q, [300] * 5)
    engine = FakeEngine(max_check_seconds=0.5)  # the 1.5 s leases leave room to start
    pool = make_pool(q, engine, Published(q))
    try:
        leases = q.pop(5)
        pool.submit(leases)
        assert wait_for(lambda: len(marks(q)) == 5)  # start marks are written in batches
        q.r.config_set("maxmemory", 1)  # Redis now refuses every write
        assert pool.wait_idle(10)
        assert wait_for(lambda: pool.totals.refused == 5)
        assert pool.totals.completed == 0 and marks(q) == {}
    finally:
        q.r.config_set("maxmemory", 0)
        pool.close()
    got = []  # the leases expire on the Redis clock: poll for the re-claim
    assert wait_for(lambda: got.extend(q.pop(5)) or len(got) == 5, 10)
    assert all(le.stalled and not le.alone for le in got)
    assert all(q.inspect(le.member)["stalls"] == 0 for le in got)  # refused writes are no crash


def test_a_quarantined_check_withdraws_its_start_mark_when_it_ends(private_q):
    q = private_q
    q.lease_ms = 60_000
    seed(q, [200])
    engine = FakeEngine()
    pool = make_pool(q, engine, Published(q), complete_interval=30.0)  # no completion for a while
    try:
        [le] = q.pop(1)
        le.alone = True
        pool.submit([le])
        assert wait_for(lambda: len(marks(q)) == 1)  # marked right before its check
        assert wait_for(lambda: engine.finished)
        assert wait_for(lambda: marks(q) == {})  # ended: a crash from now on is not its check's
        assert q.inspect(le.member)["state"] == "leased"  # not completed yet
    finally:
        pool.close()


def test_a_lease_a_dead_process_started_is_not_started_again(private_q):
    """Celery hands a message whose process died before taking it to another process: the leases the dead
    process had started carry their own mark; starting them again would run a poison route twice."""
    q = private_q
    q.lease_ms = 60_000
    seed(q, [50, 51, 52])
    engine = FakeEngine()
    pool = make_pool(q, engine, Published(q))
    try:
        leases = q.pop(3)
        assert q.mark_started(leases[:1]) == []  # the dead process got this far with the first
        pool.submit(leases)
        assert pool.wait_idle(10)
        assert wait_for(lambda: pool.totals.completed == 2)
        assert sorted(engine.started) == [51, 52]
        assert marks(q) == {f"{leases[0].member}#s": leases[0].lease_score}  # its evidence stays
        assert q.inspect(leases[0].member)["state"] == "leased"
    finally:
        pool.close()


def test_an_isolated_check_whose_process_died_is_reported_as_the_routes_crash(private_q):
    from magpie.pipeline.isolation import IsolatedCrash

    q = private_q
    q.lease_ms = 60_000
    seed(q, [60])
    engine = FakeEngine()
    calls = []

    async def isolate(payload_text, timeout_s):
        calls.append(payload_text)
        raise IsolatedCrash(-9)
    pool = make_pool(q, engine, Published(q), isolate=isolate)
    try:
        [le] = q.pop(1)
        le.alone = True
        pool.submit([le])
        assert pool.wait_idle(10)
        assert calls == [le.payload] and engine.started == []  # checked only in its own process
        assert wait_for(lambda: q.inspect(le.member)["stalls"] == 1)  # the crash counted, at once
        assert marks(q) == {}  # unmarked: the pool's own death would have counted nothing
        assert q.inspect(le.member)["state"] != "leased"  # claimable again at once
    finally:
        pool.close()
