"""Lifecycle controls: fencing on every write, ownership merge, stalls and dead-letter, time
controls, and the operator plane. Deterministic time through the backend's test clock."""

from __future__ import annotations

import pytest

from magpie.errors import Refusal
from magpie.queue import GONE, LEASE_LOST, LeaseLost, Payload, QueueError, is_lease_score
from magpie.base.routes import Route


def item(i, ws=(1,), user=None, pw=None):
    h = f"{i:024x}"
    return h, Payload(i, Route("socks5", "127.0.0.1", 3000 + i, user, pw), h, list(ws)).encode()


def claimed(q, clock, *items, lease_ms=None):
    q.schedule(items)
    for h, _ in items:
        q.force_due(h, clock.now - 1)
    return q.pop(len(items), lease_ms=lease_ms)


@pytest.fixture
def cq(make_queue, clock):
    return make_queue(interval_ms=60_000, lease_ms=10_000, clock=clock)


def stale_and_current(q, clock):
    h, p = item(1)
    a = claimed(q, clock, (h, p))[0]
    clock.advance(10_001)
    b = q.pop(1)[0]
    assert b.member == h and b.stalled
    return a, b


# -- 1. every per-route write is fenced -----------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda q, le: q.renew(le),
    lambda q, le: q.complete_one(le),
    lambda q, le: q.complete_with_payload(le, le.payload),
    lambda q, le: q.retry(le, 1000),
    lambda q, le: q.progress(le, "50%"),
    lambda q, le: q.log(le, "attempt 1"),
    lambda q, le: q.remove(le),
], ids=["renew", "complete", "complete_with_payload", "retry", "progress", "log", "remove"])
def test_stale_holder_write_changes_nothing_and_cancels(cq, clock, call):
    a, b = stale_and_current(cq, clock)
    before = cq.inspect(a.member)
    with pytest.raises(LeaseLost) as exc:
        call(cq, a)
    assert exc.value.code is Refusal.LEASE_LOST
    assert a.cancelled and not b.cancelled
    assert cq.inspect(a.member) == before
    cq.complete_one(b)  # the current holder is unaffected


def test_current_holder_progress_and_logs_are_bounded(make_queue, clock):
    q = make_queue(clock=clock, log_limit=5)
    le = claimed(q, clock, item(1))[0]
    q.progress(le, "attempt 2/3")
    for i in range(8):
        n = q.log(le, f"line {i}")
    assert n == 5
    info = q.inspect(le.member)
    assert info["progress"] == "attempt 2/3"
    assert info["logs"] == [f"line {i}" for i in range(3, 8)]
    assert info["state"] == "leased"


# -- 2. completion with an ownership delta ------------------------------------------------------------------
def test_concurrent_import_and_ownership_change_both_survive(cq, clock):
    h, p = item(1, ws=(1, 2))
    le = claimed(cq, clock, (h, p))[0]
    cq.schedule([item(1, ws=(3,))])  # an import adds workspace 3 during the check
    desired = Payload.decode(p)
    desired.workspaces = [1]  # the check drops workspace 2
    assert cq.complete_with_payload(le, desired.encode()) == "completed"
    now = Payload.decode(cq.payload(h))
    assert now.workspaces == [1, 3]
    assert not is_lease_score(cq.score(h))


def test_ownership_change_keeps_current_credentials(cq, clock):
    h, p = item(1, ws=(1,), user="u", pw="old")
    le = claimed(cq, clock, (h, p))[0]
    newer = Payload.decode(p)
    newer.route = Route("socks5", "127.0.0.1", 3001, "u", "rotated")
    newer.workspaces = [1, 4]
    cq.update(h, newer.encode(), p, force=True)  # credentials rotated meanwhile
    desired = Payload.decode(p)
    desired.workspaces = [1, 2]
    cq.complete_with_payload(le, desired.encode())
    got = Payload.decode(cq.payload(h))
    assert got.route.password == "rotated" and got.workspaces == [1, 2, 4]


def test_route_left_without_workspace_is_removed(cq, clock):
    h, p = item(1, ws=(5,))
    le = claimed(cq, clock, (h, p))[0]
    desired = Payload.decode(p)
    desired.workspaces = []
    assert cq.complete_with_payload(le, desired.encode()) == "removed"
    assert cq.payload(h) is None and cq.score(h) is None
    assert cq.status()["totals"]["leased"] == 0


