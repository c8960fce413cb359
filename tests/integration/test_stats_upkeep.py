"""Statistics pipeline under stress: the stream bound and its overflow policies, delivery limits, killed
consumers, a PostgreSQL outage, the replay floor and ledger retirement, idle consumers.

Real Redis (own key prefix) and PostgreSQL (``db``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
import sqlalchemy as sa
from helpers import append_entries

from helpers import consumers_idle, pending_idle, wait_until

from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.base.routes import Route
from magpie.stats import GROUP, dead_key, encode_result, ensure_group, ingest, stream_key
from magpie.stats.upkeep import (
    cleanup_consumers,
    delete_empty_consumers,
    replay_floor,
    retire_ledger,
    trim_consumed,
)

KEY = "test-key-0123456789abcdef"
T0 = 1_700_000_000_000


@pytest.fixture
def stored(db):
    routes = [Route("http", "10.2.0.1", 9000 + i) for i in range(3)]
    return upsert_routes(db, get_keyring(KEY), "upkeep", routes).routes


def _e(s, at=T0, alive=True):
    return encode_result(
        route_id=s.route_id,
        route_hash=s.route_hash,
        alive=alive,
        checked_at_ms=at,
        latency_ms=10.0 if alive else None,
    )


def _history_ids(db) -> list[str]:
    with db.connect() as c:
        return list(c.execute(sa.text("SELECT stream_id FROM check_history ORDER BY stream_id")).scalars())


def _ledger(db) -> set[str]:
    with db.connect() as c:
        return set(c.execute(sa.text("SELECT stream_id FROM stats_ledger")).scalars())


def _pending(r, prefix) -> int:
    return r.xpending(stream_key(prefix), GROUP)["pending"]


# ------------------------------------------------------------------------------------- bound and policies
# The policies themselves are tested on the completion path in test_cycle.py; here: the bound counts
# unconsumed entries only, so what the group consumed makes room for the next completion.


def test_the_bound_counts_unconsumed_entries_only(redis_client, redis_prefix, stored, db):
    from magpie.queue.payload import schedule_item
    from magpie.queue import QueueKeys, RouteQueue
    from magpie.queue.completion import StreamTarget

    ensure_group(redis_client, redis_prefix)
    q = RouteQueue(redis_client, QueueKeys(redis_prefix, 4), interval_ms=60_000, lease_ms=60_000)
    q.schedule([schedule_item(x) for x in stored])
    for x in stored:
        q.enqueue_in(x.route_hash.strip(), 0)
    leases = q.pop(3)
    target = StreamTarget(stream_key(redis_prefix), GROUP, 5, "drop_new")
    first = append_entries(redis_client, redis_prefix, [_e(stored[0], T0 + i) for i in range(5)])
    comp = q.complete_with_results(leases[:1], [_e(stored[1], T0 + 10)], target)
    assert comp.codes == [1] and comp.ids == [None] and comp.dropped == 1  # full of unconsumed results
    assert [i.decode() for i, _ in redis_client.xrange(stream_key(redis_prefix))] == first
    # Once the group consumed them, acknowledged entries make room: nothing dropped, nothing lost.
    assert ingest(redis_client, db, redis_prefix, "c1").committed == 5
    comp = q.complete_with_results(leases[1:], [_e(stored[1], T0 + 20), _e(stored[2], T0 + 21)], target)
    assert comp.dropped == 0 and comp.trimmed == 5 and all(comp.ids)
    assert redis_client.xlen(stream_key(redis_prefix)) == 2


# --------------------------------------------------------------------------------------- delivery limits


def test_entry_delivered_too_often_goes_to_the_dead_stream(redis_client, redis_prefix, stored, db):
    ensure_group(redis_client, redis_prefix)
    key = stream_key(redis_prefix)
    [poison] = append_entries(redis_client, redis_prefix, [_e(stored[0], T0)])
    redis_client.xreadgroup(GROUP, "c1", {key: ">"})
    for _ in range(4):  # four more failed attempts: delivered 5 times, never acknowledged
        redis_client.xreadgroup(GROUP, "c1", {key: "0"})
    [fine] = append_entries(redis_client, redis_prefix, [_e(stored[1], T0 + 1)])
    rep = ingest(redis_client, db, redis_prefix, "c1", max_deliveries=5)
    assert (rep.committed, rep.dead, rep.exhausted) == (1, 1, 1)
    assert _history_ids(db) == [fine]
    [(_, fields)] = redis_client.xrange(dead_key(redis_prefix))
    assert fields[b"stream_id"].decode() == poison and b"delivered 6 times" in fields[b"reason"]
    assert _pending(redis_client, redis_prefix) == 0


def test_a_consumer_killed_mid_batch_is_recovered_by_another(
    redis_client, redis_prefix, stored, db, settings
):
    """A real subprocess consumer reads a batch, blocks inside its PostgreSQL transaction and is SIGKILLed
    before it can acknowledge; a live consumer then reclaims and applies every entry exactly once."""
    ids = append_entries(redis_client, redis_prefix, [_e(stored[i % 3], T0 + i) for i in range(20)])
    ensure_group(redis_client, redis_prefix)
    pg_url = db.url.render_as_string(hide_password=False)
    code = (
        "import redis, sqlalchemy as sa\n"
        "from magpie.stats import ingest\n"
        f"r = redis.Redis.from_url({settings.redis_url!r})\n"
        f"e = sa.create_engine({pg_url!r})\n"
        f"ingest(r, e, {redis_prefix!r}, 'victim', batch=100)\n"
    )
    blocker = db.connect()
    tx = blocker.begin()
    blocker.execute(sa.text("LOCK TABLE stats_ledger IN ACCESS EXCLUSIVE MODE"))  # the victim will wait here
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        def waiting():
            with db.connect() as c:
                return c.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock' AND query LIKE '%stats_ledger%'"
                    )
                ).scalar_one()

        wait_until(waiting, timeout=20, what="the victim consumer at its database write")
        assert redis_client.xpending(stream_key(redis_prefix), GROUP)["pending"] == 20
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tx.rollback()
        blocker.close()
    wait_until(lambda: pending_idle(redis_client, stream_key(redis_prefix), GROUP, 55), what="idle entries")
    rep = ingest(redis_client, db, redis_prefix, "survivor", min_idle_ms=50)
    assert (rep.read, rep.recovered, rep.committed, rep.dead) == (20, 20, 20, 0)
    assert _history_ids(db) == sorted(ids)
    assert _pending(redis_client, redis_prefix) == 0


class _Forwarder:
    """A TCP forwarder on 127.0.0.1 to PostgreSQL that can be cut and restored (an outage on demand)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.port = 0
        self.conns: list[socket.socket] = []
        self.sock: socket.socket | None = None

    def up(self):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(16)
        self.port = s.getsockname()[1]
        self.sock = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s):
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            u = socket.create_connection(self.target)
            self.conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for x in (a, b):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def down(self):
        if self.sock:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close alone does not
            except OSError:
                pass
            self.sock.close()
            self.sock = None
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self.conns.clear()


