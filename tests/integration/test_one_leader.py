"""One leader at a time: lost leases end leadership at once, fencing tokens, one run per cadence slot,
and promote's budget across concurrent passes. Restarts and pauses use a private redis-server."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import sqlalchemy as sa
from private_redis import PrivateRedis

from helpers import elapse

from magpie.pipeline.promote import give_back_promote_budget, promote_with_settings, take_promote_budget
from magpie.coordination.fencing import StaleLeader, fence, newest_generation
from magpie.coordination.leader import LeaderLock
from magpie.maintenance.base import Job
from magpie.maintenance.runner import read_job_status
from magpie.wiring.jobs import run_job
from magpie.queue import Payload, QueueKeys, RouteQueue
from magpie.base.routes import Route


def test_redis_restarted_empty_the_holder_stops_within_one_renewal_and_no_two_lead(tmp_path):
    srv = PrivateRedis(tmp_path)
    try:
        client = srv.start()
        a = LeaderLock(client, "t:", "job", ttl_ms=900)
        srv.wait_until_acquirable(a)
        times: dict[str, float] = {}
        other = redis.Redis(port=srv.port, socket_timeout=1, socket_connect_timeout=1)
        b = LeaderLock(other, "t:", "job", 900)

        def contender():  # tries to lead every 10 ms from the moment Redis dies
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    if b.acquire():
                        times["b_leads"] = time.monotonic()
                        return
                except redis.RedisError:
                    pass
                time.sleep(0.01)  # the behaviour: a contender retrying every 10 ms

        with a.hold() as lost:
            assert lost is not None
            gen_a = a.generation
            watcher = threading.Thread(
                target=lambda: lost.wait(10) and times.setdefault("a_stops", time.monotonic()))
            watcher.start()
            elapse(0.1)  # the behaviour: a leads (and renews) for a moment before its Redis dies
            times["kill"] = time.monotonic()
            srv.kill()
            th = threading.Thread(target=contender)
            th.start()
            srv.start()  # back at once, empty: the lock is gone
            th.join()
            watcher.join()
        assert "a_stops" in times and "b_leads" in times, times
        assert times["a_stops"] - times["kill"] <= a.renew_interval_s + 0.3  # within one renewal interval
        assert times["b_leads"] > times["a_stops"]  # never two leaders at once
        assert b.generation > gen_a  # the fencing token grew although Redis lost the counter
        b.release()
    finally:
        srv.stop()


def test_a_paused_redis_ends_leadership_within_the_lease(tmp_path):
    srv = PrivateRedis(tmp_path)
    try:
        client = srv.start()
        a = LeaderLock(client, "t:", "job", ttl_ms=600)
        srv.wait_until_acquirable(a)
        with a.hold() as lost:
            t0 = time.monotonic()
            srv.pause()  # the renewal hangs: the lease cannot be confirmed
            try:
                assert lost.wait(0.6)
                assert time.monotonic() - t0 <= 0.6
            finally:
                srv.resume()
    finally:
        srv.stop()


def test_a_renewal_on_another_server_ends_leadership(redis_client, redis_prefix):
    a = LeaderLock(redis_client, redis_prefix, "job", ttl_ms=5000)
    assert a.acquire() and a.renew() and not a.lost.is_set()
    a.run_id = "0" * 40  # as if Redis failed over to another server since the acquisition
    assert not a.renew() and a.lost.is_set()
    assert a.is_held()  # the key still names us, yet we no longer lead
    a.release()


def test_generations_grow_and_a_stale_generation_is_refused(redis_client, redis_prefix, db):
    a = LeaderLock(redis_client, redis_prefix, "job", ttl_ms=5000)
    b = LeaderLock(redis_client, redis_prefix, "job", ttl_ms=5000)
    assert a.acquire()
    gen_a = a.generation
    a.release()
    assert b.acquire() and b.generation > gen_a
    with db.begin() as c:
        fence(c, b.fence_name, b.generation)  # the new leader writes
    with pytest.raises(StaleLeader), db.begin() as c:
        fence(c, a.fence_name, gen_a)  # the former one, resumed, is refused
        c.execute(sa.text("CREATE TABLE never_created (x int)"))
    with db.connect() as c:
        assert newest_generation(c, b.fence_name) == b.generation
        assert c.execute(sa.text("SELECT to_regclass('never_created')")).scalar() is None
    with db.begin() as c:
        fence(c, b.fence_name, b.generation)  # the same generation writes again
    b.release()


class _Counting(Job):
    name = "slot_probe"
    every = 3600.0

    def __init__(self):
        self.runs = 0

    def run(self, ctx):
        self.runs += 1
        time.sleep(0.2)  # the behaviour: a job run that takes a while
        return {"complete": True}


def test_two_beats_run_a_job_once_per_slot(settings, db, redis_client):
    job = _Counting()
    results = []
    barrier = threading.Barrier(2)

    def beat():
        barrier.wait()
        results.append(run_job(job, settings, engine=db, redis=redis_client, once_per_slot=True))

    threads = [threading.Thread(target=beat) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r["status"] for r in results) == ["ok", "skipped"]
    # The other beat's trigger comes later in the same slot, the lock free by now: still skipped.
    again = run_job(job, settings, engine=db, redis=redis_client, once_per_slot=True)
    assert again["status"] == "skipped" and "slot" in again["reason"]
    assert job.runs == 1
    # An operator's run is not slotted.
    assert run_job(job, settings, engine=db, redis=redis_client)["status"] == "ok" and job.runs == 2
    [row] = [r for r in read_job_status(db) if r["job"] == "slot_probe"]
    assert row["runs_total"] == 2


def test_a_pass_fenced_by_a_newer_leader_records_nothing_over_it(settings, db, redis_client):
    class Overtaken(Job):
        name = "fence_probe"

        def run(self, ctx):
            with ctx.engine.begin() as c:  # meanwhile a newer leader (a higher generation) writes
                fence(c, ctx.fence_name, ctx.generation + 1)
            ctx.save_state({"cursor": 99})  # refused: this pass's generation is older
            raise AssertionError("not reached")

    out = run_job(Overtaken(), settings, engine=db, redis=redis_client)
    assert out["status"] == "skipped" and out["reason"].startswith("fenced"), out
    [row] = [r for r in read_job_status(db) if r["job"] == "fence_probe"]
    assert row["state"] == {} and row["last_success_at"] is None and row["failures_total"] == 0
    # Its next pass has a newer generation still: it runs.
    class Fine(Job):
        name = "fence_probe"

        def run(self, ctx):
            ctx.save_state({"cursor": 1})
            return {}

    assert run_job(Fine(), settings, engine=db, redis=redis_client)["status"] == "ok"
    [row] = [r for r in read_job_status(db) if r["job"] == "fence_probe"]
    assert row["state"] == {"cursor": 1} and row["last_success_at"] is not None


def _same_second(fn):
    """Run ``fn(): list[(granted, second)]`` until all its grants fall in one second of the Redis clock."""
    for _ in range(20):
        got = fn()
        if len({s for _, s in got}) == 1:
            return got
    raise AssertionError("never within one second")


def test_promote_budget_holds_across_concurrent_passes(redis_client, redis_prefix):
    q = RouteQueue(redis_client, QueueKeys(redis_prefix, 4), interval_ms=60_000, lease_ms=60_000)

    def two_passes():
        redis_client.delete(q.keys.base + "promote_budget")
        return [take_promote_budget(q, 100), take_promote_budget(q, 100)]

    (g1, s1), (g2, _) = _same_second(two_passes)
    assert (g1, g2) == (100, 0)  # the second pass in the same second gets nothing

    def hand_back():
        redis_client.delete(q.keys.base + "promote_budget")
        g, s = take_promote_budget(q, 100)
        give_back_promote_budget(q, 60, s)
        return [(g, s), take_promote_budget(q, 100)]

    assert [g for g, _ in _same_second(hand_back)] == [100, 60]


def test_promote_pass_takes_from_the_shared_budget_and_hands_back_the_rest(
    redis_client, redis_prefix, settings
):
    q = RouteQueue(redis_client, QueueKeys(redis_prefix, 4), interval_ms=60_000, lease_ms=60_000)
    items = []
    for i in range(10):
        h = f"{i:024x}"
        items.append((h, Payload(i + 1, Route("socks5", "127.0.0.1", 1000 + i), h, [1]).encode()))
    q.schedule(items)
    for h, _ in items:
        q.r.zadd(q.keys.shard_of(h), {h: 1000 + int(h, 16)})
        q.r.zadd(q.keys.heads, {q.keys.shard_of(h): 1000})
    sched = settings.model_copy(update={"promote_budget": 25, "queue_shards": 4}).schedule
    sent: list = []
    before = int(redis_client.time()[0])
    claimed = promote_with_settings(q, sched, sent.append, capacity=None)
    after = int(redis_client.time()[0])
    left, second = take_promote_budget(q, 25)
    assert claimed == 10 == sum(len(m) for m in sent)
    # 25 per second: 10 used, 15 handed back (a new second, should one have begun meanwhile, has 25).
    if second == before:
        assert left == 15
    elif second > after:
        assert left == 25
    else:  # a second began during the pass: its budget was used or not, by when the pass took it
        assert left in (15, 25)