# -- 4. stalls and dead-letter -----------------------------------------------------------------------------
def test_route_stalled_more_than_max_is_dead_lettered(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=3)
    h, p = item(1)
    q.mark_started(claimed(q, clock, (h, p)))
    # every started stall counts; the first max_stalled - 1 make the route a suspect, then it is alone
    for expected_stalls, alone in ((1, False), (2, False), (3, True)):
        clock.advance(1001)
        le = q.pop(1)
        assert [x.member for x in le] == [h] and le[0].stalled and le[0].alone is alone
        assert q.inspect(h)["stalls"] == expected_stalls
        q.mark_started(le)
    clock.advance(1001)
    assert q.pop(1) == []  # the 4th counted stall (> 3) dead-letters instead
    assert q.last_pop["dead_lettered"] == 1
    dead = q.dead_letters()
    assert dead == [{"member": h, "dead_at_ms": clock.now, "reason": "stalled", "stalls": 4, "claims": 4,
                     "alone": True}]
    info = q.inspect(h)
    assert info["state"] == "dead" and info["payload"] == p
    clock.advance(10**9)
    assert q.pop(10) == []  # never claimed again
    assert q.reprocess(h) == clock.now
    again = q.pop(1)[0]
    assert again.member == h and not again.stalled and q.inspect(h)["stalls"] == 0
    with pytest.raises(QueueError) as exc:
        q.reprocess(h)
    assert exc.value.code is Refusal.NOT_DEAD


def test_completed_check_resets_stall_count(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=2)
    h, p = item(1)
    q.mark_started(claimed(q, clock, (h, p)))
    for _ in range(2):
        clock.advance(1001)
        le = q.pop(1)[0]
        q.mark_started([le])
    assert q.inspect(h)["stalls"] == 2 and le.alone
    q.complete_one(le)
    assert q.inspect(h)["stalls"] == 0
    clock.advance(60_001)
    le = q.pop(1)[0]
    assert not le.alone  # a completion ends the quarantine
    q.mark_started([le])
    for _ in range(2):
        clock.advance(1001)
        le = q.pop(1)
        assert [x.member for x in le] == [h]  # one counted stall again is within the bound
        q.mark_started(le)


def test_stall_count_is_keyed_on_the_route_not_the_task(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=2)
    a, b = item(1), item(2)
    q.mark_started(claimed(q, clock, a, b))
    clock.advance(1001)
    got = q.pop(1)  # only route a (earlier) is re-claimed
    assert [x.member for x in got] == [a[0]]
    assert q.inspect(a[0])["stalls"] == 1 and q.inspect(b[0])["stalls"] == 0


# -- 5. time controls --------------------------------------------------------------------------------------
def test_enqueue_in_zero_checks_now_without_a_second_copy(cq, clock):
    h, p = item(1)
    cq.schedule([(h, p)])
    cq.force_due(h, clock.now + 3_000_000)
    total_before = cq.status()["totals"]["scheduled"]
    assert cq.enqueue_in(h, 0) == clock.now
    assert cq.status()["totals"]["scheduled"] == total_before
    le = cq.pop(5)
    assert [x.member for x in le] == [h]
    cq.complete_one(le[0])
    assert float(cq.score(h)) == clock.now + cq.interval_ms  # cadence continues


def test_enqueue_at_refuses_running_dead_and_unknown_routes(cq, clock):
    h, p = item(1)
    le = claimed(cq, clock, (h, p))[0]
    with pytest.raises(QueueError) as exc:
        cq.enqueue_at(h, clock.now + 5)
    assert exc.value.code is Refusal.LEASED
    with pytest.raises(QueueError) as exc:
        cq.enqueue_in("f" * 24, 0)
    assert exc.value.code is Refusal.GONE
    cq.complete_one(le)
    assert cq.enqueue_at(h, clock.now + 5000) == clock.now + 5000


def test_check_now_on_an_expired_lease_is_not_refused_as_leased(cq, clock):
    """The holder vanished: its expired lease no longer holds the route, so "check now" takes effect, and
    the stale holder's completion is refused."""
    h, p = item(1)
    le = claimed(cq, clock, (h, p))[0]
    clock.advance(10_001)  # the lease (10 s) expired, no claim met it yet
    assert cq.enqueue_in(h, 0) == clock.now
    assert float(cq.score(h)) == clock.now
    assert cq.status()["totals"]["leased"] == 0 and cq.status()["totals"]["expired_leases"] == 0
    assert cq.complete([le]) == [LEASE_LOST]
    again = cq.pop(1)
    assert [x.member for x in again] == [h] and not again[0].stalled


