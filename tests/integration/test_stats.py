"""Results through the Redis Stream into PostgreSQL: real Redis (own prefix) and PostgreSQL (``db``)."""

from __future__ import annotations

import json

import pytest
from helpers import append_entries, pending_idle, run_concurrently, wait_until
import sqlalchemy as sa

from magpie.base.crypto import get_keyring
from magpie.db.repo import latest_health, upsert_routes
from magpie.base.routes import Route
from magpie.stats import (
    GROUP,
    dead_key,
    encode_result,
    ensure_group,
    ingest,
    pending_summary,
    stream_key,
)

KEY = "test-key-0123456789abcdef"
T0 = 1_700_000_000_000  # ms


@pytest.fixture
def stored(db):
    """Three stored routes: list of StoredRoute."""
    routes = [Route("http", "10.1.0.1", 8000 + i) for i in range(3)]
    return upsert_routes(db, get_keyring(KEY), "alpha", routes).routes


def _entry(s, alive=True, at=T0, **kw):
    return encode_result(
        route_id=s.route_id,
        route_hash=s.route_hash,
        alive=alive,
        checked_at_ms=at,
        latency_ms=kw.pop("latency_ms", 12.5 if alive else None),
        status=kw.pop("status", 200 if alive else None),
        attempts=kw.pop("attempts", 1),
        error=kw.pop("error", None if alive else "timeout"),
        body=kw.pop("body", "{}"),
        anonymity=kw.pop("anonymity", "elite" if alive else None),
        judge=kw.pop("judge", "http://127.0.0.1:8899/"),
    )


def _history(db) -> list[tuple]:
    with db.connect() as c:
        return c.execute(
            sa.text(
                "SELECT route_id, checked_at, alive, stream_id FROM check_history ORDER BY checked_at, id"
            )
        ).all()


def _health(db, route_id) -> dict:
    with db.connect() as c:
        return dict(
            c.execute(sa.text("SELECT * FROM route_health WHERE route_id = :r"), {"r": route_id})
            .mappings()
            .one()
        )


def _pending(redis_client, prefix) -> int:
    return redis_client.xpending(stream_key(prefix), GROUP)["pending"]


