"""promote and the check batch against real Redis, with a stand-in checker (a unit seam, no network)."""

from __future__ import annotations

import time

import pytest

from magpie.checker import CheckResult
from magpie.cycle import promote, run_check_batch
from magpie.queue import Lease, Payload, QueueKeys, RouteQueue, is_lease_score
from magpie.routes import Route


class FakeChecker:
    """Calls before_attempt like the real checker does, then answers alive."""

    def __init__(self, attempts=2, pause=0.0, on_check=None):
        self.attempts, self.pause, self.on_check = attempts, pause, on_check
        self.checked = []

    def check(self, route, before_attempt=None):
        for n in range(1, self.attempts + 1):
            if before_attempt and not before_attempt(n):
                return CheckResult(False, None, None, n - 1, "Aborted", None, None, "j", 0)
            time.sleep(self.pause)
        if self.on_check:
            self.on_check(route)
        self.checked.append(route)
        return CheckResult(True, 12.5, 200, self.attempts, None, "{}", "elite", "j", int(time.time() * 1000))


@pytest.fixture
def q(redis_client, redis_prefix):
    return RouteQueue(redis_client, QueueKeys(redis_prefix, 4), interval_ms=60_000, lease_ms=60_000)


def seed(q, n):
    items = []
    for i in range(n):
        h = f"{i:024x}"
        items.append((h, Payload(i + 1, Route("socks5", "127.0.0.1", 2000 + i), h, [1]).encode()))
    q.schedule(items)
    for h, _ in items:
        shard = q.keys.shard_of(h)
        q.r.zadd(shard, {h: 1000})
        q.r.zadd(q.keys.heads, {shard: 1000})
    return items


def test_promote_batches_leases_into_messages_and_respects_budget(q):
    seed(q, 50)
    messages = []
    n = promote(q, messages.append, budget=40, max_inflight=1000, pop_batch=16, routes_per_task=8)
    assert n == 40
    assert [len(m) for m in messages] == [8, 8, 8, 8, 8]
    leases = [Lease.from_dict(d) for m in messages for d in m]
    assert len({le.member for le in leases}) == 40
    assert all(is_lease_score(le.lease_score) for le in leases)


def test_promote_never_exceeds_max_inflight(q):
    seed(q, 30)
    sent = []
    assert promote(q, sent.append, budget=100, max_inflight=10) == 10
    assert promote(q, sent.append, budget=100, max_inflight=10) == 0


def test_check_batch_completes_and_publishes(q):
    seed(q, 5)
    leases = q.pop(5)
    published = []
    rep = run_check_batch(q, FakeChecker(), leases, publish=published.extend, renew_below_ms=1000)
    assert rep.completed == 5 and rep.published == 5
    assert {e["route_id"] for e in published} == {"1", "2", "3", "4", "5"}
    assert all(e["alive"] == "1" for e in published)
    assert q.status()["totals"]["leased"] == 0


def test_check_batch_drops_result_when_lease_was_lost(q):
    seed(q, 1)
    stale = q.pop(1, lease_ms=150)
    current = []

    def takeover(_route):  # the check outlives its lease; another worker re-claims the route
        time.sleep(0.25)
        current.extend(q.pop(1))

    published = []
    rep = run_check_batch(q, FakeChecker(attempts=1, on_check=takeover), stale, publish=published.extend,
                          renew_below_ms=0)
    assert len(current) == 1 and current[0].stalled
    assert rep.lease_lost == 1 and rep.completed == 0 and published == []
    assert q.score(current[0].member) == current[0].lease_score


def test_check_renews_between_attempts_when_little_time_remains(q):
    seed(q, 1)
    le = q.pop(1, lease_ms=2000)[0]
    first = le.lease_score
    rep = run_check_batch(q, FakeChecker(attempts=2), [le], publish=lambda e: None, renew_below_ms=60_000)
    assert rep.completed == 1
    assert le.lease_score != first  # renewed before attempts


def test_lost_lease_cancels_check_at_next_attempt(q):
    seed(q, 1)
    le = q.pop(1, lease_ms=50)[0]
    time.sleep(0.1)
    q.pop(1)  # taken over
    checker = FakeChecker(attempts=3)
    rep = run_check_batch(q, checker, [le], publish=lambda e: None, renew_below_ms=60_000)
    assert rep.aborted == 1 and checker.checked == []


class DownJudgeChecker(FakeChecker):
    """Every check fails and the judge is unreachable directly: an infrastructure failure."""

    def check(self, route, before_attempt=None):
        return CheckResult(False, None, None, 1, "ConnectionError", None, None, "j", 0)

    def learn_own_address(self, refresh=False):
        return None


def test_infrastructure_failure_retries_on_backoff_not_full_interval(q):
    from magpie.backoff import Backoff

    seed(q, 2)
    leases = q.pop(2)
    published = []
    rep = run_check_batch(q, DownJudgeChecker(), leases, publish=published.extend, renew_below_ms=0,
                          backoff=Backoff("fixed", 2_000, 2_000))
    assert rep.retried == 2 and rep.completed == 0 and published == []
    now = q.server_time_ms()
    for le in leases:
        info = q.inspect(le.member)
        assert info["state"] == "retry" and info["retries"] == 1
        assert now < float(info["score"]) <= now + 2_000  # backoff delay, not the 60 s interval


def test_dead_route_with_judge_up_completes_normally(q):
    class DeadRoute(FakeChecker):
        def check(self, route, before_attempt=None):
            return CheckResult(False, None, None, 2, "ProxyError", None, None, "j", 1)

        def learn_own_address(self, refresh=False):
            return {"127.0.0.1"}

    seed(q, 1)
    published = []
    rep = run_check_batch(q, DeadRoute(), q.pop(1), publish=published.extend, renew_below_ms=0)
    assert rep.completed == 1 and published[0]["alive"] == "0"


def test_runtime_resources_build_in_any_order(monkeypatch, settings):
    """route_queue() builds redis_client() inside its own factory: the cache lock must be re-entrant."""
    import threading

    from magpie import runtime

    monkeypatch.setattr(runtime, "_cache", {})
    monkeypatch.setattr(runtime, "settings", lambda: settings)
    out = []
    t = threading.Thread(target=lambda: out.append(runtime.route_queue()), daemon=True)
    t.start()
    t.join(5)
    assert out and out[0].keys.prefix == settings.redis_prefix
