"""The dead-letter rule: a route is dead-lettered only for stalls its own check caused.

A lease that never started checking counts nothing when it expires. Every started stall counts; the
first ``max(max_stalled, 2) - 1`` since the last completion only make the route a suspect (its process
may have died for a neighbour, or a whole worker with hundreds of routes, so it is re-run as usual); then
it is in quarantine (``alone``: dispatched and checked alone). More than ``max_stalled`` stalls in a
row, the last in quarantine, dead-letter it.
"""

from __future__ import annotations

from magpie.queue import Payload
from magpie.base.routes import Route


def item(i: int) -> tuple[str, str]:
    h = f"{i:024x}"
    return h, Payload(i, Route("http", "127.0.0.1", 10000 + i), h, [1]).encode()


def due_batch(q, clock, n):
    items = [item(i) for i in range(1, n + 1)]
    q.schedule(items)
    for h, _ in items:
        q.force_due(h, clock.now - 1)
    return [h for h, _ in items], q.pop(n)


def expire(q, clock, n):
    clock.advance(q.lease_ms + 1)
    return q.pop(n)


def test_leases_that_never_started_expire_without_any_evidence(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=1)
    members, got = due_batch(q, clock, 5)
    for _ in range(10):  # a worker that dies before starting, again and again (prefetched messages)
        got = expire(q, clock, 5)
        assert sorted(le.member for le in got) == members
        assert all(le.stalled and not le.alone for le in got)
    assert q.dead_letters() == [] and all(q.inspect(m)["stalls"] == 0 for m in members)


def test_neighbours_of_a_crash_are_suspected_but_never_counted_unless_they_crash_alone(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=3)
    members, got = due_batch(q, clock, 6)
    poison = members[0]
    q.mark_started(got)
    claims = {m: 1 for m in members}
    for _ in range(10):  # the poison's process dies every time it runs; neighbours complete
        got = expire(q, clock, 6)
        for le in got:
            claims[le.member] += 1
            if le.member == poison:
                q.mark_started([le])
            else:
                assert not le.alone  # first stall: suspicion only
                q.mark_started([le])
                q.complete_one(le)
        if poison in {d["member"] for d in q.dead_letters()}:
            break
    [dead] = q.dead_letters()
    assert dead["member"] == poison and dead["alone"] is True and dead["stalls"] == 4
    assert claims[poison] == 3 + 1  # dead-lettered within max_stalled + 1 claims
    assert all(q.inspect(m)["stalls"] == 0 and q.inspect(m)["state"] != "dead" for m in members[1:])


def test_a_suspect_neighbour_that_completes_alone_leaves_quarantine(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=2)
    [h], got = due_batch(q, clock, 1)
    q.mark_started(got)
    [le] = expire(q, clock, 1)
    assert not le.alone and q.inspect(h)["stalls"] == 1  # a suspect: re-run as usual
    q.mark_started([le])
    [le] = expire(q, clock, 1)  # second started stall: alone now
    assert le.alone and q.inspect(h)["stalls"] == 2
    q.complete_one(le)
    assert q.inspect(h)["stalls"] == 0
    clock.advance(q.interval_ms + 1)
    [le] = q.pop(1)
    assert not le.alone and not le.stalled


def test_release_forgets_the_start_but_keeps_the_suspicion(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=2)
    [h], got = due_batch(q, clock, 1)
    q.mark_started(got)
    [le] = expire(q, clock, 1)  # suspect now
    q.mark_started([le])
    [le] = expire(q, clock, 1)
    assert le.alone
    assert q.release([le]) == [1]  # handed back unchecked: no evidence from this lease
    [le] = q.pop(1)
    assert le.alone and not le.stalled  # still in quarantine
    [le] = expire(q, clock, 1)  # expired without a start mark: not counted
    assert q.inspect(h)["stalls"] == 2 and le.alone


def test_a_renewal_moves_the_start_mark_to_the_new_lease(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=2)
    [h], [le] = due_batch(q, clock, 1)
    q.mark_started([le])
    clock.advance(500)
    q.renew(le)
    [le2] = expire(q, clock, 1)  # the renewed lease expired: evidence (suspicion)
    q.mark_started([le2])
    [le3] = expire(q, clock, 1)
    assert le3.alone and q.inspect(h)["stalls"] == 2


def test_two_whole_worker_crashes_quarantine_nobody(make_queue, clock):
    """A whole worker killed twice with its routes in flight: every route is a suspect, none in
    quarantine (they re-run as usual, in batches, not one at a time), and one completion clears each."""
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=3)
    members, got = due_batch(q, clock, 40)
    for _ in range(2):
        q.mark_started(got)
        got = expire(q, clock, 40)
        assert sorted(le.member for le in got) == members
        assert not any(le.alone for le in got)
    assert all(q.inspect(m)["stalls"] == 2 for m in members)
    q.mark_started(got)
    for le in got:
        q.complete_one(le)
    assert q.dead_letters() == [] and all(q.inspect(m)["stalls"] == 0 for m in members)


def test_a_crash_beside_neighbours_never_dead_letters_before_a_crash_alone(make_queue, clock):
    """max_stalled = 2: two crashes beside neighbours and one more as a suspect are not enough; only a
    crash during the check in quarantine dead-letters, within max_stalled + 1 claims."""
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=2)
    [h], [le] = due_batch(q, clock, 1)
    q.mark_started([le])
    [le] = expire(q, clock, 1)
    assert not le.alone
    q.mark_started([le])
    [le] = expire(q, clock, 1)
    assert le.alone and q.dead_letters() == []  # quarantined at the 2nd stall, not dead-lettered
    q.mark_started([le])
    assert expire(q, clock, 1) == [] and q.last_pop["dead_lettered"] == 1
    [dead] = q.dead_letters()
    assert dead["member"] == h and dead["claims"] == 3 and dead["alone"] is True