def test_postgres_unavailable_for_a_while_then_back_loses_nothing(redis_client, redis_prefix, stored, db):
    fwd = _Forwarder(("127.0.0.1", db.url.port or 5432))
    fwd.up()
    url = db.url.set(host="127.0.0.1", port=fwd.port)
    engine = sa.create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 2})
    try:
        ids = append_entries(redis_client, redis_prefix, [_e(stored[0], T0 + i) for i in range(3)])
        assert ingest(redis_client, engine, redis_prefix, "c1").committed == 3
        fwd.down()  # outage: connections cut, new ones refused
        ids += append_entries(redis_client, redis_prefix, [_e(stored[1], T0 + 10 + i) for i in range(4)])
        for _ in range(6):  # many passes during the outage: each fails, nothing is acknowledged
            rep = ingest(redis_client, engine, redis_prefix, "c1", max_deliveries=2, min_idle_ms=0,
                         backoff_s=0)
            assert rep.infra_error is not None and rep.committed == 0
            ids += append_entries(redis_client, redis_prefix, [_e(stored[2], T0 + 100 + len(ids))])
        fwd.up()  # back, same port
        total = {"committed": 0, "dead": 0}
        while True:
            rep = ingest(redis_client, engine, redis_prefix, "c1", max_deliveries=2, backoff_s=0)
            assert rep.infra_error is None
            total["committed"] += rep.committed
            total["dead"] += rep.dead
            if rep.read == 0:
                break
        # An outage does not use up deliveries: nothing dead-lettered, everything applied once.
        assert total == {"committed": len(ids) - 3, "dead": 0}
        assert _history_ids(db) == sorted(ids)
        assert _pending(redis_client, redis_prefix) == 0
    finally:
        fwd.down()
        engine.dispose()


# ------------------------------------------------------------------------------- replay floor and ledger


