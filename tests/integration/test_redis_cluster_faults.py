"""The Redis schedule through cluster faults (slow tier; a private 3+3 cluster per module):

* failover: the master serving the schedule's slot dies, its replica is promoted. Replication is
  asynchronous, so claims and completions the old master acknowledged may be missing on the new one; the
  tests make that loss certain (the replica frozen while they are written), count it, and show fencing
  refuses every stale completion afterwards. ``WAIT`` (``MAGPIE_REDIS_WAIT_REPLICAS``) reports each write
  the replica did not confirm, and a write it did confirm survives the failover.
* slot migration of the schedule's slot, and a MOVED/ASK storm (the slot moved back and forth in a loop),
  while a claim/renew/complete loop runs: every completion lands exactly once.

Figures (losses, failover time, errors) are printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import redis

from magpie.base import redisconn
from magpie.lab.cluster import key_slot
from magpie.queue import COMPLETED, Payload, QueueKeys, RouteQueue
from magpie.queue.completion import StreamTarget
from magpie.base.routes import Route
from magpie.queue.streams import GROUP, stream_key
from helpers import wait_until

pytestmark = pytest.mark.slow
PREFIX = "magpie-fault:"


def items(n):
    out = []
    for i in range(n):
        h = f"{i:024x}"
        out.append((h, Payload(i, Route("socks5", "127.0.0.1", 3000 + (i % 60000)), h, [1]).encode()))
    return out


def make_due(q):
    for shard in q.keys.all_shards():
        members = q.r.zrange(shard, 0, -1)
        if members:
            q.r.zadd(shard, {m: 1000 for m in members})
            q.r.zadd(q.keys.heads, {shard: 1000})


def fresh_queue(cluster, prefix, n, interval_ms=60_000, lease_ms=30_000, **kw) -> RouteQueue:
    client = redisconn.connect(cluster.url, **kw)
    q = RouteQueue(client, QueueKeys(prefix, 4), interval_ms=interval_ms, lease_ms=lease_ms)
    q.schedule(items(n))
    make_due(q)
    return q


def stream_ids(q, prefix) -> set[str]:
    return {i.decode() for i, _ in q.r.xrange(stream_key(prefix, True))}


def result(le):
    return {"route_hash": le.member, "alive": "1", "n": le.lease_score}


@pytest.fixture
def prefix(fault_cluster):
    import uuid

    p = f"{PREFIX}{uuid.uuid4().hex[:8]}:"
    yield p
    r = redisconn.connect(fault_cluster.url)
    try:
        redisconn.delete_many(r, list(r.scan_iter(match="*" + p + "*")))
    finally:
        r.close()


def test_failover_loses_unreplicated_writes_and_fencing_refuses_every_stale_completion(fault_cluster, prefix):
    c = fault_cluster
    q = fresh_queue(c, prefix, 40)
    target = StreamTarget(stream_key(prefix, True), GROUP, 10_000)
    slot = key_slot(q.keys.heads)
    master = c.master_port_of(slot)
    replica = c.replicas_of(master)[0]

    a = q.pop(20)  # replicated: survives
    done = a[:10]
    assert q.complete_with_results(done, [result(le) for le in done], target).codes == [COMPLETED] * 10
    wait_until(lambda: c.replication_caught_up(master), timeout=10, what="the replica to catch up")
    kept_ids = stream_ids(q, prefix)

    c.freeze(replica)  # from here the master acknowledges writes the replica never gets
    try:
        c.cut_replication(master)
        b = q.pop(10)  # acknowledged claims, not replicated
        late = a[10:]
        comp = q.complete_with_results(late, [result(le) for le in late], target)  # acknowledged, not replicated
        assert comp.codes == [COMPLETED] * 10
        q.wait_replicas, q.wait_timeout_ms = 1, 200  # WAIT reports what the replica did not confirm
        w = q.pop(5)
        assert q.last_wait == 0 and q.wait_short == 1
        q.wait_replicas = 0
        t0 = time.monotonic()
        c.kill(master)
    finally:
        c.thaw(replica)
    assert c.wait_served_by(slot, [replica], timeout=60) == replica
    failover_s = time.monotonic() - t0

    # what the new master lost: every claim and completion written while its replica was frozen
    leased = {m.decode() for m in q.r.zrange(q.keys.leased, 0, -1)}
    lost_claims = [le for le in b + w if le.member not in leased]
    lost_results = set(comp.ids) - stream_ids(q, prefix)
    survived_completions = [le for le in late if le.member not in leased]
    print(f"\nfailover: {failover_s:.1f} s; claims lost {len(lost_claims)}/{len(b) + len(w)}, "
          f"results lost {len(lost_results)}/{len(late)}, completions kept {len(survived_completions)}/{len(late)}")
    assert len(lost_claims) == 15 and len(lost_results) == 10 and not survived_completions
    assert kept_ids <= stream_ids(q, prefix)  # what was replicated before stays

    # fencing: a lease whose claim was lost cannot complete (its route is due again, nobody holds it)
    assert all(code != COMPLETED for code in q.complete(b + w))
    # a re-claimed route's old lease is refused; the new holder completes it
    again = {le.member: le for le in q.pop(40)}
    assert {le.member for le in b} <= set(again)
    stale = b[0]
    assert q.complete([stale]) != [COMPLETED]
    assert q.complete([again[stale.member]]) == [COMPLETED]
    # the lost completions: their leases are still out on the new master, so the holder's retry lands once
    retry = q.complete_with_results(late, [result(le) for le in late], target)
    assert retry.codes == [COMPLETED] * 10
    per_route = Counter(f[b"route_hash"].decode() for _, f in q.r.xrange(stream_key(prefix, True)))
    assert all(n == 1 for n in per_route.values()) and len(per_route) == 20  # 10 kept + 10 retried, none doubled
    c.restart(master)  # the old master rejoins as a replica of the new one


def test_a_write_confirmed_by_wait_survives_the_failover(fault_cluster, prefix):
    c = fault_cluster
    q = fresh_queue(c, prefix, 30)
    q.wait_replicas, q.wait_timeout_ms = 1, 2000
    target = StreamTarget(stream_key(prefix, True), GROUP, 10_000)
    slot = key_slot(q.keys.heads)
    master = c.master_port_of(slot)
    replica = c.replicas_of(master)[0]
    claimed = q.pop(10)
    assert q.last_wait == 1
    comp = q.complete_with_results(claimed[:5], [result(le) for le in claimed[:5]], target)
    assert q.last_wait == 1 and comp.codes == [COMPLETED] * 5
    c.kill(master)  # at once: no time for replication but what WAIT already confirmed
    c.wait_served_by(slot, [replica], timeout=60)
    leased = {m.decode() for m in q.r.zrange(q.keys.leased, 0, -1)}
    assert {le.member for le in claimed[5:]} <= leased  # confirmed claims survived
    assert set(comp.ids) <= stream_ids(q, prefix)  # confirmed results survived
    assert q.complete(claimed[5:]) == [COMPLETED] * 5
    c.restart(master)


class Loop:
    """Claim / renew / complete in a thread until stopped; counts completions per route (from the stream)
    and the errors it retried."""

    def __init__(self, q: RouteQueue, target: StreamTarget):
        self.q, self.target = q, target
        self.stop = threading.Event()
        self.errors: Counter = Counter()
        self.completed = 0
        self.cycles = 0
        self.acked: dict[str, bool] = {}  # stream id of each acknowledged result -> WAIT confirmed it
        self.refused = 0
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        held = []
        while not self.stop.is_set():
            try:
                if not held:
                    held = self.q.pop(10)
                    continue
                self.q.renew_many(held)
                comp = self.q.complete_with_results(held, [result(le) for le in held], self.target)
                self.completed += sum(1 for x in comp.codes if x == COMPLETED)
                self.refused += sum(1 for x in comp.codes if x != COMPLETED)
                confirmed = self.q.last_wait is not None and self.q.last_wait >= 1
                self.acked.update({i: confirmed for i in comp.ids if i})
                held = []
                self.cycles += 1
            except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
                self.errors[type(exc).__name__ + ": " + str(exc)[:60]] += 1
                time.sleep(0.01)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join(30)


@pytest.mark.parametrize("rounds, batch, wait", [(1, 100, 0), (12, 3, 0), (12, 3, 1)],
                         ids=["one-migration", "storm", "storm-wait-1"])
def test_slot_migration_while_workers_run_loses_and_doubles_nothing(fault_cluster, prefix, rounds, batch, wait):
    """``batch``: keys per MIGRATE; 3 keeps the schedule's keys split between two nodes for a while, so
    the loop's scripts meet ASK and TRYAGAIN."""
    c = fault_cluster
    q = fresh_queue(c, prefix, 60, interval_ms=1)  # due again at once: every route cycles all along
    q.wait_replicas = wait  # with WAIT the calls go to the slot's master directly: MOVED/ASK fall back
    target = StreamTarget(stream_key(prefix, True), GROUP, 1_000_000)
    slot = key_slot(q.keys.heads)
    moved = 0
    with Loop(q, target) as loop:
        wait_until(lambda: loop.cycles >= 5, timeout=20, what="the loop to run")
        for i in range(rounds):
            here = c.master_port_of(slot)
            there = next(p for p in c.masters_ports() if p != here)
            moved += c.migrate_slot(slot, there, batch=batch, pause_s=0.02 if batch < 10 else 0.0)
            before = loop.cycles
            wait_until(lambda: loop.cycles > before + 2, timeout=20, what="the loop to go on after a migration")
    per_lease = Counter((f[b"route_hash"], f[b"n"]) for _, f in q.r.xrange(stream_key(prefix, True)))
    print(f"\n{rounds} migration(s) of slot {slot}: {moved} keys moved, {loop.cycles} cycles, "
          f"{loop.completed} completions, retried errors {dict(loop.errors)}")
    assert loop.completed >= 10 * rounds
    assert sum(per_lease.values()) == loop.completed  # every acknowledged completion has its one result
    assert all(n == 1 for n in per_lease.values())  # and no lease completed twice
    assert q.status()["totals"]["leased"] <= 10


