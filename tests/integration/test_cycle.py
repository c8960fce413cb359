"""promote and the check pool against real Redis, with a stand-in engine (a unit seam, no network).

The stand-in engine's check sleeps for a per-route time (``port`` ms) and answers alive; the real engine
against real proxies is covered by ``test_engine.py``, ``test_lab.py`` and the end-to-end tests.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from helpers import TimedOut, wait_until

from magpie.base.backoff import Backoff
from magpie.checker import CheckResult
from magpie.pipeline.checkpool import CheckPool
from magpie.pipeline.promote import promote
from magpie.queue import Lease, Payload, QueueKeys, RouteQueue, is_lease_score
from magpie.queue.capacity import CapacityRegistry
from magpie.queue.completion import StreamTarget
from magpie.base.routes import Route


class FakeEngine:
    """Sleeps ``route.port`` ms per check (checks at once are unbounded), then answers alive or ``error``."""

    judge_url = "http://judge.invalid/"
    attempts = 1

    def __init__(self, error=None, judge_up=True, max_check_seconds=5.0):
        self.error, self.judge_up, self.max_check_seconds = error, judge_up, max_check_seconds
        self.started, self.finished, self.cancelled = [], [], []
        self.running = 0
        self.peak = 0

    async def check(self, route, before_attempt=None):
        if before_attempt and not before_attempt(1):
            return CheckResult(False, None, None, 0, "Aborted", None, None, self.judge_url, 0)
        self.started.append(route.port)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(route.port / 1000)  # the behaviour: a check of port-many milliseconds
        except asyncio.CancelledError:
            self.cancelled.append(route.port)
            raise
        finally:
            self.running -= 1
        self.finished.append((route.port, time.monotonic()))
        if self.error:
            return CheckResult(False, None, None, 1, self.error, None, None, self.judge_url, int(time.time() * 1000))
        return CheckResult(True, 12.5, 200, 1, None, "{}", "elite", self.judge_url, int(time.time() * 1000))

    async def check_payload(self, payload, before_attempt=None):
        return await self.check(payload.route, before_attempt)

    async def judge_reachable(self, max_age=2.0):
        return self.judge_up


@pytest.fixture
def q(redis_client, redis_prefix):
    return RouteQueue(redis_client, QueueKeys(redis_prefix, 4), interval_ms=60_000, lease_ms=60_000)


def seed(q, sleeps_ms):
    """One route per entry of ``sleeps_ms`` (its port is the stand-in check's sleep), all due long ago."""
    items = []
    for i, ms in enumerate(sleeps_ms):
        h = f"{i:024x}"
        items.append((h, Payload(i + 1, Route("socks5", "127.0.0.1", ms), h, [1]).encode()))
    q.schedule(items)
    for h, _ in items:
        shard = q.keys.shard_of(h)
        q.r.zadd(shard, {h: 1000 + int(h, 16)})
        q.r.zadd(q.keys.heads, {shard: 1000})
    return items


class Published:
    """The results stream the pool under test appends to, read back as ``[(fields, stream id)]``."""

    def __init__(self, q):
        self.r, self.key = q.r, q.keys.prefix + "results"

    def target(self, maxlen=1_000_000, policy="evict_oldest"):
        return StreamTarget(self.key, "test-group", maxlen, policy)

    def rows(self):
        return [({k.decode(): v.decode() for k, v in f.items()}, sid.decode()) for sid, f in self.r.xrange(self.key)]

    def __len__(self):
        return self.r.xlen(self.key)

    def __iter__(self):
        return iter(self.rows())

    def __getitem__(self, i):
        return self.rows()[i]

    def __eq__(self, other):
        return self.rows() == list(other)


def make_pool(q, engine, published, **kw):
    kw.setdefault("capacity", 100)
    kw.setdefault("renew_below_ms", 0)
    kw.setdefault("complete_interval", 0.05)
    return CheckPool(q, engine, published.target(**kw.pop("stream", {})), **kw).start()


# -- promote -----------------------------------------------------------------------------------------------
def test_promote_batches_leases_into_messages_and_respects_budget(q):
    seed(q, [1] * 50)
    messages = []
    n = promote(q, messages.append, budget=40, max_inflight=1000, pop_batch=16, routes_per_task=8)
    assert n == 40
    assert [len(m) for m in messages] == [8, 8, 8, 8, 8]
    leases = [Lease.from_dict(d) for m in messages for d in m]
    assert len({le.member for le in leases}) == 40
    assert all(is_lease_score(le.lease_score) for le in leases)


def test_promote_fills_messages_across_pop_calls(q):
    seed(q, [1] * 50)
    messages = []
    assert promote(q, messages.append, budget=50, max_inflight=1000, pop_batch=16, routes_per_task=30) == 50
    assert [len(m) for m in messages] == [30, 20]


def test_promote_never_exceeds_max_inflight(q):
    seed(q, [1] * 30)
    sent = []
    assert promote(q, sent.append, budget=100, max_inflight=10) == 10
    assert promote(q, sent.append, budget=100, max_inflight=10) == 0


def test_promote_claims_no_more_than_the_free_slots(q):
    seed(q, [1] * 100)
    sent = []
    assert promote(q, sent.append, budget=1000, max_inflight=1000, capacity=0) == 0
    assert promote(q, sent.append, budget=1000, max_inflight=1000, capacity=25) == 25
    assert promote(q, sent.append, budget=1000, max_inflight=1000, capacity=25) == 0  # slots all taken
    q.complete([Lease.from_dict(d) for d in sent[0][:5]])
    assert promote(q, sent.append, budget=1000, max_inflight=1000, capacity=25) == 5  # five slots freed


def test_two_promote_passes_at_once_never_claim_twice_the_slots(q):
    seed(q, [1] * 400)
    counts = []
    barrier = threading.Barrier(2)

    def one():
        mine = RouteQueue(q.r, q.keys, interval_ms=60_000, lease_ms=60_000)
        barrier.wait()
        counts.append(promote(mine, lambda m: None, budget=1000, max_inflight=10_000, pop_batch=8,
                              capacity=100))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(counts) == 100 and q.status()["totals"]["leased"] == 100


def test_capacity_registry_counts_live_engines_only(redis_client, redis_prefix):
    reg = CapacityRegistry(redis_client, QueueKeys(redis_prefix, 4))
    assert reg.total() == 0
    reg.announce("a", 10_000, 60_000)
    reg.announce("b", 500, 100)
    assert reg.total() == 10_500
    # b's announcement expires: its process stopped beating
    wait_until(lambda: reg.engines() == {"a": 10_000}, timeout=5, what="b's announcement expired")
    reg.withdraw("a")
    assert reg.total() == 0


# -- the check pool ----------------------------------------------------------------------------------------
def test_pool_completes_and_publishes_every_lease(q):
    seed(q, [5] * 20)
    published = Published(q)
    pool = make_pool(q, FakeEngine(), published)
    try:
        assert pool.submit(q.pop(20)) == 20
        assert pool.wait_idle(10)
    finally:
        pool.close()
    assert {e["route_id"] for e, _ in published} == {str(i) for i in range(1, 21)}
    assert all(e["alive"] == "1" for e, _ in published)
    assert pool.totals.completed == 20 and pool.totals.published == 20
    assert q.status()["totals"]["leased"] == 0


def test_fast_routes_complete_before_a_slow_batch_mate_finishes(q):
    seed(q, [3000] + [10] * 20)  # one slow route (3 s) and twenty fast ones in one message
    published = Published(q)
    engine = FakeEngine()
    pool = make_pool(q, engine, published)
    try:
        t0 = time.monotonic()
        pool.submit(q.pop(21))
        try:
            wait_until(lambda: len(published) >= 20, timeout=2.5, interval=0.02, what="the fast routes")
        except TimedOut:
            pass  # asserted below
        fast_done = time.monotonic() - t0
        assert len(published) == 20, "fast routes waited for their slow batch-mate"
        assert fast_done < 2.0 and engine.running == 1  # the slow one is still running
        assert pool.wait_idle(10)
    finally:
        pool.close()
    assert len(published) == 21


def test_pool_runs_at_most_capacity_checks_at_once(q):
    seed(q, [50] * 40)
    engine = FakeEngine()
    pool = make_pool(q, engine, Published(q), capacity=7)
    try:
        pool.submit(q.pop(40))
        assert pool.wait_idle(20)
    finally:
        pool.close()
    assert engine.peak == 7 and pool.peak_running == 7 and pool.totals.completed == 40


def test_submit_blocks_while_a_backlog_already_waits(q):
    seed(q, [300] * 12)
    pool = make_pool(q, FakeEngine(), Published(q), capacity=4)
    try:
        leases = q.pop(12)
        assert pool.submit(leases[:8]) == 8  # 4 running, 4 pending: more than the backlog (1) waits
        t0 = time.monotonic()
        assert pool.submit(leases[8:]) == 4  # admitted only once the first four finished
        assert time.monotonic() - t0 >= 0.2
        assert pool.wait_idle(10)
    finally:
        pool.close()


def test_a_full_process_takes_no_second_message_while_one_already_waits(q):
    """Below the backlog too: a message beyond the slots waits in the process, the next one is left for a
    process with free slots (Celery hands it to an idle child) until the waiting leases started."""
    seed(q, [1500] * 104)
    engine = FakeEngine()
    pool = make_pool(q, engine, Published(q), capacity=100)  # backlog 10
    try:
        leases = q.pop(104)
        assert pool.submit(leases[:98]) == 98
        wait_until(lambda: engine.running == 98, timeout=10, what="98 checks running")
        assert pool.submit(leases[98:103]) == 5  # 2 of them wait: fewer than the backlog
        t0 = time.monotonic()
        assert pool.submit(leases[103:]) == 1  # admitted only once the two waiting ones started
        assert time.monotonic() - t0 >= 0.5
        assert engine.finished, "admitted before any slot freed"
        assert pool.wait_idle(20)
    finally:
        pool.close()
    assert pool.totals.completed == 104


def test_offer_admits_what_the_free_slots_take_and_returns_the_rest(q):
    seed(q, [1000] * 15)
    engine = FakeEngine()
    pool = make_pool(q, engine, Published(q), capacity=10)
    try:
        leases = q.pop(15)
        rest = pool.offer(leases[:12])
        assert [le.member for le in rest] == [le.member for le in leases[10:12]]
        assert pool.offer(leases[12:]) == leases[12:]  # no free slot: nothing admitted, nothing waits
        assert pool.stats().pending <= 10
        wait_until(lambda: engine.finished, timeout=10, what="a slot freed")
        wait_until(lambda: len(pool._running) < 10, timeout=5, what="the slot released")
        assert pool.offer(leases[12:13]) == []
        assert pool.wait_idle(20)
    finally:
        pool.close()
    assert pool.totals.completed == 11 and sorted(engine.started) == [1000] * 11


def test_lost_lease_cancels_the_attempt_in_flight(q):
    seed(q, [30_000])
    le = q.pop(1, lease_ms=60_000)[0]
    engine = FakeEngine()
    published = Published(q)
    pool = make_pool(q, engine, published, renew_below_ms=59_000)  # renewed at the first renewal tick
    try:
        pool.submit([le])
        wait_until(lambda: engine.running == 1, timeout=5, what="the check running")
        q.r.zadd(q.keys.shard_of(le.member), {le.member: 5_000_000_000_000.5})  # another holder's lease
        t0 = time.monotonic()
        assert pool.wait_idle(5)
        assert time.monotonic() - t0 < 3  # cancelled within a renewal tick, not after the 30 s check
    finally:
        pool.close()
    assert engine.cancelled == [30_000] and published == []
    assert pool.totals.aborted == 1 and pool.totals.completed == 0
    assert le.cancelled


def test_a_check_past_the_pools_guard_is_stopped_and_recorded_as_a_read_timeout(q):
    """The last guard over a check (the engine's own deadlines failed) is the renewal sweep's: a check
    running past ``max_check_seconds * 1.25 + 5`` s is stopped and recorded as a ReadTimeout."""
    seed(q, [60_000, 5])
    leases = q.pop(2, lease_ms=120_000)
    engine = FakeEngine(max_check_seconds=0.1)  # a guard of 5.125 s; the 60 s check ignores it
    published = Published(q)
    pool = make_pool(q, engine, published)
    try:
        pool.submit(leases)
        assert pool.wait_idle(15)
    finally:
        pool.close()
    assert engine.cancelled == [60_000]
    assert pool.totals.overran == 1 and pool.totals.completed == 2 and pool.totals.aborted == 0
    errors = sorted(f["error"] for f, _ in published)
    assert errors == ["", "ReadTimeout"], errors


def test_renewal_extends_leases_of_running_checks(q):
    seed(q, [1500])
    le = q.pop(1, lease_ms=60_000)[0]
    first = le.lease_score
    pool = make_pool(q, FakeEngine(), Published(q), renew_below_ms=59_500)
    try:
        pool.submit([le])
        assert pool.wait_idle(5)
    finally:
        pool.close()
    assert le.lease_score != first and pool.totals.completed == 1


def test_the_sweep_waits_while_no_lease_needs_it_and_comes_early_for_one_that_does(q):
    """With every lease far from renewal the sweep over the slots pauses up to SWEEP_MAX_S; a lease
    started close to its renewal brings the next sweep forward, so it is renewed within about a second."""
    from magpie.pipeline.checkpool import SWEEP_MAX_S

    seed(q, [30_000, 30_000])
    first = q.pop(1, lease_ms=600_000)[0]
    first_score = first.lease_score
    engine = FakeEngine()
    pool = make_pool(q, engine, Published(q), renew_below_ms=100_000)
    try:
        pool.submit([first])
        wait_until(lambda: pool._sweep_at_ms > time.time() * 1000 + 2_000, timeout=5, what="a long pause")
        assert pool._sweep_at_ms <= time.time() * 1000 + SWEEP_MAX_S * 1000
        late = q.pop(1, lease_ms=101_500)[0]  # due for renewal 1.5 s from now
        score = late.lease_score
        t0 = time.monotonic()
        pool.submit([late])
        wait_until(lambda: late.lease_score != score, timeout=SWEEP_MAX_S, what="the early renewal")
        assert time.monotonic() - t0 < 3.5
        assert first.lease_score == first_score and not first.cancelled  # far from renewal: left alone
    finally:
        pool.close()


def test_stale_completion_drops_the_result(q):
    seed(q, [300])
    le = q.pop(1, lease_ms=60_000)[0]
    published = Published(q)
    engine = FakeEngine()
    pool = make_pool(q, engine, published)
    try:
        pool.submit([le])
        wait_until(lambda: engine.running == 1, timeout=5, what="the check running")
        # the lease moves on under the running check (e.g. an operator re-leased it); no renewal runs
        q.r.zadd(q.keys.shard_of(le.member), {le.member: 5_000_000_000_000.5})
        assert pool.wait_idle(5)
    finally:
        pool.close()
    assert published == [] and pool.totals.stale_completions == 1 and pool.totals.lease_lost == 1


def test_lease_too_late_to_start_is_handed_back_without_a_stall(q):
    seed(q, [10])
    before = q.r.zscore(q.keys.shard_of("0" * 24), "0" * 24)
    le = q.pop(1, lease_ms=2_000)[0]  # less lease left than one check may take (max_check_seconds=5)
    pool = make_pool(q, FakeEngine(), Published(q))
    try:
        pool.submit([le])
        assert pool.wait_idle(5)
    finally:
        pool.close()
    assert pool.totals.handed_back == 1 and pool.totals.completed == 0
    info = q.inspect(le.member)
    assert info["state"] == "due" and info["stalls"] == 0
    assert float(info["score"]) == before  # back at its old due time, claimable at once
    again = q.pop(1)
    assert len(again) == 1 and not again[0].stalled


def test_closing_hands_back_running_and_pending_leases(q):
    seed(q, [30_000] * 6)
    engine = FakeEngine()
    pool = make_pool(q, engine, Published(q), capacity=3)
    leases = q.pop(6)
    pool.submit(leases)
    wait_until(lambda: engine.running == 3, timeout=5, what="three checks running")
    pool.close()
    assert pool.totals.handed_back == 6
    assert q.status()["totals"]["leased"] == 0
    assert len(q.pop(10)) == 6  # all claimable again, none as a stall
    assert all(not int(q.r.hget(q.keys.stalls, le.member) or 0) for le in leases)


def test_infrastructure_failure_retries_on_backoff_not_full_interval(q):
    seed(q, [5, 5])
    leases = q.pop(2)
    published = Published(q)
    pool = make_pool(q, FakeEngine(error="ConnectionError", judge_up=False), published,
                     backoff=Backoff("fixed", 2_000, 2_000))
    try:
        pool.submit(leases)
        assert pool.wait_idle(5)
    finally:
        pool.close()
    assert pool.totals.retried == 2 and pool.totals.completed == 0 and published == []
    now = q.server_time_ms()
    for le in leases:
        info = q.inspect(le.member)
        assert info["state"] == "retry" and info["retries"] == 1
        assert now < float(info["score"]) <= now + 2_000  # backoff delay, not the 60 s interval


def test_dead_route_with_judge_up_completes_normally(q):
    seed(q, [5])
    published = Published(q)
    pool = make_pool(q, FakeEngine(error="ProxyError"), published)
    try:
        pool.submit(q.pop(1))
        assert pool.wait_idle(5)
    finally:
        pool.close()
    assert pool.totals.completed == 1 and published[0][0]["alive"] == "0"


def test_malformed_payload_is_left_to_expire(q):
    seed(q, [5])
    le = q.pop(1)[0]
    le.payload = "{not json"
    pool = make_pool(q, FakeEngine(), Published(q))
    try:
        pool.submit([le])
        assert pool.wait_idle(5)
    finally:
        pool.close()
    assert pool.totals.malformed == 1 and q.inspect(le.member)["state"] == "leased"


def test_fd_limit_below_the_configured_concurrency_is_reported_and_respected():
    code = (
        "import logging, resource, sys\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format='%(message)s')\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (300, 600))\n"
        "from magpie.checker.limits import checks_within_fd_limit\n"
        "print('cap', checks_within_fd_limit(10000))\n"
        "print('soft', resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "print('small', checks_within_fd_limit(100))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "cap 344" in out  # raised to the hard limit (600) less the reserve of 256
    assert "soft 600" in out and "small 100" in out
    assert "MAGPIE_CHECKS_PER_PROCESS=10000 exceeds the file-descriptor limit (soft 600, hard 600)" in out


def test_runtime_resources_build_in_any_order(monkeypatch, settings):
    """route_queue() builds redis_client() inside its own factory: the cache lock must be re-entrant."""
    from magpie.wiring import runtime

    monkeypatch.setattr(runtime, "_cache", {})
    monkeypatch.setattr(runtime, "settings", lambda: settings)
    out = []
    t = threading.Thread(target=lambda: out.append(runtime.route_queue()), daemon=True)
    t.start()
    t.join(5)
    assert out and out[0].keys.prefix == settings.redis_prefix


def test_a_result_is_recorded_if_and_only_if_its_lease_completed(q):
    seed(q, [5] * 4)
    leases = q.pop(4)
    stale = leases[0]
    q.r.zadd(q.keys.shard_of(stale.member), {stale.member: 5_000_000_000_000.5})  # taken over meanwhile
    published = Published(q)
    results = [{"route_id": str(i), "alive": "1"} for i in range(4)]
    comp = q.complete_with_results(leases, results, published.target())
    assert comp.codes[0] != 1 and comp.ids[0] is None
    assert comp.codes[1:] == [1, 1, 1] and all(comp.ids[1:])
    assert [f["route_id"] for f, _ in published] == ["1", "2", "3"]
    assert [sid for _, sid in published] == comp.ids[1:]  # appended by the completing call itself


def test_a_full_stream_refuses_without_completing_anything(q):
    seed(q, [5] * 3)
    leases = q.pop(3)
    published = Published(q)
    q.r.xadd(published.key, {"x": "1"})
    q.r.xadd(published.key, {"x": "2"})
    comp = q.complete_with_results(leases, [{"a": "1"}] * 3, published.target(maxlen=3, policy="refuse"))
    assert comp.full and comp.codes == []
    assert q.status()["totals"]["leased"] == 3 and len(published) == 2  # nothing changed
    comp = q.complete_with_results(leases, [{"a": "1"}] * 3, published.target(maxlen=3, policy="drop_new"))
    assert comp.codes == [1, 1, 1] and comp.dropped == 2 and sum(1 for i in comp.ids if i) == 1
    assert q.status()["totals"]["leased"] == 0 and len(published) == 3


def test_evict_oldest_makes_room_and_counts_the_loss(q):
    seed(q, [5] * 2)
    leases = q.pop(2)
    published = Published(q)
    for i in range(3):
        q.r.xadd(published.key, {"old": str(i)})
    comp = q.complete_with_results(leases, [{"new": "a"}, {"new": "b"}], published.target(maxlen=3))
    assert comp.codes == [1, 1] and comp.dropped == 2
    assert [f for f, _ in published] == [{"old": "2"}, {"new": "a"}, {"new": "b"}]


def test_block_policy_waits_for_room_then_drops_new_results(q):
    seed(q, [5])
    published = Published(q)
    q.r.xadd(published.key, {"x": "1"})
    engine = FakeEngine()
    pool = CheckPool(q, engine, published.target(maxlen=1, policy="block"), capacity=10, renew_below_ms=0,
                     complete_interval=0.05, block_timeout=0.5).start()
    try:
        t0 = time.monotonic()
        pool.submit(q.pop(1))
        assert pool.wait_idle(10)
    finally:
        pool.close()
    assert time.monotonic() - t0 >= 0.5  # waited for room first
    assert pool.totals.completed == 1 and pool.totals.dropped == 1 and pool.totals.published == 0



def test_owner_changes_complete_in_the_pools_atomic_call_under_the_streams_policy(q, redis_client):
    """A route with a pending owner drop completes in the same fenced call as its batch-mates: the delta
    is applied, and its result is appended under the stream's overflow policy (here ``evict_oldest``:
    the oldest unconsumed entry makes room, the new result is kept)."""
    from magpie.judges.ownership import OwnerChanges, drops_key

    items = seed(q, [1, 1])
    (h_keep, _), (h_drop, _) = items
    q.update(h_drop, Payload(2, Route("socks5", "127.0.0.1", 1), h_drop, [1, 2]).encode(), q.payload(h_drop))
    redis_client.hset(drops_key(q.keys.prefix), h_drop, "1")
    published = Published(q)
    for i in range(2):
        q.r.xadd(published.key, {"old": str(i)})
    changes = OwnerChanges(redis_client, q.keys.prefix)
    pool = CheckPool(q, FakeEngine(), published.target(maxlen=2), capacity=10, renew_below_ms=0,
                     complete_interval=0.05, owner_changes=changes).start()
    try:
        pool.submit(q.pop(2))
        assert pool.wait_idle(10)
    finally:
        pool.close()
    assert pool.totals.completed == 2 and pool.totals.published == 2 and pool.totals.dropped == 2
    assert {f["route_hash"] for f, _ in published} == {h_keep, h_drop}  # both new results, the old evicted
    assert Payload.decode(q.payload(h_drop)).workspaces == [2] and changes.applied == 1
    assert redis_client.hlen(drops_key(q.keys.prefix)) == 0
    assert q.status()["totals"]["leased"] == 0

def test_thousands_of_leases_are_handed_back_in_one_call(q):
    """A closing pool hands back all it holds (10,000 leases per process by default) in one call."""
    seed(q, [5] * 9000)
    leases = [le for _ in range(9) for le in q.pop(1000)]
    assert len(leases) == 9000
    assert q.release(leases) == [1] * 9000
    assert q.status()["totals"]["leased"] == 0


# -- quarantine ------------------------------------------------------------------------------------------
def test_started_leases_are_marked_within_a_flush(q):
    seed(q, [1500] * 3)
    pool = make_pool(q, FakeEngine(), Published(q))
    try:
        leases = q.pop(3)
        pool.submit(leases)
        fields = [f"{le.member}#s" for le in leases]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(q.r.hmget(q.keys.stalls, fields)):
            time.sleep(0.01)
        marks = q.r.hmget(q.keys.stalls, fields)
        assert [m and m.decode() for m in marks] == [le.lease_score for le in leases]
        assert pool.wait_idle(10)
    finally:
        pool.close()
    assert q.r.hlen(q.keys.stalls) == 0  # completion clears the marks


def test_quarantined_leases_are_checked_one_at_a_time_beside_the_others(q):
    seed(q, [150] * 4 + [150] * 6)
    engine = FakeEngine()
    pool = make_pool(q, engine, Published(q))
    try:
        leases = q.pop(10)
        for le in leases[:4]:
            le.alone = True
        pool.submit(leases)
        wait_until(lambda: engine.running == 6 + 1, timeout=5, what="six ordinary checks and one quarantined")
        assert engine.running == 6 + 1  # the six ordinary ones and one quarantined route
        assert pool.wait_idle(10)
    finally:
        pool.close()
    assert pool.totals.completed == 10


def test_promote_sends_each_quarantined_lease_in_a_message_of_its_own(q):
    items = seed(q, [10] * 6)
    for h, _ in items[:2]:
        q.r.hset(q.keys.stalls, f"{h}#q", 3)  # max_stalled (3) started stalls since the last completion
    messages = []
    assert promote(q, messages.append, budget=100, max_inflight=100, routes_per_task=10) == 6
    alone = [m for m in messages if any(d["alone"] for d in m)]
    assert sorted(len(m) for m in messages) == [1, 1, 4] and len(alone) == 2


def test_two_pools_run_one_quarantined_check_at_a_time_between_them(q):
    from magpie.queue.quarantine import QuarantineSlot

    seed(q, [200] * 6)
    slot = QuarantineSlot(q.r, q.keys.prefix)
    shared = FakeEngine()
    pools = [make_pool(q, shared, Published(q), quarantine=slot) for _ in range(2)]
    try:
        leases = q.pop(6)
        for le in leases:
            le.alone = True
        pools[0].submit(leases[:3])
        pools[1].submit(leases[3:])
        assert all(p.wait_idle(20) for p in pools)
    finally:
        for p in pools:
            p.close()
    assert shared.peak == 1 and sum(p.totals.completed for p in pools) == 6
    assert slot.holder() is None  # given back after each check


# -- the hand-off ----------------------------------------------------------------------------------------
class BlockingEngine(FakeEngine):
    """Its first check blocks the event loop thread itself until ``release`` is set (a stuck loop)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.blocked = threading.Event()

    async def check(self, route, before_attempt=None):
        if not self.blocked.is_set():
            self.blocked.set()
            self.release.wait(30)
        return await super().check(route, before_attempt)


def test_submit_admits_without_waiting_on_the_event_loop(q):
    """A Celery child hands its leases over while the pool's loop is busy; it never waits on the loop."""
    seed(q, [5] * 6)
    engine = BlockingEngine()
    pool = make_pool(q, engine, Published(q), capacity=100)
    try:
        leases = q.pop(6)
        pool.submit(leases[:1])
        assert engine.blocked.wait(5)  # the loop thread is now stuck inside a check
        done = threading.Event()
        threading.Thread(target=lambda: (pool.submit(leases[1:]), done.set()), daemon=True).start()
        admitted = done.wait(5)
        engine.release.set()
        assert admitted, "submit waited for the event loop"
        assert pool.wait_idle(10)
    finally:
        engine.release.set()
        pool.close()
    assert pool.totals.completed == 6


def test_each_started_lease_reports_its_way_from_claim_to_start(q):
    seed(q, [50] * 4)
    samples = []
    pool = make_pool(q, FakeEngine(), Published(q), capacity=2, timings=samples.extend)
    messages = []
    try:
        promote(q, messages.append, budget=10, max_inflight=10, routes_per_task=4)
        for m in messages:
            pool.submit([Lease.from_dict(d) for d in m])
        assert pool.wait_idle(10)
    finally:
        pool.close()
    assert len(samples) == 4
    for t in samples:
        assert 0 < t.claimed <= t.dispatched <= t.received <= t.admitted <= t.started
        assert t.due and t.started - t.due > 0  # due long ago: late
    waits = sorted(t.started - t.admitted for t in samples)
    assert waits[-1] >= 40  # two of them waited for a slot (capacity 2, 50 ms checks)


def test_start_timings_feed_the_claim_to_start_histograms(redis_client, redis_prefix):
    from magpie.base import counters
    from magpie.pipeline.checkpool import StartTiming

    base = 1_700_000_000_000.0
    samples = [StartTiming(base, base + 10, base + 30, base + 31, base + 80, base - 1000),
               StartTiming(0.0, 0.0, base, base + 1, base + 2, 0.0)]
    assert counters.record_start_timings(redis_client, redis_prefix, samples)
    c = counters.read_counters(redis_client, redis_prefix)
    assert c["claim_to_start"]["count"] == 1 and abs(c["claim_to_start"]["sum_s"] - 0.08) < 1e-6
    st = c["start_stages"]
    assert st["dispatch"]["count"] == 1 and st["transit"]["count"] == 1
    assert st["admit"]["count"] == 2 and st["wait"]["count"] == 2
    assert abs(st["wait"]["sum_s"] - 0.050) < 1e-6
    assert c["lateness"]["count"] == 1 and abs(c["lateness"]["sum_s"] - 1.08) < 1e-6
    le_01 = dict(c["claim_to_start"]["buckets"])[0.1]
    assert le_01 == 1 and dict(c["claim_to_start"]["buckets"])[0.05] == 0