def test_a_withdrawn_start_mark_counts_no_stall(make_queue, clock):
    """A check whose completion the store refused withdraws its start mark: its expiry is no evidence;
    a mark of a later lease is not withdrawn by an older holder."""
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=1)
    members, got = due_batch(q, clock, 3)
    q.mark_started(got)
    by = {le.member: le for le in got}
    assert q.unmark_started([by[members[0]], by[members[1]]]) == 2
    again = expire(q, clock, 3)
    assert [q.inspect(m)["stalls"] for m in members] == [0, 0, 1]
    q.mark_started(again)
    assert q.unmark_started(got) == 0  # the old leases' marks are gone: the new holder's stay
    expire(q, clock, 3)
    assert all(q.inspect(m)["stalls"] >= 1 for m in members)


def test_withdrawing_marks_of_gone_or_foreign_leases_changes_nothing(make_queue, clock):
    """Leases of a removed route, or carrying a score that is no lease of the route, withdraw nothing
    and raise nothing."""
    import dataclasses

    q = make_queue(clock=clock, lease_ms=1000, max_stalled=3)
    members, got = due_batch(q, clock, 2)
    q.mark_started(got)
    assert q.unmark_started([]) == 0
    forged = [dataclasses.replace(le, lease_score="12345.50") for le in got]
    assert q.unmark_started(forged) == 0
    q.complete_one(got[0])
    assert q.unmark_started(got[:1]) == 0  # completed: its mark is gone already
    expire(q, clock, 2)
    assert sorted(q.inspect(m)["stalls"] for m in members) == [0, 1]


def _quarantine(q, clock, n_stalls):
    """One route stalled ``n_stalls`` times in a row with its start marked: its next lease is alone."""
    [h], got = due_batch(q, clock, 1)
    for _ in range(n_stalls):
        q.mark_started(got)
        got = expire(q, clock, 1)
    assert got[0].alone
    return h, got[0]


def test_two_crashes_of_the_isolated_check_in_a_row_dead_letter_the_route(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=3)
    h, le = _quarantine(q, clock, 3)
    assert q.report_crash(le) == 1  # one could be a stray kill: claimable at once, still in quarantine
    clock.advance(1)
    [again] = q.pop(1)
    assert again.member == h and again.alone
    assert q.report_crash(le) < 0  # the old lease is stale: nothing changes
    assert q.dead_letters() == []
    assert q.report_crash(again) == 2
    [dead] = q.dead_letters()
    assert dead["member"] == h and dead["reason"] == "crashed" and dead["alone"] is True
    assert q.pop(1) == []


def test_a_completion_between_isolated_crashes_forgives_the_first(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=2)
    h, le = _quarantine(q, clock, 2)
    assert q.report_crash(le) == 1
    clock.advance(1)
    [again] = q.pop(1)
    q.complete_one(again)
    h2, le2 = h, None
    clock.advance(q.interval_ms + 1)
    for _ in range(2):
        [le2] = q.pop(1)
        q.mark_started([le2])
        clock.advance(q.lease_ms + 1)
    [le2] = q.pop(1)
    assert le2.member == h2 and le2.alone
    assert q.report_crash(le2) == 1 and q.dead_letters() == []


def test_an_isolated_check_that_vanished_with_its_pool_counts_nothing(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=2)
    h, le = _quarantine(q, clock, 2)
    for _ in range(5):  # whole-worker crashes during the unmarked isolated check
        [le] = expire(q, clock, 1)
        assert le.member == h and le.alone
    assert q.dead_letters() == []


def test_marking_a_lease_already_marked_with_its_own_token_reports_it(make_queue, clock):
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=3)
    members, got = due_batch(q, clock, 3)
    assert q.mark_started(got[:2]) == []
    again = q.mark_started(got)
    assert [le.member for le in again] == [le.member for le in got[:2]]
    later = expire(q, clock, 3)
    assert [q.inspect(m)["stalls"] for m in members] == [1, 1, 1]  # each started lease counted once
    assert q.mark_started(later) == []  # a new lease is a new token


def test_a_renewal_leaves_an_unmarked_lease_unmarked(make_queue, clock):
    """A quarantined check in a process of its own is never marked: renewing it must not mark it, or
    a whole-worker crash during it would count against the route."""
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=2)
    h, le = _quarantine(q, clock, 2)
    le = q.renew(le)
    for _ in range(4):
        [le] = expire(q, clock, 1)
        le = q.renew(le)
    assert q.dead_letters() == [] and q.inspect(h)["stalls"] == 2


def test_a_stale_holder_cannot_mark_and_does_not_overwrite_the_new_holders_mark(make_queue, clock):
    """A process that starts a lease after it expired and was claimed again (a slow start on a loaded
    machine) is told not to start it, and the new holder's evidence stays its own."""
    q = make_queue(clock=clock, lease_ms=1000, max_stalled=3)
    [h], [old] = due_batch(q, clock, 1)
    [new] = expire(q, clock, 1)  # never started: no evidence
    assert q.inspect(h)["stalls"] == 0
    assert q.mark_started([new]) == []
    assert [le.member for le in q.mark_started([old])] == [h]  # not held any more: not to start
    expire(q, clock, 1)  # the new holder's check died: its own mark counts
    assert q.inspect(h)["stalls"] == 1