@pytest.mark.parametrize("wait", [0, 1], ids=["async", "wait-1"])
def test_failover_mid_run_measured(fault_cluster, prefix, wait):
    """The master of the schedule's slot killed while the loop claims, renews and completes: count the
    acknowledged results the new master lacks (asynchronous replication), with and without WAIT. Every
    lease still completes at most once; with WAIT 1 no confirmed result is lost."""
    c = fault_cluster
    q = fresh_queue(c, prefix, 60, interval_ms=1)
    q.wait_replicas, q.wait_timeout_ms = wait, 500
    target = StreamTarget(stream_key(prefix, True), GROUP, 1_000_000)
    slot = key_slot(q.keys.heads)
    with Loop(q, target) as loop:
        wait_until(lambda: loop.cycles >= 50, timeout=30, what="the loop to run")
        pre = dict(loop.acked)  # acknowledged while the master still had its replica
        old, new, failover_s = c.kill_master_of(slot, timeout=60)
        before = loop.cycles
        wait_until(lambda: loop.cycles > before + 20, timeout=60, what="the loop to go on after the failover")
    present = stream_ids(q, prefix)
    lost = [i for i in loop.acked if i not in present]
    lost_confirmed = [i for i in lost if loop.acked[i]]
    per_lease = Counter((f[b"route_hash"], f[b"n"]) for _, f in q.r.xrange(stream_key(prefix, True)))
    print(f"\nfailover mid-run (WAIT {wait}): {failover_s:.1f} s to promotion; {len(loop.acked)} results "
          f"acknowledged ({sum(loop.acked.values())} WAIT-confirmed), {len(lost)} lost ({len(lost_confirmed)} of "
          f"them WAIT-confirmed); "
          f"{loop.refused} completions refused by fencing; errors retried {sum(loop.errors.values())}")
    assert all(n == 1 for n in per_lease.values())  # no lease completed twice
    assert not lost_confirmed
    if wait:  # WAIT ran and the replica confirmed; after the failover the new master has no replica (the
        # old master is down), so every WAIT falls short until it rejoins: counted and logged, not refused
        assert pre and sum(pre.values()) >= 0.99 * len(pre)
        assert q.wait_short > 0
    c.restart(old)
