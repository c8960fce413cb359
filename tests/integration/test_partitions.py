"""The partitioned schedule (``MAGPIE_SCHEDULE_PARTITIONS``) with real Redis and PostgreSQL: ingestion over
every partition's results stream, the recorded layout's refusals."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from magpie.config import load_settings
from magpie.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.errors import Refusal
from magpie.queue import Payload, QueueError, RouteQueue
from magpie.queue.completion import StreamTarget
from magpie.queue.partitioned import PartitionedSchedule
from magpie.queue.partitions import partition_of, settings_stream_pairs
from magpie.queue.provider import create_provider
from magpie.routes import Route
from magpie.stats import GROUP, encode_result
from magpie.stats.drain import ingest_backlog
from magpie.stats.status import pending_summary
from magpie.stats.upkeep import replay_floor

KEY = "test-key-0123456789abcdef"
T0 = 1_700_000_000_000


def _settings(settings, n: int):
    return load_settings(redis_url=settings.redis_url, redis_prefix=settings.redis_prefix,
                         database_url=settings.database_url, encryption_key=KEY, schedule_partitions=n)


def _routes(db, n: int):
    routes = [Route("http", "10.9.0.1", 9000 + i) for i in range(n)]
    return upsert_routes(db, get_keyring(KEY), "alpha", routes).routes


def _result(s, at=T0):
    return encode_result(route_id=s.route_id, route_hash=s.route_hash, alive=True, checked_at_ms=at,
                         latency_ms=10.0, status=200, attempts=1, error=None, body="{}", anonymity="elite",
                         judge="http://127.0.0.1:8899/")


def _history(db) -> list[str]:
    with db.connect() as c:
        return list(c.execute(sa.text("SELECT stream_id FROM check_history")).scalars())


def test_results_of_every_partition_are_ingested_through_one_group(db, redis_client, settings):
    s4 = _settings(settings, 4)
    q = create_provider(None, s4, redis_client=redis_client)
    assert isinstance(q, PartitionedSchedule) and len(q.parts) == 4
    stored = _routes(db, 24)
    q.schedule([(r.route_hash, Payload(r.route_id, r.route, r.route_hash, [1]).encode()) for r in stored])
    for r in stored:
        q.enqueue_in(r.route_hash, 0)
    leases = q.pop(100)
    assert len(leases) == 24
    by_hash = {r.route_hash: r for r in stored}
    comp = q.complete_with_results(leases, [_result(by_hash[le.member]) for le in leases],
                                   StreamTarget.from_settings(s4))
    assert comp.codes == [1] * 24 and all(comp.ids)
    pairs = settings_stream_pairs(s4)
    assert len(pairs) == 5  # the untagged stream (drained after a repartition from 1) + one per partition
    lengths = [redis_client.xlen(key) for key, _ in pairs]
    assert lengths[0] == 0 and sum(lengths) == 24 and sum(1 for n in lengths[1:] if n) >= 3
    for le in leases:  # each result sits in its route's partition's stream
        assert redis_client.xlen(pairs[1 + partition_of(le.member, 4)][0]) >= 1
    # one id in two streams: the ledger keeps them apart (ids are unique per stream only)
    a, b = stored[0], stored[1]
    same = f"{q.server_time_ms() + 60_000}-7"
    redis_client.xadd(pairs[1][0], _result(a, T0 + 5), id=same)
    redis_client.xadd(pairs[2][0], _result(b, T0 + 5), id=same)
    assert ingest_backlog(redis_client, db, s4) == 26
    assert len(set(_history(db))) == 26
    summary = pending_summary(redis_client, s4.redis_prefix, pairs)
    assert summary["length"] == 26 and summary["pending"] == 0 and summary["lag"] == 0
    assert len(summary["streams"]) == 5 and all(st["group"] for st in summary["streams"])
    for key, _ in pairs:
        assert any(g["name"].decode() == GROUP for g in redis_client.xinfo_groups(key))
    assert replay_floor(redis_client, s4.redis_prefix, pairs) is not None
    assert ingest_backlog(redis_client, db, s4) == 0


def test_a_process_with_another_partition_count_is_refused(redis_client, settings):
    s4 = _settings(settings, 4)
    create_provider(None, s4, redis_client=redis_client)
    for n in (1, 2):
        with pytest.raises(QueueError) as err:
            RouteQueue.from_settings(_settings(settings, n), redis_client)
        assert err.value.code is Refusal.LAYOUT_MISMATCH
        text = str(err.value)
        assert "4 partitions" in text and f"MAGPIE_SCHEDULE_PARTITIONS={n}" in text and "\n" not in text
    assert isinstance(create_provider(None, s4, redis_client=redis_client), PartitionedSchedule)


def test_partitions_over_a_stored_single_partition_schedule_are_refused(redis_client, settings):
    one = create_provider(None, _settings(settings, 1), redis_client=redis_client)
    assert type(one) is RouteQueue and one.keys.name == "default"
    one.schedule([("ab" * 12, Payload(1, Route("http", "10.0.0.1", 1), "ab" * 12, [1]).encode())])
    with pytest.raises(QueueError) as err:
        create_provider(None, _settings(settings, 4), redis_client=redis_client)
    assert err.value.code is Refusal.LAYOUT_MISMATCH
    assert "repartition --to 4" in str(err.value) and "\n" not in str(err.value)
    assert redis_client.get(f"{settings.redis_prefix}{{default}}:schedule_partitions") is None
