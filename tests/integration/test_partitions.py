"""The partitioned schedule (``MAGPIE_SCHEDULE_PARTITIONS``) with real Redis and PostgreSQL: ingestion over
every partition's results stream, the recorded layout's refusals."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from magpie.config import load_settings
from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.errors import Refusal
from magpie.queue import Payload, QueueError, RouteQueue
from magpie.queue.completion import StreamTarget
from magpie.queue.partitioned import PartitionedSchedule
from magpie.queue.partitions import partition_of, settings_stream_pairs
from magpie.queue.provider import create_provider
from magpie.base.routes import Route
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
    routes = [Route("http", "127.0.9.1", 9000 + i) for i in range(n)]
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
    assert len(pairs) == 6  # untagged and {default} (drained after a repartition from 1) + one per partition
    lengths = [redis_client.xlen(key) for key, _ in pairs]
    assert lengths[:2] == [0, 0] and sum(lengths) == 24 and sum(1 for n in lengths[2:] if n) >= 3
    for le in leases:  # each result sits in its route's partition's stream
        assert redis_client.xlen(pairs[2 + partition_of(le.member, 4)][0]) >= 1
    # one id in two streams: the ledger keeps them apart (ids are unique per stream only)
    a, b = stored[0], stored[1]
    same = f"{q.server_time_ms() + 60_000}-7"
    redis_client.xadd(pairs[2][0], _result(a, T0 + 5), id=same)
    redis_client.xadd(pairs[3][0], _result(b, T0 + 5), id=same)
    assert ingest_backlog(redis_client, db, s4) == 26
    assert len(set(_history(db))) == 26
    summary = pending_summary(redis_client, s4.redis_prefix, pairs)
    assert summary["length"] == 26 and summary["pending"] == 0 and summary["lag"] == 0
    assert len(summary["streams"]) == 6 and all(st["group"] for st in summary["streams"])
    for key, _ in pairs:
        assert any(g["name"].decode() == GROUP for g in redis_client.xinfo_groups(key))
    assert replay_floor(redis_client, s4.redis_prefix, pairs) is not None
    assert ingest_backlog(redis_client, db, s4) == 0


def test_a_process_with_another_partition_count_is_refused(redis_client, settings):
    s4 = _settings(settings, 4)
    create_provider(None, s4, redis_client=redis_client)
    for n in (1, 2):
        with pytest.raises(QueueError) as err:
            create_provider(None, _settings(settings, n), redis_client=redis_client)
        assert err.value.code is Refusal.LAYOUT_MISMATCH
        text = str(err.value)
        assert "4 partitions" in text and f"MAGPIE_SCHEDULE_PARTITIONS={n}" in text and "\n" not in text
    assert isinstance(create_provider(None, s4, redis_client=redis_client), PartitionedSchedule)
    with pytest.raises(QueueError):  # RouteQueue.from_settings builds one partition only: refused here too
        RouteQueue.from_settings(_settings(settings, 1), redis_client)
    with pytest.raises(ValueError, match="create_provider"):
        RouteQueue.from_settings(s4, redis_client)


def test_partitions_over_a_stored_single_partition_schedule_are_refused(redis_client, settings):
    one = create_provider(None, _settings(settings, 1), redis_client=redis_client)
    assert type(one) is RouteQueue and one.keys.name == "default"
    one.schedule([("ab" * 12, Payload(1, Route("http", "127.0.9.2", 1), "ab" * 12, [1]).encode())])
    with pytest.raises(QueueError) as err:
        create_provider(None, _settings(settings, 4), redis_client=redis_client)
    assert err.value.code is Refusal.LAYOUT_MISMATCH
    assert "repartition --to 4" in str(err.value) and "\n" not in str(err.value)
    assert redis_client.get(f"{settings.redis_prefix}{{default}}:schedule_partitions") is None


# -- repartition ---------------------------------------------------------------------------------------
def _payload(i: int) -> tuple[str, str]:
    h = f"{i:024x}"
    return h, Payload(i, Route("http", "127.0.0.1", 2000 + i), h, [1]).encode()


class _Loop:
    """Claim/complete loop in a thread, as a check worker does: claims, holds briefly, completes. Records
    every completion per route and any claim of a route another holder of the run still holds."""

    def __init__(self, q, held: set, lock, completions: dict, doubled: list):
        import threading

        self.q, self.held, self.lock, self.completions, self.doubled = q, held, lock, completions, doubled
        self.stop = threading.Event()
        self.errors: list = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import time as _t

        try:
            while not self.stop.is_set():
                leases = self.q.pop(20)
                with self.lock:
                    for le in leases:
                        if le.member in self.held:
                            self.doubled.append(le.member)
                        self.held.add(le.member)
                _t.sleep(0.002)
                with self.lock:
                    for le in leases:
                        self.held.discard(le.member)
                codes = self.q.complete(leases)
                with self.lock:
                    for le, c in zip(leases, codes):
                        if c == 1:
                            self.completions[le.member] = self.completions.get(le.member, 0) + 1
                if not leases:
                    _t.sleep(0.005)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)


def test_repartition_1_to_4_while_claims_and_completions_run(redis_client, settings):
    import threading
    import time as _t

    from magpie.queue.repartition import Repartitioner

    s1, s4 = _settings(settings, 1), _settings(settings, 4)
    s1 = s1.model_copy(update={"check_interval": 0.2})
    s4 = s4.model_copy(update={"check_interval": 0.2})
    old = create_provider(None, s1, redis_client=redis_client)
    routes = [_payload(i) for i in range(300)]
    old.schedule(routes)
    rep = Repartitioner(redis_client, settings.redis_prefix, s1.queue_shards, 4, batch=40)
    rep.begin()
    # a process started with the old count is refused now; one with the new count sees both layouts
    with pytest.raises(QueueError) as err:
        create_provider(None, s1, redis_client=redis_client)
    assert err.value.code is Refusal.LAYOUT_MISMATCH and "\n" not in str(err.value)
    new = create_provider(None, s4, redis_client=redis_client)
    assert isinstance(new, PartitionedSchedule) and "default" in new.by_name
    held, lock, completions, doubled = set(), threading.Lock(), {}, []
    mine = old.pop(1)[0]  # a lease held through the first pass: the run must leave its route alone
    held.add(mine.member)
    loops = [_Loop(old, held, lock, completions, doubled),  # a worker of the old layout still running
             _Loop(new, held, lock, completions, doubled),
             _Loop(create_provider(None, s4, redis_client=redis_client), held, lock, completions, doubled)]
    for lp in loops:
        lp.thread.start()
    seen: list = []
    try:
        _t.sleep(0.3)
        ended: list = []

        def progress(st):
            seen.append(st)
            if st["leased_skipped"] and not ended:  # met it under its live lease: now end it
                with lock:
                    assert old.complete([mine]) == [1]
                    held.discard(mine.member)
                    completions[mine.member] = completions.get(mine.member, 0) + 1
                ended.append(mine.member)

        out = rep.run(progress, wait_s=0.05)
        before = dict(completions)
        deadline = _t.monotonic() + 10
        while _t.monotonic() < deadline:  # every route goes on being checked after the move
            with lock:
                if all(completions.get(h, 0) > before.get(h, 0) for h, _ in routes):
                    break
            _t.sleep(0.05)
    finally:
        for lp in loops:
            lp.stop.set()
        for lp in loops:
            lp.thread.join(5)
    assert not any(lp.errors for lp in loops), [lp.errors for lp in loops]
    print("repartition:", {k: out.get(k) for k in ("moved", "leased_skipped", "conflicts", "passes")},
          "completions", sum(before.values()))
    assert out["done"] and out["from"] == 1 and out["to"] == 4 and out["moved"] == 300
    assert out["leased_skipped"] >= 1 and out["passes"] >= 1 and ended  # fenced, then moved
    assert sum(before.values()) > 300  # it ran under load
    assert seen and all("remaining" in st for st in seen)
    assert doubled == []  # no route was held by two holders at once
    assert all(completions.get(h, 0) > before.get(h, 0) for h, _ in routes)  # nothing lost
    assert not redis_client.exists(f"{settings.redis_prefix}{{default}}:repartition")
    fresh = create_provider(None, s4, redis_client=redis_client)
    assert "default" not in fresh.by_name and fresh.route_count() == 300
    for h, p in routes:  # each route once, in its own partition, with its payload
        assert fresh.partition(h).score(h) is not None and fresh.payload(h) == p
    assert old.route_count() == 0
    with pytest.raises(QueueError):
        create_provider(None, s1, redis_client=redis_client)


def test_repartition_resumes_and_settles_a_crash_between_its_steps(redis_client, settings, monkeypatch):
    from magpie.queue import repartition as rp

    s1 = _settings(settings, 1)
    old = create_provider(None, s1, redis_client=redis_client)
    routes = [_payload(i) for i in range(60)]
    old.schedule(routes)
    old.enqueue_in(routes[0][0], 0)
    leased = old.pop(1)[0]  # a live lease: moved only once it ends
    victim = next(h for h, _ in routes if partition_of(h, 4) != 0 and h != leased.member)
    rep = rp.Repartitioner(redis_client, settings.redis_prefix, s1.queue_shards, 4, batch=10)
    real = rep._activate
    calls = {"n": 0}

    def crash(*a, **kw):  # the process dies between the fenced delete and the activation
        calls["n"] += 1
        if kw["args"][0] == victim:
            raise ConnectionError("killed")
        return real(*a, **kw)

    rep._activate = crash
    with pytest.raises(ConnectionError):
        rep.run(wait_s=0)
    st = rep.state()
    assert st["to"] == 4 and st["moved"] >= 0
    # rerun: the staged route is activated, the walk goes on from its place, the lease holds it back
    rep2 = rp.Repartitioner(redis_client, settings.redis_prefix, s1.queue_shards, 4, batch=10)
    out = rep2.run(max_passes=2, wait_s=0)
    assert not out["done"] and out["leased_skipped"] >= 1
    s4 = _settings(settings, 4)
    q4 = create_provider(None, s4, redis_client=redis_client)
    assert q4.score(victim) is not None and q4.partition(victim).score(victim) is not None
    # the lease ends where it was granted, and its result goes to a stream the ingestion reads
    comp = q4.complete_with_results([leased], [{"alive": "1", "route_id": "1"}], StreamTarget.from_settings(s4))
    assert comp.codes == [1]
    assert sum(redis_client.xlen(key) for key, _ in settings_stream_pairs(s4)) == 1
    out = rep2.run(wait_s=0)
    assert out["done"]
    fresh = create_provider(None, _settings(settings, 4), redis_client=redis_client)
    assert fresh.route_count() == 60 and "default" not in fresh.by_name
    assert sorted(m for q in fresh.parts for sh in q.keys.all_shards()
                  for m in (x.decode() for x in redis_client.zrange(sh, 0, -1))) == sorted(h for h, _ in routes)


def test_status_shows_every_partition_in_the_cli_and_the_dashboard(db, redis_client, settings, monkeypatch):
    from click.testing import CliRunner
    from fastapi.testclient import TestClient

    from magpie.cli import main
    from magpie.config import get_settings
    from magpie.web.app import create_app
    from magpie.web.service import Dashboard

    s4 = _settings(settings, 4)
    q = create_provider(None, s4, redis_client=redis_client)
    q.schedule([_payload(i) for i in range(40)])
    q.pause(2)
    st = q.status()
    assert [p["name"] for p in st["partitions"]] == ["p0", "p1", "p2", "p3"]
    assert sum(p["scheduled"] for p in st["partitions"]) == st["totals"]["scheduled"] == 40
    assert [p["paused"] for p in st["partitions"]] == [False, False, True, False] and not st["paused"]
    assert q.pop(40, max_inflight=0) and all(q.partition(le.member) is not q.parts[2] for le in q.pop(40))
    env = {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
           "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": KEY,
           "MAGPIE_SCHEDULE_PARTITIONS": "4"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(main, ["status", "--json"], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        import json

        out = json.loads(res.output)
        assert len(out["partitions"]) == 4 and out["totals"]["scheduled"] == 40
        res = CliRunner().invoke(main, ["queue", "resume", "--partition", "2"], catch_exceptions=False)
        assert res.exit_code == 0 and not q.is_paused(2)
        res = CliRunner().invoke(main, ["queue", "pause", "--partition", "9"])
        assert res.exit_code != 0 and "0..3" in res.output
    finally:
        get_settings.cache_clear()
    s = s4.model_copy(update={"web_token": "t" * 32})
    app = create_app(s, dashboard=Dashboard(s, redis=redis_client, engine=db), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        body = c.get("/api/status", headers={"Authorization": "Bearer " + "t" * 32}).json()
    assert [p["partition"] for p in body["partitions"]] == [0, 1, 2, 3]
    assert body["totals"]["scheduled"] == 40


def test_pipelined_claims_and_completions_survive_a_flushed_script_cache(tmp_path):
    from private_redis import PrivateRedis

    server = PrivateRedis(tmp_path)
    r = server.start()
    try:
        q = PartitionedSchedule(r, "flush:", 4, 4, interval_ms=60_000)
        q.schedule([_payload(i) for i in range(20)])
        for i in range(20):
            q.enqueue_in(f"{i:024x}", 0)
        r.script_flush()  # a private server: as after a Redis restart
        leases = q.pop(8)
        assert len(leases) == 8 and len({le.member for le in leases}) == 8
        r.script_flush()
        assert q.complete(leases) == [1] * 8
        assert len(q.pop(20)) == 12  # nothing claimed twice by the retried calls
    finally:
        server.stop()


def test_a_full_partition_stream_refuses_only_that_partitions_completions(redis_client, settings):
    s4 = _settings(settings, 4)
    q = create_provider(None, s4, redis_client=redis_client)
    routes = [_payload(i) for i in range(40)]
    q.schedule(routes)
    for h, _ in routes:
        q.enqueue_in(h, 0)
    leases = q.pop(40)
    target = StreamTarget.from_settings(s4)
    full_stream = q.stream_of(q.parts[0], target).key
    redis_client.xgroup_create(full_stream, target.group, id="$", mkstream=True)
    for _ in range(30):  # unconsumed entries fill partition 0's stream
        redis_client.xadd(full_stream, {"x": "1"})
    tight = StreamTarget(target.key, target.group, 30, "refuse")
    comp = q.complete_with_results(leases, [{"alive": "1"} for _ in leases], tight)
    mine = [q._of_lease(le) is q.parts[0] for le in leases]
    assert comp.full and any(mine) and not all(mine)
    assert [c == 0 for c in comp.codes] == mine  # the full partition changed nothing, the others completed
    rest = [le for le, m in zip(leases, mine) if m]
    again = q.complete_with_results(rest, [{"alive": "1"} for _ in rest], StreamTarget(target.key, target.group, 30,
                                                                                       "drop_new"))
    assert again.codes == [1] * len(rest) and again.dropped == len(rest)


def test_repartition_command_reports_progress_and_a_rerun_finds_nothing_to_do(redis_client, settings, monkeypatch):
    import json

    from click.testing import CliRunner

    from magpie.cli import main
    from magpie.config import get_settings

    one = create_provider(None, _settings(settings, 1), redis_client=redis_client)
    one.schedule([_payload(i) for i in range(30)])
    env = {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
           "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": KEY}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(main, ["queue", "repartition", "--to", "3", "--batch", "7"], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        assert "pass 1: partition" in res.output and "moved 30" in res.output
        assert "MAGPIE_SCHEDULE_PARTITIONS=3" in res.output
        res = CliRunner().invoke(main, ["queue", "repartition", "--to", "3", "--json"], catch_exceptions=False)
        out = json.loads(res.output)
        assert out["ok"] and out["result"]["done"] and out["result"]["moved"] == 0
    finally:
        get_settings.cache_clear()
    q3 = create_provider(None, _settings(settings, 3), redis_client=redis_client)
    assert q3.route_count() == 30 and [p["scheduled"] > 0 for p in q3.status()["partitions"]] == [True] * 3
    # and back to one partition: today's keys again
    from magpie.queue.repartition import repartition

    out = repartition(redis_client, settings.redis_prefix, settings.queue_shards, 1, wait_s=0)
    assert out["done"] and out["from"] == 3 and out["moved"] == 30
    back = create_provider(None, _settings(settings, 1), redis_client=redis_client)
    assert type(back) is RouteQueue and back.route_count() == 30
    with pytest.raises(QueueError):
        create_provider(None, _settings(settings, 3), redis_client=redis_client)


def test_renewals_over_every_partition_keep_the_callers_order(redis_client, settings):
    import dataclasses

    from magpie.queue import LEASE_LOST

    q = create_provider(None, _settings(settings, 4), redis_client=redis_client)
    routes = [_payload(i) for i in range(12)]
    q.schedule(routes)
    for h, _ in routes:
        q.enqueue_in(h, 0)
    leases = q.pop(12)
    assert len({q._of_lease(le).keys.name for le in leases}) > 1
    stale = dataclasses.replace(leases[3], lease_score="1.50", _token=None)
    before = [le.lease_score for le in leases]
    codes = q.renew_many([*leases[:5], stale, *leases[5:]], lease_ms=3_600_000)
    assert codes == [1] * 5 + [LEASE_LOST] + [1] * 7 and stale.cancelled
    assert all(float(le.lease_score) > float(b) for le, b in zip(leases, before))
    assert q.complete(leases) == [1] * 12  # the renewed tokens are the live ones
