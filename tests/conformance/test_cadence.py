"""Cadence rules: a route's own interval, workspace cadences, the dead-route policy and the priority lane.

The Redis schedule carries them; the PostgreSQL schedule refuses a per-route interval with one line naming
the backend (docs/schedule-backends.md)."""

from __future__ import annotations

import pytest

from magpie.errors import RefusedError
from magpie.queue import Payload
from magpie.queue.cadence import profile_cadence, restore_profile_cadences, route_cadence, walk_workspace
from magpie.base.routes import Route

INTERVAL = 60_000


def item(i, ws=(1,)):
    h = f"{i:024x}"
    return h, Payload(i, Route("socks5", "127.0.0.1", 3000 + i, None, None), h, list(ws)).encode()


def redis_only(backend):
    if not backend.startswith("redis"):
        pytest.skip("the PostgreSQL schedule carries no cadence (refusal covered by its own test)")


def keys(q, name):
    """Every key ``name`` (a :class:`QueueKeys` attribute) of the schedule: one, or one per partition."""
    return q.all_keys(name) if hasattr(q, "all_keys") else [getattr(q.keys, name)]


def key_of(q, name, member):
    """Key ``name`` of the partition holding ``member``."""
    return getattr(q.keys_of(member) if hasattr(q, "keys_of") else q.keys, name)


def cycle(q, clock, member, alive=None):
    """Make ``member`` due, claim it, complete it (with an alive verdict when given); returns the due time
    the completion set, relative to now."""
    q.force_due(member, clock.now - 1)
    le = [x for x in q.pop(50) if x.member == member][0]
    results = None if alive is None else [{"alive": "1" if alive else "0"}]
    assert q.complete_with_results([le], results, None).codes == [1]
    return float(q.score(member)) - clock.now


def test_route_interval_sets_next_due(make_queue, clock, backend):
    q = make_queue(interval_ms=INTERVAL, clock=clock)
    h, p = item(1)
    q.schedule([(h, p)])
    if not backend.startswith("redis"):
        with pytest.raises(RefusedError) as err:
            q.set_route_interval(h, 10_000)
        assert "postgresql" in str(err.value) and "\n" not in str(err.value)
        return
    assert cycle(q, clock, h) == INTERVAL
    out = q.set_route_interval(h, 10_000)
    assert out["interval_ms"] == 10_000
    assert 0 <= out["due_ms"] - clock.now <= 10_000  # moved into the new interval at once
    assert cycle(q, clock, h) == 10_000
    q.set_route_interval(h, None)
    assert route_cadence(q, h)["interval_ms"] is None
    assert cycle(q, clock, h) == INTERVAL


def test_route_interval_of_a_leased_route_applies_at_its_completion(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock)
    h, p = item(2)
    q.schedule([(h, p)])
    q.force_due(h, clock.now - 1)
    le = q.pop(1)[0]
    q.set_route_interval(h, 5_000)
    assert q.score(h) == f"{float(le.lease_score):.2f}"  # the lease is untouched
    q.complete_one(le)
    assert float(q.score(h)) - clock.now == 5_000