def test_retry_uses_the_delay_and_counts_attempts(cq, clock):
    h, p = item(1)
    le = claimed(cq, clock, (h, p))[0]
    assert cq.retry(le, 2000) == 1
    assert cq.inspect(h)["state"] == "retry"
    assert cq.pop(1) == []
    clock.advance(2000)
    le2 = cq.pop(1)[0]
    assert le2.retry_attempts == 1
    assert cq.retry(le2, 4000) == 2
    clock.advance(4000)
    le3 = cq.pop(1)[0]
    assert le3.retry_attempts == 2
    cq.complete_one(le3)
    assert cq.inspect(h)["retries"] == 0


def test_new_interval_applies_lazily_on_completion(make_queue, clock):
    q = make_queue(clock=clock, interval_ms=60_000)
    h, p = item(1)
    le = claimed(q, clock, (h, p))[0]
    q.complete([le], interval_ms=5_000)
    assert float(q.score(h)) == clock.now + 5_000


def test_respread_spreads_evenly_and_spares_leases(cq, clock):
    items = [item(i) for i in range(20)]
    cq.schedule(items)
    for h, _ in items:
        cq.force_due(h, clock.now - 10)
    held = cq.pop(2)
    res = cq.respread(interval_ms=20_000)
    assert res == {"moved": 18, "leased": 2, "missing": 0}
    scores = sorted(float(cq.score(h)) - clock.now for h, _ in items if h not in {x.member for x in held})
    assert scores[0] >= 0 and scores[-1] < 20_000
    assert len(set(scores)) == 18
    for le in held:
        assert cq.score(le.member) == le.lease_score


# -- 8. operator plane -------------------------------------------------------------------------------------
def test_pause_is_checked_inside_pop(cq, clock):
    items = [item(i) for i in range(3)]
    cq.schedule(items)
    for h, _ in items:
        cq.force_due(h, clock.now - 1)
    held = cq.pop(1)
    cq.pause()
    assert cq.is_paused() and cq.pop(10) == [] and cq.last_pop["paused"]
    cq.complete_one(held[0])  # a lease already out may finish
    cq.resume()
    assert len(cq.pop(10)) == 2


def test_drain_spares_leased_routes_and_reports_counts(cq, clock):
    items = [item(i) for i in range(10)]
    cq.schedule(items)
    for h, _ in items[:6]:
        cq.force_due(h, clock.now - 1)
    held = cq.pop(2)
    res = cq.drain(batch=3)
    assert res == {"due": 4, "waiting": 4, "leased_spared": 2}
    st = cq.status()["totals"]
    assert st["scheduled"] == 2 and st["leased"] == 2
    for h, _ in items:
        if h not in {x.member for x in held}:
            assert cq.payload(h) is None
    for le in held:
        cq.complete_one(le)


def test_obliterate_refusals_then_batches_until_done(cq, clock):
    items = [item(i) for i in range(25)]
    cq.schedule(items)
    cq.force_due(items[0][0], clock.now - 1)
    le = cq.pop(1)[0]
    cq.log(le, "x")
    with pytest.raises(QueueError) as exc:
        cq.obliterate()
    assert exc.value.code is Refusal.NOT_PAUSED
    cq.pause()
    with pytest.raises(QueueError) as exc:
        cq.obliterate()
    assert exc.value.code is Refusal.ACTIVE_LEASES
    results = []
    while True:
        status, n = cq.obliterate(force=True, batch=10)
        results.append((status, n))
        if status == "done":
            break
    assert [s for s, _ in results] == ["more", "more", "done"]
    assert sum(n for _, n in results) == 25
    assert cq.leftovers() == []
    assert not cq.is_paused()