def test_old_pending_entry_holds_the_floor_back_while_new_results_commit(
    redis_client, redis_prefix, stored, db
):
    key = stream_key(redis_prefix)
    ensure_group(redis_client, redis_prefix)
    assert replay_floor(redis_client, redis_prefix) is None  # nothing delivered yet
    [e0] = append_entries(redis_client, redis_prefix, [_e(stored[0], T0)])
    assert ingest(redis_client, db, redis_prefix, "live").committed == 1
    [e1] = append_entries(redis_client, redis_prefix, [_e(stored[1], T0 + 1)])
    redis_client.xreadgroup(GROUP, "stuck", {key: ">"}, count=1)  # delivered, never acknowledged
    newer = append_entries(redis_client, redis_prefix, [_e(stored[2], T0 + 2 + i) for i in range(3)])
    rep = ingest(redis_client, db, redis_prefix, "live")  # stuck's entry is not idle long enough to steal
    assert (rep.committed, rep.recovered) == (3, 0)

    floor = replay_floor(redis_client, redis_prefix)
    assert floor.stream_id == e1 and floor.source == "pending"
    assert floor.timestamp == int(e1.split("-")[0]) / 1000
    r = retire_ledger(db, floor, min_age_s=0)
    assert r["deleted"] == 1 and r["complete"]
    assert _ledger(db) == set(newer)  # rows above the floor stay: they may still be replayed
    # Consumed entries below the floor leave the stream; the pending one and newer stay.
    assert trim_consumed(redis_client, redis_prefix) == 1
    assert [i.decode() for i, _ in redis_client.xrange(key)] == [e1, *newer]

    wait_until(lambda: pending_idle(redis_client, key, GROUP, 25), what="the stuck entry idle")
    assert ingest(redis_client, db, redis_prefix, "live", min_idle_ms=20).committed == 1
    floor = replay_floor(redis_client, redis_prefix)
    assert floor.source == "delivered" and (floor.ms, floor.seq) > tuple(map(int, newer[-1].split("-")))
    assert retire_ledger(db, floor, min_age_s=0)["deleted"] == 4
    assert _ledger(db) == set()
    assert sorted(_history_ids(db)) == sorted([e0, e1, *newer])


def test_ledger_min_age_keeps_recent_rows_and_batches_resume(redis_client, redis_prefix, stored, db):
    append_entries(redis_client, redis_prefix, [_e(stored[i % 3], T0 + i) for i in range(7)])
    ingest(redis_client, db, redis_prefix, "c1")
    floor = replay_floor(redis_client, redis_prefix)
    assert retire_ledger(db, floor, min_age_s=3600)["deleted"] == 0  # too recent
    r = retire_ledger(db, floor, min_age_s=0, batch=3, max_batches=2)
    assert (r["deleted"], r["complete"]) == (6, False)
    r = retire_ledger(db, floor, min_age_s=0, batch=3, max_batches=2)
    assert (r["deleted"], r["complete"]) == (1, True)


def test_idle_consumers_without_pending_entries_are_removed_others_kept(
    redis_client, redis_prefix, stored, db
):
    key = stream_key(redis_prefix)
    ensure_group(redis_client, redis_prefix)
    append_entries(redis_client, redis_prefix, [_e(stored[0], T0)])
    redis_client.xreadgroup(GROUP, "holder", {key: ">"}, count=1)  # keeps one pending entry
    redis_client.xgroup_createconsumer(key, GROUP, "empty")  # a consumer that holds nothing
    wait_until(lambda: consumers_idle(redis_client, key, GROUP, ["empty", "holder"], 55),
               what="idle consumers")
    assert cleanup_consumers(redis_client, redis_prefix, idle_ms=50) == ["empty"]
    names = {c["name"].decode() for c in redis_client.xinfo_consumers(key, GROUP)}
    assert names == {"holder"}
    # A stale candidate list (holder read entries since) cannot delete a consumer with pending entries.
    assert delete_empty_consumers(redis_client, redis_prefix, ["holder"]) == []
    assert _pending(redis_client, redis_prefix) == 1
    ingest(redis_client, db, redis_prefix, "live", min_idle_ms=20)  # reclaims holder's entry
    wait_until(lambda: consumers_idle(redis_client, key, GROUP, ["holder"], 55), what="holder idle")
    assert "holder" in cleanup_consumers(redis_client, redis_prefix, idle_ms=50)
    assert _pending(redis_client, redis_prefix) == 0