class _CrashBeforeAck:
    """Redis client proxy whose MULTI pipeline fails on execute: a worker dying after the commit."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def pipeline(self, transaction=True, **kw):
        pipe = self._inner.pipeline(transaction=transaction, **kw)
        if transaction:

            def boom(*a, **k):
                pipe.reset()
                raise ConnectionError("worker killed between commit and XACK")

            pipe.execute = boom
        return pipe


def test_ingest_writes_history_and_health_and_acks(db, redis_client, redis_prefix, stored):
    a, b, _ = stored
    ensure_group(redis_client, redis_prefix)
    ids = append_entries(redis_client, redis_prefix, [_entry(a, True, T0), _entry(b, False, T0 + 1), _entry(a, False, T0 + 2)])
    assert len(ids) == 3
    rep = ingest(redis_client, db, redis_prefix, "c1")
    assert (rep.read, rep.committed, rep.replayed, rep.dead) == (3, 3, 0, 0)
    assert _pending(redis_client, redis_prefix) == 0
    hist = _history(db)
    assert [h[3] for h in hist] == ids and [h[2] for h in hist] == [True, False, False]
    ha = _health(db, a.route_id)
    assert ha["checks_total"] == 2 and ha["alive_total"] == 1
    assert ha["alive"] is False and ha["error"] == "timeout" and ha["consecutive_failures"] == 1
    assert ha["last_checked_at"] == hist[2][1] and ha["last_alive_at"] == hist[0][1]
    with db.connect() as c:
        assert sorted(c.execute(sa.text("SELECT stream_id FROM stats_ledger")).scalars()) == sorted(ids)
    rows = {r["route_id"]: r for r in latest_health(db)}
    assert rows[b.route_id]["alive"] is False and rows[stored[2].route_id]["alive"] is None
    # nothing left: a second pass reads nothing
    assert ingest(redis_client, db, redis_prefix, "c1").read == 0
    summary = pending_summary(redis_client, redis_prefix)
    assert summary["length"] == 3 and summary["pending"] == 0 and summary["lag"] == 0 and summary["dead"] == 0


def test_older_result_does_not_overwrite_newer_and_alive_resets_failures(
    db, redis_client, redis_prefix, stored
):
    a = stored[0]
    append_entries(redis_client, redis_prefix, [_entry(a, False, T0 + 10), _entry(a, False, T0 + 20)])
    ingest(redis_client, db, redis_prefix, "c1")
    assert _health(db, a.route_id)["consecutive_failures"] == 2
    # A late result from before the newest one: counted, but the current state is untouched.
    append_entries(redis_client, redis_prefix, [_entry(a, True, T0 + 5, latency_ms=99.0)])
    ingest(redis_client, db, redis_prefix, "c1")
    h = _health(db, a.route_id)
    assert h["checks_total"] == 3 and h["alive_total"] == 1
    assert h["alive"] is False and h["consecutive_failures"] == 2 and h["latency_ms"] is None
    assert int(h["last_checked_at"].timestamp() * 1000) == T0 + 20
    assert int(h["last_alive_at"].timestamp() * 1000) == T0 + 5
    # A newer alive result resets the streak and replaces the current fields.
    append_entries(redis_client, redis_prefix, [_entry(a, True, T0 + 30, latency_ms=7.25)])
    ingest(redis_client, db, redis_prefix, "c1")
    h = _health(db, a.route_id)
    assert h["alive"] is True and h["consecutive_failures"] == 0 and h["latency_ms"] == 7.25
    assert int(h["last_checked_at"].timestamp() * 1000) == T0 + 30


def test_replay_after_crash_between_commit_and_ack_writes_no_duplicates(
    db, redis_client, redis_prefix, stored
):
    a, b, _ = stored
    ids = append_entries(redis_client, redis_prefix, [_entry(a, True, T0), _entry(b, True, T0)])
    with pytest.raises(ConnectionError):
        ingest(_CrashBeforeAck(redis_client), db, redis_prefix, "doomed")
    assert len(_history(db)) == 2  # committed ...
    assert _pending(redis_client, redis_prefix) == 2  # ... but never acknowledged
    wait_until(lambda: pending_idle(redis_client, stream_key(redis_prefix), GROUP, 25), what="idle entries")
    rep = ingest(redis_client, db, redis_prefix, "survivor", min_idle_ms=20)
    assert (rep.read, rep.recovered, rep.committed, rep.replayed, rep.dead) == (2, 2, 0, 2, 0)
    assert [h[3] for h in _history(db)] == ids  # no duplicate rows
    assert _health(db, a.route_id)["checks_total"] == 1  # counters not applied twice
    assert _pending(redis_client, redis_prefix) == 0


def test_pending_entries_of_a_dead_consumer_are_recovered(db, redis_client, redis_prefix, stored):
    a = stored[0]
    ensure_group(redis_client, redis_prefix)
    ids = append_entries(redis_client, redis_prefix, [_entry(a, True, T0 + i) for i in range(4)])
    # A consumer reads the entries and dies before doing anything with them.
    got = redis_client.xreadgroup(GROUP, "dead-worker", {stream_key(redis_prefix): ">"}, count=10)
    assert len(got[0][1]) == 4
    # Not idle long enough yet: a live consumer leaves them alone.
    rep = ingest(redis_client, db, redis_prefix, "live")
    assert rep.read == 0 and _pending(redis_client, redis_prefix) == 4
    wait_until(lambda: pending_idle(redis_client, stream_key(redis_prefix), GROUP, 25), what="idle entries")
    rep = ingest(redis_client, db, redis_prefix, "live", min_idle_ms=20)
    assert (rep.read, rep.recovered, rep.committed) == (4, 4, 4)
    assert [h[3] for h in _history(db)] == ids
    assert _pending(redis_client, redis_prefix) == 0


def test_malformed_and_orphan_entries_go_to_the_dead_stream(db, redis_client, redis_prefix, stored):
    a = stored[0]
    good = _entry(a, True, T0)
    bad = [
        {"foo": "bar"},
        dict(good, alive="maybe"),
        dict(good, route_id="x"),
        dict(good, checked_at_ms=""),
        dict(good, latency_ms="nan"),
        dict(good, attempts="99999"),
        dict(good, route_id="999999"),  # route no longer in `routes`
        dict(good, route_hash="0" * 24),  # id points at a different route
    ]
    ids = append_entries(redis_client, redis_prefix, [good, *bad, dict(good, checked_at_ms=str(T0 + 1))])
    rep = ingest(redis_client, db, redis_prefix, "c1")
    assert (rep.read, rep.committed, rep.dead) == (10, 2, 8)
    assert [h[3] for h in _history(db)] == [ids[0], ids[-1]]
    assert _pending(redis_client, redis_prefix) == 0
    dead = redis_client.xrange(dead_key(redis_prefix))
    assert [d[1][b"stream_id"].decode() for d in dead] == ids[1:-1]
    reasons = [d[1][b"reason"].decode() for d in dead]
    assert reasons[0].startswith("malformed: missing field 'route_id'")
    assert "alive" in reasons[1] and "route_id" in reasons[2] and "checked_at_ms" in reasons[3]
    assert "latency_ms" in reasons[4] and "attempts" in reasons[5]
    assert "no longer exists" in reasons[6] and "hash mismatch" in reasons[7]
    assert json.loads(dead[0][1][b"entry"]) == {"foo": "bar"}
    assert pending_summary(redis_client, redis_prefix)["dead"] == 8


def test_text_fields_with_nul_bytes_are_stored(db, redis_client, redis_prefix, stored):
    a = stored[0]
    append_entries(redis_client, redis_prefix, [_entry(a, False, T0, error="bad\x00byte", body="\x00")])
    rep = ingest(redis_client, db, redis_prefix, "c1")
    assert rep.committed == 1
    assert _health(db, a.route_id)["error"] == "badbyte"


def test_entry_trimmed_while_pending_is_dead_lettered(db, redis_client, redis_prefix, stored):
    a = stored[0]
    ensure_group(redis_client, redis_prefix)
    ids = append_entries(redis_client, redis_prefix, [_entry(a, True, T0), _entry(a, True, T0 + 1)])
    redis_client.xreadgroup(GROUP, "gone", {stream_key(redis_prefix): ">"}, count=10)
    redis_client.xdel(stream_key(redis_prefix), ids[0])
    wait_until(lambda: pending_idle(redis_client, stream_key(redis_prefix), GROUP, 25), what="idle entries")
    rep = ingest(redis_client, db, redis_prefix, "c1", min_idle_ms=20)
    assert rep.committed == 1 and rep.dead == 1
    [(_, fields)] = redis_client.xrange(dead_key(redis_prefix))
    assert fields[b"stream_id"].decode() == ids[0] and b"trimmed" in fields[b"reason"]
    assert _pending(redis_client, redis_prefix) == 0


def test_postgres_down_reads_nothing_backs_off_and_then_commits_everything(
    db, redis_client, redis_prefix, stored
):
    a, b, c = stored
    ids = append_entries(redis_client, redis_prefix, [_entry(s, True, T0) for s in (a, b, c)])
    down = sa.create_engine(
        "postgresql+psycopg2://postgres@127.0.0.1:1/magpie", connect_args={"connect_timeout": 2}
    )
    try:
        rep = ingest(redis_client, down, redis_prefix, "c1")
    finally:
        down.dispose()
    # Unreachable: an infrastructure failure, reported, not raised; nothing read, nothing delivered.
    assert rep.infra_error is not None and "OperationalError" in rep.infra_error
    assert (rep.read, rep.committed, rep.dead, rep.infra_failures) == (0, 0, 0, 1) and rep.backoff_s > 0
    assert _pending(redis_client, redis_prefix) == 0
    assert pending_summary(redis_client, redis_prefix)["infra"]["failures"] == 1
    # While the backoff runs nobody reads, even with the database back.
    rep = ingest(redis_client, db, redis_prefix, "c1")
    assert rep.skipped and rep.read == 0 and rep.infra_error is not None
    def after_backoff():  # a skipped pass reads nothing: polling ingest changes nothing until it reads
        r = ingest(redis_client, db, redis_prefix, "c1")
        return None if r.skipped else r

    rep = wait_until(after_backoff, timeout=rep.backoff_s + 10, what="the backoff over")
    assert (rep.read, rep.committed, rep.dead, rep.infra_cleared) == (3, 3, 0, 1)
    assert sorted(h[3] for h in _history(db)) == sorted(ids)
    assert _pending(redis_client, redis_prefix) == 0
    assert pending_summary(redis_client, redis_prefix)["infra"] is None  # the commit cleared the state


def test_batches_are_bounded_and_drain(db, redis_client, redis_prefix, stored):
    entries = [_entry(stored[i % 3], i % 2 == 0, T0 + i) for i in range(25)]
    append_entries(redis_client, redis_prefix, entries)
    reports = [ingest(redis_client, db, redis_prefix, "c1", batch=10) for _ in range(4)]
    assert [r.read for r in reports] == [10, 10, 5, 0]
    assert len(_history(db)) == 25
    assert sum(_health(db, s.route_id)["checks_total"] for s in stored) == 25


def test_pending_summary_reports_lag_before_any_group(redis_client, redis_prefix):
    s = pending_summary(redis_client, redis_prefix)
    assert (s["length"], s["pending"], s["lag"], s["group"]) == (0, 0, 0, False)
    append_entries(redis_client, redis_prefix, [{"route_id": "1"}] * 3)
    ensure_group(redis_client, redis_prefix)
    ensure_group(redis_client, redis_prefix)  # idempotent
    s = pending_summary(redis_client, redis_prefix)
    assert (s["length"], s["pending"], s["lag"], s["group"]) == (3, 0, 3, True)


def test_entry_rejected_by_database_is_isolated_and_dead_lettered(db, redis_client, redis_prefix, stored):
    a = stored[0]
    with db.begin() as c:  # make PostgreSQL refuse one row, as a stand-in for any data error
        c.execute(
            sa.text(
                "CREATE FUNCTION magpie_test_poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "IF NEW.error = 'poison' THEN "
                "RAISE EXCEPTION 'poisoned row' USING ERRCODE = 'check_violation'; "
                "END IF; RETURN NEW; END $$"
            )
        )
        c.execute(
            sa.text(
                "CREATE TRIGGER magpie_test_poison BEFORE INSERT ON check_history "
                "FOR EACH ROW EXECUTE FUNCTION magpie_test_poison()"
            )
        )
    try:
        ids = append_entries(redis_client, redis_prefix, [_entry(a, False, T0), _entry(a, False, T0 + 1, error="poison"), _entry(a, True, T0 + 2)])
        rep = ingest(redis_client, db, redis_prefix, "c1")
    finally:
        with db.begin() as c:
            c.execute(sa.text("DROP TRIGGER magpie_test_poison ON check_history"))
            c.execute(sa.text("DROP FUNCTION magpie_test_poison()"))
    assert (rep.committed, rep.dead) == (2, 1)
    assert [h[3] for h in _history(db)] == [ids[0], ids[2]]
    [(_, fields)] = redis_client.xrange(dead_key(redis_prefix))
    assert fields[b"stream_id"].decode() == ids[1] and b"poisoned row" in fields[b"reason"]
    assert _pending(redis_client, redis_prefix) == 0


def test_two_consumers_holding_the_same_entries_apply_them_once(db, stored):

    from magpie.stats.entry import parse_entry
    from magpie.stats.store import apply_results

    entries = [parse_entry(f"{T0 + i}-0", _entry(stored[i % 3], i % 2 == 0, T0 + i)) for i in range(300)]
    outcomes, errors = run_concurrently(lambda: apply_results(db, entries), 4)
    assert errors == []
    assert sum(o[0] for o in outcomes) == 300 and sum(o[1] for o in outcomes) == 900
    assert len(_history(db)) == 300
    assert sum(_health(db, s.route_id)["checks_total"] for s in stored) == 300