def test_operator_remove_refuses_live_lease_unless_forced(cq, clock):
    h, p = item(1)
    le = claimed(cq, clock, (h, p))[0]
    with pytest.raises(QueueError) as exc:
        cq.remove_route(h)
    assert exc.value.code is Refusal.ACTIVE_LEASES
    cq.remove_route(h, force=True)
    assert cq.inspect(h)["state"] == "gone"
    assert cq.complete([le]) == [GONE]
    with pytest.raises(QueueError) as exc:
        cq.remove_route(h)
    assert exc.value.code is Refusal.GONE


def test_update_from_an_older_read_keeps_the_workspace_an_import_added(cq, clock):
    """An operator update built from a snapshot taken before an import merged a workspace is refused
    (``payload_changed``) and changes nothing; built from the current payload it applies."""
    h, p = item(1, ws=(1,))
    cq.schedule([(h, p)])
    snapshot = cq.payload(h)
    cq.schedule([item(1, ws=(2,))])  # an import adds workspace 2
    merged = cq.payload(h)
    assert Payload.decode(merged).workspaces == [1, 2]
    edit = Payload.decode(snapshot)
    edit.route = Route("socks5", "127.0.0.1", 3001, "u", "new")
    with pytest.raises(QueueError) as exc:
        cq.update(h, edit.encode(), snapshot)
    assert exc.value.code is Refusal.PAYLOAD_CHANGED
    assert cq.payload(h) == merged
    fresh = Payload.decode(merged)
    fresh.route = edit.route
    cq.update(h, fresh.encode(), merged)
    assert Payload.decode(cq.payload(h)).workspaces == [1, 2]


def test_update_refuses_a_live_lease_unless_forced(cq, clock):
    h, p = item(1)
    le = claimed(cq, clock, (h, p))[0]
    edit = Payload.decode(p)
    edit.workspaces = [1, 5]
    with pytest.raises(QueueError) as exc:
        cq.update(h, edit.encode(), p)
    assert exc.value.code is Refusal.ACTIVE_LEASES
    assert cq.payload(h) == p
    cq.update(h, edit.encode(), p, force=True)
    assert Payload.decode(cq.payload(h)).workspaces == [1, 5]
    with pytest.raises(QueueError, match="payload_changed"):
        cq.remove(le)  # the holder read the old payload


def test_operator_remove_is_fenced_on_the_payload_read(cq, clock):
    h, p = item(1, ws=(1,))
    cq.schedule([(h, p)])
    cq.schedule([item(1, ws=(2,))])
    with pytest.raises(QueueError) as exc:
        cq.remove_route(h, expected=p)
    assert exc.value.code is Refusal.PAYLOAD_CHANGED
    assert Payload.decode(cq.payload(h)).workspaces == [1, 2]
    cq.remove_route(h, expected=cq.payload(h))
    assert cq.inspect(h)["state"] == "gone" and cq.payload(h) is None


def test_update_unknown_route_is_refused(cq):
    with pytest.raises(QueueError) as exc:
        cq.update("0" * 24, "{}", "{}")
    assert exc.value.code is Refusal.GONE


def test_expired_leases_never_block_claims_under_max_inflight(make_queue, clock):
    """Holders that died with the cap's worth of leases: their expired leases must still be re-claimed
    (regression: a counter of outstanding leases counted them forever and starved the schedule)."""
    q = make_queue(clock=clock, lease_ms=1000)
    items = [item(i) for i in range(2)]
    q.schedule(items)
    for h, _ in items:
        q.force_due(h, clock.now - 1)
    assert len(q.pop(3, max_inflight=2)) == 2  # the holder then vanishes
    assert q.pop(3, max_inflight=2) == []
    clock.advance(1001)
    again = q.pop(3, max_inflight=2)
    assert len(again) == 2 and all(le.stalled for le in again)
    st = q.status()["totals"]
    assert st["leased"] == 2 and st["expired_leases"] == 0


def test_stall_and_retry_counts_reset_after_any_completed_cycle(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=1)
    h, p = item(1)
    claimed(q, clock, (h, p))
    clock.advance(1001)
    stalled = q.pop(1)[0]  # stall 1
    assert q.retry(stalled, 10) == 1  # the holder came back: judge down, retried
    clock.advance(10)
    le = q.pop(1)[0]
    q.complete_one(le)
    info = q.inspect(h)
    assert (info["stalls"], info["retries"]) == (0, 0)
    clock.advance(60_001)
    q.pop(1)
    clock.advance(1001)
    assert [x.member for x in q.pop(1)] == [h]  # one new stall is within the bound again