def test_route_interval_of_an_unknown_route_is_refused(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(clock=clock)
    with pytest.raises(RefusedError):
        q.set_route_interval(f"{99:024x}", 5_000)
    with pytest.raises(ValueError):
        q.set_route_interval(f"{99:024x}", 10)


def test_workspace_interval_moves_only_its_routes_and_reaches_new_imports(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock)
    mine = [item(i, ws=(1,)) for i in range(10, 20)]
    other = [item(i, ws=(2,)) for i in range(20, 30)]
    q.schedule(mine + other)
    before = {h: q.score(h) for h, _ in other}
    counts = q.set_workspace_cadence(1, interval_ms=6_000)
    assert counts["routes"] == 10
    for h, _ in mine:
        assert float(q.score(h)) - clock.now <= 6_000
    assert {h: q.score(h) for h, _ in other} == before
    assert cycle(q, clock, mine[0][0]) == 6_000
    assert cycle(q, clock, other[0][0]) == INTERVAL
    new_h, new_p = item(40, ws=(1,))
    q.schedule([(new_h, new_p)])
    assert cycle(q, clock, new_h) == 6_000
    q.set_route_interval(mine[1][0], 2_000)  # a route's override beats its workspace
    assert cycle(q, clock, mine[1][0]) == 2_000
    q.set_workspace_cadence(1)  # cleared: back to the deployment's interval, the override stays
    assert cycle(q, clock, mine[0][0]) == INTERVAL
    assert cycle(q, clock, mine[1][0]) == 2_000


def test_workspace_walk_resumes_where_it_was_interrupted(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock, shards=4)
    routes = [item(i, ws=(3,)) for i in range(50, 90)]
    q.schedule(routes)

    def stop(c):
        if c["shard"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        q.set_workspace_cadence(3, interval_ms=4_000, progress=stop)
    out = walk_workspace(q, 3)
    assert out["resumed"] is True and out["routes"] == len(routes)
    assert all(float(q.score(h)) - clock.now <= 4_000 for h, _ in routes)
    assert not q.r.exists(q.side_key("cadence_walk:3"))
    for part in getattr(q, "parts", []):
        assert not q.r.exists(part.side_key("cadence_walk:3"))


def test_profile_interval_is_refused_by_the_postgresql_schedule(make_queue, clock, backend):
    q = make_queue(interval_ms=INTERVAL, clock=clock)
    if backend.startswith("redis"):
        assert q.carries_cadence is True
        return
    assert q.carries_cadence is False
    with pytest.raises(RefusedError) as err:
        q.set_profile_cadence(1, interval_ms=10_000)
    assert "postgresql" in str(err.value) and "\n" not in str(err.value)


def test_profile_interval_beats_the_workspace_and_a_route_override_beats_both(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock)
    mine = [item(i, ws=(11,)) for i in range(500, 510)]
    other = [item(i, ws=(12,)) for i in range(510, 515)]
    q.schedule(mine + other)
    before = {h: q.score(h) for h, _ in other}
    q.set_workspace_cadence(11, interval_ms=30_000)
    counts = q.set_profile_cadence(11, interval_ms=6_000)
    assert counts["routes"] == len(mine)  # only the profile's workspace is walked
    assert {h: q.score(h) for h, _ in other} == before
    assert all(float(q.score(h)) - clock.now <= 6_000 for h, _ in mine)
    assert profile_cadence(q, 11) == {"interval_ms": 6_000, "dead_after": 0, "dead_factor": 0}
    assert cycle(q, clock, mine[0][0]) == 6_000  # the profile, not the workspace's 30 s
    q.set_route_interval(mine[1][0], 2_000)
    assert cycle(q, clock, mine[1][0]) == 2_000  # the route's override beats its profile
    new_h, new_p = item(520, ws=(11,))
    q.schedule([(new_h, new_p)])
    assert cycle(q, clock, new_h) == 6_000  # a new import takes the profile's cadence
    q.set_profile_cadence(11)  # cleared: back to the workspace's interval, the override stays
    assert profile_cadence(q, 11) is None
    assert cycle(q, clock, mine[0][0]) == 30_000
    assert cycle(q, clock, mine[1][0]) == 2_000
    assert cycle(q, clock, other[0][0]) == INTERVAL


def test_profile_and_workspace_cadences_combine_field_by_field(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock)
    (a, pa), (b, pb) = item(530, ws=(13,)), item(531, ws=(13, 14))
    q.schedule([(a, pa), (b, pb)])
    q.set_workspace_cadence(13, interval_ms=10_000)
    q.set_profile_cadence(13, dead_after=1, dead_factor=5)  # the profile sets the policy only
    assert cycle(q, clock, a, alive=False) == 5 * 10_000  # workspace's interval x profile's factor
    assert cycle(q, clock, a, alive=True) == 10_000
    q.set_profile_cadence(14, interval_ms=4_000, dead_after=1, dead_factor=3)
    assert cycle(q, clock, b, alive=False) == 3 * 4_000  # shortest interval, smallest factor of the two
    q.set_workspace_cadence(13, dead_after=1, dead_factor=2)  # the profile's policy still wins for 13
    assert route_cadence(q, a)["policy"] == "1:5"


def test_profile_walk_resumes_and_a_rebuild_restores_profile_cadences(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock, shards=4)
    routes = [item(i, ws=(15,)) for i in range(540, 580)]
    q.schedule(routes)

    def stop(c):
        if c["shard"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        q.set_profile_cadence(15, interval_ms=4_000, progress=stop)
    assert not all(float(q.score(h)) - clock.now <= 4_000 for h, _ in routes)  # stopped half way
    out = walk_workspace(q, 15)
    assert out["resumed"] is True and out["routes"] == len(routes)
    assert all(float(q.score(h)) - clock.now <= 4_000 for h, _ in routes)
    assert not q.r.exists(q.side_key("cadence_walk:15"))
    for part in getattr(q, "parts", []):
        assert not q.r.exists(part.side_key("cadence_walk:15"))
    # Redis lost the cadences: what PostgreSQL holds is written back before routes are added again
    for key in keys(q, "ws_cadence") + keys(q, "cadence"):
        q.r.delete(key)
    assert restore_profile_cadences(q, {15: {"interval_ms": 4_000, "dead_after": 0, "dead_factor": 0}}) == 1
    h, p = item(581, ws=(15,))
    q.schedule([(h, p)])
    assert cycle(q, clock, h) == 4_000


def test_dead_route_backs_off_until_alive(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock, dead_after=2, dead_factor=3)
    h, p = item(3)
    q.schedule([(h, p)])
    assert cycle(q, clock, h, alive=False) == INTERVAL  # one dead check: no backoff yet
    assert cycle(q, clock, h, alive=False) == 3 * INTERVAL
    assert cycle(q, clock, h, alive=False) == 3 * INTERVAL
    assert cycle(q, clock, h) == 3 * INTERVAL  # no verdict (no result): stays backed off
    assert cycle(q, clock, h, alive=True) == INTERVAL
    assert route_cadence(q, h)["dead_streak"] == 0
    assert cycle(q, clock, h, alive=False) == INTERVAL  # the streak starts over


def test_dead_route_policy_is_off_by_default(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock)
    h, p = item(4)
    q.schedule([(h, p)])
    for _ in range(4):
        assert cycle(q, clock, h, alive=False) == INTERVAL
    assert not q.r.exists(*keys(q, "cadence"))  # routes without cadence leave no state behind


def test_workspace_dead_policy_applies_to_its_routes(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock)
    (a, pa), (b, pb) = item(5, ws=(7,)), item(6, ws=(8,))
    q.schedule([(a, pa), (b, pb)])
    q.set_workspace_cadence(7, dead_after=1, dead_factor=5)
    assert cycle(q, clock, a, alive=False) == 5 * INTERVAL
    assert cycle(q, clock, b, alive=False) == INTERVAL
    assert cycle(q, clock, a, alive=True) == INTERVAL


def test_priority_goes_first_without_starving_backlog(make_queue, clock, backend):
    redis_only(backend)
    plain = make_queue(interval_ms=INTERVAL, clock=clock, shards=4)
    backlog = [item(i) for i in range(100, 130)]
    plain.schedule(backlog)
    for h, _ in backlog:
        plain.force_due(h, clock.now - 3_600_000)  # an hour overdue
    q = make_queue(interval_ms=INTERVAL, clock=clock, shards=4, priority_share=0.5)
    fresh = [item(i) for i in range(200, 230)]
    q.schedule(fresh)
    clock.advance(INTERVAL)  # every new route is due now, after the whole backlog
    old, new = {h for h, _ in backlog}, {h for h, _ in fresh}
    got_old = got_new = 0
    while got_old < len(old):
        leases = q.pop(10)
        assert leases
        n_new = sum(le.member in new for le in leases)
        if backend.endswith("-partitioned"):  # each partition's lane takes its part of the share; a partition
            # whose backlog ran out fills with its lane (as one partition does), so only "neither starves"
            assert len(leases) > n_new and (n_new > 0 or got_new == len(new))
        elif got_new < len(new):
            assert n_new == 5  # the lane takes its share, never more while backlog waits
        got_new += n_new
        got_old += len(leases) - n_new
    if backend.endswith("-partitioned"):  # lane entries claimed through the backlog leave at the next lane pass
        assert q.pop(10) == []  # of their partition, which the last claims may not have asked
    assert got_new == len(new) and not q.r.exists(*keys(q, "priority"))


def test_check_now_goes_ahead_of_an_overdue_backlog(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock, shards=4, priority_share=0.5)
    routes = [item(i) for i in range(300, 320)]
    q.schedule(routes)
    q.r.delete(*keys(q, "priority"))  # imported long ago: out of the lane
    for h, _ in routes:
        q.force_due(h, clock.now - 600_000)
    urgent = routes[-1][0]
    q.force_due(urgent, clock.now + 30_000)
    q.enqueue_in(urgent, 0)
    # partitioned: a claim of 2 asks 2 of the 4 partitions; the urgent route's comes within 2 claims
    claims = 2 if backend.endswith("-partitioned") else 1
    assert urgent in [le.member for _ in range(claims) for le in q.pop(2)]


def test_priority_lane_entries_leave_with_their_route(make_queue, clock, backend):
    redis_only(backend)
    q = make_queue(interval_ms=INTERVAL, clock=clock, priority_share=0.5)
    h, p = item(400)
    q.schedule([(h, p)])
    q.set_route_interval(h, 5_000)
    assert q.r.zscore(key_of(q, "priority", h), h) is not None
    q.remove_route(h, force=True)
    assert q.r.zscore(key_of(q, "priority", h), h) is None and not q.r.exists(*keys(q, "cadence"))
