"""The PostgreSQL schedule beyond the conformance suite: provider selection, results recorded iff the lease
completed (outbox in the completing transaction) and relayed to the Redis stream exactly once."""

from __future__ import annotations

import pytest
import redis

from magpie.queue import QueueKeys, RouteQueue
from magpie.queue.completion import StreamTarget
from magpie.queue.pg import PgSchedule
from magpie.queue.pg.relay import pending, relay
from magpie.queue.provider import create_provider


def _items(n):
    return [(f"{i:024x}", f'{{"v":1,"id":{i},"w":[1]}}') for i in range(n)]


@pytest.fixture
def pq(settings, db, pg_url, redis_client):
    q = PgSchedule(pg_url, QueueKeys(settings.redis_prefix, 4), interval_ms=60_000, lease_ms=60_000,
                   redis_client=redis_client)
    q.check_layout()
    yield q
    q.close()


def _stream(prefix):
    return StreamTarget(prefix + "results", "g", 1000, "evict_oldest")


def test_create_provider_picks_by_scheme(settings, db, pg_url, redis_client):
    assert isinstance(create_provider(None, settings, redis_client=redis_client), RouteQueue)
    q = create_provider("postgresql+psycopg2://" + pg_url.split("://", 1)[1], settings)
    assert isinstance(q, PgSchedule) and q.status()["totals"]["scheduled"] == 0
    q.close()


def test_a_result_is_recorded_iff_its_lease_completed(pq, redis_client, settings):
    pq.schedule(_items(2))
    for h, _ in _items(2):
        pq.force_due(h, 1000)
    a, b = pq.pop(2)
    stale = type(b)(**{**b.to_dict(), "lease_score": "1000.50"})
    st = _stream(settings.redis_prefix)
    comp = pq.complete_with_results([a, stale], [{"r": "a"}, {"r": "b"}], st)
    assert comp.codes == [1, -1] and comp.ids[0] and comp.ids[1] is None
    entries = redis_client.xrange(st.key)
    assert [e[1] for e in entries] == [{b"r": b"a"}]
    assert pending(pq) == 0


def test_results_wait_in_the_outbox_while_redis_is_down_then_relay_once(pq, redis_client, settings):
    pq.schedule(_items(1))
    pq.force_due(_items(1)[0][0], 1000)
    [le] = pq.pop(1)
    st = _stream(settings.redis_prefix)
    pq._redis = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)  # nothing listens there
    comp = pq.complete_with_results([le], [{"r": "x"}], st)
    assert comp.codes == [1] and comp.ids == [None]
    assert pending(pq) == 1 and redis_client.exists(st.key) == 0
    pq._redis = redis_client
    assert relay(pq, st).relayed == 1
    assert pending(pq) == 0 and redis_client.xlen(st.key) == 1


def test_a_crash_between_append_and_delete_does_not_append_twice(pq, redis_client, settings, monkeypatch):
    pq.schedule(_items(1))
    pq.force_due(_items(1)[0][0], 1000)
    [le] = pq.pop(1)
    st = _stream(settings.redis_prefix)
    real_tx = pq.tx

    class Crash(Exception):
        pass

    class Proxy:
        """The relay's cursor, failing the outbox delete (a crash after the stream append)."""

        def __init__(self, cur):
            self.cur = cur

        def execute(self, sql, *a):
            if sql.startswith("DELETE FROM schedule_results"):
                raise Crash()
            return self.cur.execute(sql, *a)

        def __getattr__(self, name):
            return getattr(self.cur, name)

    def crashing_tx():
        ctx = real_tx()

        class Wrap:
            def __enter__(self):
                return Proxy(ctx.__enter__())

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)

        return Wrap()

    monkeypatch.setattr(pq, "tx", crashing_tx)
    with pytest.raises(Crash):
        with real_tx() as cur:  # the completion's own statement, then a relay that crashes
            codes, outbox = pq._complete_rows(cur, [le], None, [{"r": "once"}], st)
        assert codes == {0: 1} and len(outbox) == 1
        relay(pq, st)
    monkeypatch.setattr(pq, "tx", real_tx)
    assert redis_client.xlen(st.key) == 1 and pending(pq) == 1  # appended, row still there
    rep = relay(pq, st)
    assert rep.relayed == 1 and rep.stream_ids == {}  # deleted without a second append
    assert redis_client.xlen(st.key) == 1 and pending(pq) == 0


def test_heartbeats_and_reaped_leases_record_their_silence(settings, db, pg_url, redis_client):
    now = {"ms": 1_800_000_000_000}
    q = PgSchedule(pg_url, QueueKeys(settings.redis_prefix, 4), interval_ms=60_000, lease_ms=10_000,
                   clock=lambda: now["ms"], redis_client=redis_client)
    q.check_layout()
    (h, p), = _items(1)
    q.schedule([(h, p)])
    q.force_due(h, now["ms"] - 1)
    [le] = q.pop(1)
    now["ms"] += 4_000
    assert q.in_flight()[0]["silent_seconds"] == 4.0
    q.renew(le)
    now["ms"] += 1_500
    [row] = q.in_flight()
    assert (row["member"], row["silent_seconds"], row["expires_in_s"]) == (h, 1.5, 8.5)
    now["ms"] += 10_000  # the holder goes silent past its lease: the next claim reaps it
    [again] = q.pop(1)
    assert again.stalled and q.inspect(h)["last_silent_ms"] == 11_500
    q.close()
