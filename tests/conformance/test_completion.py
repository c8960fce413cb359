"""Completion with results and ownership changes in one fenced call, on every provider: a result is
recorded iff its lease completed, an ownership change applies only the holder's delta, and a route left
without owners is removed with no result."""

from __future__ import annotations

import json

import pytest

from magpie.queue import COMPLETED, LEASE_LOST, REMOVED, Payload
from magpie.queue.completion import StreamTarget
from magpie.base.routes import Route


def item(i, ws):
    h = f"{i:024x}"
    return h, Payload(i, Route("socks5", "127.0.0.1", 3000 + i), h, list(ws)).encode()


@pytest.fixture
def cq(make_queue, clock):
    return make_queue(interval_ms=60_000, lease_ms=10_000, clock=clock)


def _results(r, key):
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(key)]


def _target(cq, results_key) -> StreamTarget:
    """The deployment's results stream (a partitioned schedule writes it to each partition's own)."""
    return StreamTarget(results_key("stats:results"), "g", 1000)


def _streams(cq, stream) -> list[str]:
    """Every stream ``stream``'s entries land in: one, or one per partition."""
    return [cq.stream_of(q, stream).key for q in cq.parts] if hasattr(cq, "parts") else [stream.key]


def test_ownership_changes_and_results_complete_together(cq, clock, redis_client, results_key):
    items = [item(1, [1]), item(2, [1, 2]), item(3, [1])]
    cq.schedule(items)
    for h, _ in items:
        cq.force_due(h, clock.now - 1)
    leases = sorted(cq.pop(3), key=lambda le: le.member)
    (h1, _), (h2, _), (h3, _) = items
    # an import adds workspace 3 to route 2 while its lease is out
    cq.put_payload(h2, Payload(2, Route("socks5", "127.0.0.1", 3002), h2, [1, 2, 3]).encode())
    stream = _target(cq, results_key)
    comp = cq.complete_with_results(leases, [{"n": "1"}, {"n": "2"}, {"n": "3"}], stream,
                                    desired=[None, json.dumps({"w": [2]}), json.dumps({"w": []})])
    assert comp.codes == [COMPLETED, COMPLETED, REMOVED]
    assert json.loads(cq.payload(h1))["w"] == [1]
    assert json.loads(cq.payload(h2))["w"] == [2, 3]  # only the holder's delta; the import's owner stays
    assert cq.payload(h3) is None and cq.score(h3) is None
    got = [r["n"] for key in _streams(cq, stream) for r in _results(redis_client, key)]
    assert sorted(got) == ["1", "2"]  # none for the removed
    assert cq.status()["totals"]["leased"] == 0


def test_a_stale_holders_ownership_change_changes_nothing(cq, clock, redis_client, results_key):
    h, p = item(1, [1, 2])
    cq.schedule([(h, p)])
    cq.force_due(h, clock.now - 1)
    stale = cq.pop(1)[0]
    clock.advance(10_001)
    current = cq.pop(1)[0]
    stream = _target(cq, results_key)
    comp = cq.complete_with_results([stale], [{"n": "1"}], stream, desired=[json.dumps({"w": []})])
    assert comp.codes == [LEASE_LOST] and stale.cancelled
    assert cq.payload(h) == p and sum(redis_client.xlen(key) for key in _streams(cq, stream)) == 0
    cq.complete_one(current)


def test_on_a_cluster_a_stream_outside_the_schedules_tag_is_refused_and_changes_nothing(cq, clock, backend,
                                                                                       redis_client, redis_prefix):
    """The one cluster difference: the completion script takes the schedule's keys and the stream's in one
    call, so a stream key without the schedule's hash tag is refused (CROSSSLOT) before anything runs;
    magpie keys the stream ``<prefix>{default}:stats:results`` on a cluster (magpie.queue.streams)."""
    import redis
    from redis.exceptions import RedisClusterException

    if not backend.startswith("redis-cluster"):
        pytest.skip("one Redis server has no slots")
    h, p = item(1, [1])
    cq.schedule([(h, p)])
    cq.force_due(h, clock.now - 1)
    le = cq.pop(1)[0]
    with pytest.raises((redis.RedisError, RedisClusterException)) as err:  # redis-py checks before sending
        cq.complete_with_results([le], [{"n": "1"}], StreamTarget(redis_prefix + "results", "g", 1000))
    assert "slot" in str(err.value).lower()
    assert cq.status()["totals"]["leased"] == 1  # the lease is still out: nothing ran
    cq.complete_one(le)  # the same lease completes afterwards with a tagged stream or none
    assert cq.status()["totals"]["leased"] == 0
