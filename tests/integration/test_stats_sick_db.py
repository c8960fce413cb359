"""Ingestion against a database that answers but refuses writes, and the dead-letter redrive.

Real Redis (own prefix) and PostgreSQL: the session's own test database is made read-only with
``ALTER DATABASE ... SET default_transaction_read_only`` (new sessions only, so the engines here use
``NullPool``); other infrastructure failures are raised by a trigger with their real SQLSTATE, so they
reach the consumer through psycopg2 exactly as the server would send them.
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import append_entries
import sqlalchemy as sa
from click.testing import CliRunner

from helpers import wait_until

from magpie.config import get_settings
from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
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
from magpie.stats.drain import consumer_name, ingest_backlog
from magpie.stats.redrive import redrive

KEY = "test-key-0123456789abcdef"
T0 = 1_700_000_000_000  # ms


@pytest.fixture
def stored(db):
    routes = [Route("http", "10.2.0.1", 8000 + i) for i in range(3)]
    return upsert_routes(db, get_keyring(KEY), "alpha", routes).routes


@pytest.fixture
def fresh(pg_url):
    """An engine whose every transaction opens a new session (sees ALTER DATABASE settings at once)."""
    engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    yield engine
    engine.dispose()


@pytest.fixture
def read_only(db):
    """``set(True|False)``: make the test's own database read-only for new sessions, or writable again
    (always writable again after the test)."""
    name = db.url.database

    def set_(on: bool) -> None:
        with db.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            if on:
                c.exec_driver_sql(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
            else:
                c.exec_driver_sql(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')

    yield set_
    set_(False)


@pytest.fixture
def trigger(db):
    """``install(errcode, when)``: make inserts into check_history whose ``error`` equals ``when`` (any
    row when None) fail with SQLSTATE ``errcode``; removed after the test."""
    installed = []

    def install(errcode: str, when: str | None = None) -> None:
        cond = "TRUE" if when is None else f"NEW.error = '{when}'"
        with db.begin() as c:
            c.exec_driver_sql(
                "CREATE OR REPLACE FUNCTION magpie_test_fail() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF {cond} THEN RAISE EXCEPTION 'injected {errcode}' USING ERRCODE = '{errcode}'; END IF; "
                "RETURN NEW; END $$"
            )
            c.exec_driver_sql(
                "CREATE TRIGGER magpie_test_fail BEFORE INSERT ON check_history "
                "FOR EACH ROW EXECUTE FUNCTION magpie_test_fail()"
            )
        installed.append(True)

    def remove() -> None:
        if installed:
            with db.begin() as c:
                c.exec_driver_sql("DROP TRIGGER IF EXISTS magpie_test_fail ON check_history")
                c.exec_driver_sql("DROP FUNCTION IF EXISTS magpie_test_fail()")
            installed.clear()

    install.remove = remove
    yield install
    remove()


def _entry(s, at, error=None):
    return encode_result(route_id=s.route_id, route_hash=s.route_hash, alive=error is None, checked_at_ms=at,
                         latency_ms=10.0 if error is None else None, status=200 if error is None else None,
                         error=error, judge="http://127.0.0.1:8899/")


def _history(db) -> list[str]:
    with db.connect() as c:
        return list(c.exec_driver_sql("SELECT stream_id FROM check_history ORDER BY stream_id").scalars())


def _deliveries(redis_client, prefix) -> dict[str, int]:
    rows = redis_client.xpending_range(stream_key(prefix), GROUP, "-", "+", 10_000)
    return {r["message_id"].decode(): int(r["times_delivered"]) for r in rows}


def _drain(redis_client, engine, prefix, **kw) -> dict:
    total = {"committed": 0, "dead": 0, "replayed": 0}
    for _ in range(50):
        rep = ingest(redis_client, engine, prefix, "c1", **kw)
        assert rep.infra_error is None, rep.infra_error
        for k in total:
            total[k] += getattr(rep, k)
        if rep.read == 0:
            return total
    raise AssertionError("the backlog never drained")


def test_read_only_database_for_longer_than_the_delivery_budget_loses_nothing(
    db, fresh, redis_client, redis_prefix, stored, read_only, settings
):
    ensure_group(redis_client, redis_prefix)
    ids = append_entries(redis_client, redis_prefix, [_entry(stored[i % 3], T0 + i) for i in range(30)])
    read_only(True)
    # Ten trial batches with no backoff, each refused by the database: five times the delivery budget.
    for i in range(10):
        rep = ingest(redis_client, fresh, redis_prefix, consumer_name(), batch=20, max_deliveries=2,
                     backoff_s=0, min_idle_ms=0)
        assert rep.infra_error is not None and "read-only" in rep.infra_error, rep.infra_error
        assert (rep.committed, rep.dead, rep.exhausted) == (0, 0, 0)
        ids += append_entries(redis_client, redis_prefix, [_entry(stored[0], T0 + 100 + i)])
    # Deliveries were given back: no pending entry came closer to its limit.
    assert all(n == 0 for n in _deliveries(redis_client, redis_prefix).values())
    # The beat's ingestion runs with the real backoff: it reads nothing while the backoff runs.
    s = settings.model_copy(update={"stats_max_deliveries": 2, "stats_infra_backoff": 0.3,
                                    "stats_infra_backoff_cap": 0.6, "stats_batch": 20})
    before = _deliveries(redis_client, redis_prefix)
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:  # the behaviour: for 2.5 s of backoffs, nothing is read
        assert ingest_backlog(redis_client, fresh, s) == 0
        time.sleep(0.05)
    assert _deliveries(redis_client, redis_prefix) == before  # nothing re-delivered: the trial writes failed
    summary = pending_summary(redis_client, redis_prefix)
    assert summary["dead"] == 0 and summary["infra"]["failures"] >= 3
    assert "read-only" in summary["infra"]["error"]

    read_only(False)
    total = {"committed": 0}

    def drained():  # the passes read nothing until the backoff is over, then drain the backlog
        total["committed"] += ingest_backlog(redis_client, fresh, s)
        lag = pending_summary(redis_client, redis_prefix)["lag"]
        return lag == 0 and not _deliveries(redis_client, redis_prefix)

    wait_until(drained, timeout=15, what="the backlog drained")
    assert total["committed"] == len(ids)
    assert _history(db) == sorted(ids)  # 0 lost, none twice
    summary = pending_summary(redis_client, redis_prefix)
    assert summary["dead"] == 0 and summary["pending"] == 0 and summary["infra"] is None


@pytest.mark.parametrize("errcode", ["53100", "40001", "40P01", "55P03", "57014", "25006", "53200"])
def test_infrastructure_failures_keep_entries_pending_with_their_deliveries(
    db, redis_client, redis_prefix, stored, trigger, errcode
):
    """Disk full, serialization failure, deadlock, lock timeout, statement timeout, read-only, out of
    memory: none of them dead-letters or spends a delivery; the entries commit once it passes."""
    ids = append_entries(redis_client, redis_prefix, [_entry(stored[0], T0), _entry(stored[1], T0 + 1)])
    trigger(errcode)
    for _ in range(4):
        rep = ingest(redis_client, db, redis_prefix, "c1", max_deliveries=1, backoff_s=0)
        assert rep.infra_error is not None and f"[{errcode}]" in rep.infra_error
        assert (rep.read, rep.committed, rep.dead) == (2, 0, 0)
        assert set(_deliveries(redis_client, redis_prefix).values()) == {0}
    trigger.remove()
    assert _drain(redis_client, db, redis_prefix, max_deliveries=1, backoff_s=0) == {
        "committed": 2, "dead": 0, "replayed": 0}
    assert _history(db) == sorted(ids)
    assert redis_client.xlen(dead_key(redis_prefix)) == 0


@pytest.mark.parametrize("errcode", ["23514", "22003", "23505"])
def test_a_data_error_dead_letters_that_entry_only(db, redis_client, redis_prefix, stored, trigger, errcode):
    ids = append_entries(redis_client, redis_prefix, [_entry(stored[0], T0), _entry(stored[0], T0 + 1, "poison"), _entry(stored[1], T0 + 2)])
    trigger(errcode, when="poison")
    rep = ingest(redis_client, db, redis_prefix, "c1")
    assert rep.infra_error is None and (rep.committed, rep.dead) == (2, 1)
    assert _history(db) == sorted([ids[0], ids[2]])
    [(_, f)] = redis_client.xrange(dead_key(redis_prefix))
    assert f[b"stream_id"].decode() == ids[1] and b"rejected by database" in f[b"reason"]


def test_a_real_lock_timeout_is_an_infrastructure_failure(db, pg_url, redis_client, redis_prefix, stored):
    engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool,
                              connect_args={"options": "-c lock_timeout=200"})
    ids = append_entries(redis_client, redis_prefix, [_entry(stored[0], T0)])
    blocker = db.connect()
    tx = blocker.begin()
    blocker.exec_driver_sql("LOCK TABLE stats_ledger IN ACCESS EXCLUSIVE MODE")
    try:
        rep = ingest(redis_client, engine, redis_prefix, "c1", max_deliveries=1, backoff_s=0)
        assert rep.infra_error is not None and "LockNotAvailable" in rep.infra_error
        assert (rep.committed, rep.dead) == (0, 0)
        # Past the backoff the trial write meets the same lock: still nothing read or spent.
        rep = ingest(redis_client, engine, redis_prefix, "c1", max_deliveries=1, backoff_s=0)
        assert rep.infra_error is not None and rep.read == 0 and rep.infra_failures == 2
    finally:
        tx.rollback()
        blocker.close()
    try:
        assert _drain(redis_client, engine, redis_prefix, max_deliveries=1)["committed"] == 1
    finally:
        engine.dispose()
    assert _history(db) == ids


def test_a_malformed_entry_still_dead_letters_while_the_database_refuses_writes(
    db, fresh, redis_client, redis_prefix, stored, read_only
):
    good = _entry(stored[0], T0)
    ids = append_entries(redis_client, redis_prefix, [good, dict(good, alive="maybe")])
    read_only(True)
    rep = ingest(redis_client, fresh, redis_prefix, "c1", backoff_s=0)
    assert rep.infra_error is not None and rep.dead == 1
    [(_, f)] = redis_client.xrange(dead_key(redis_prefix))
    assert f[b"stream_id"].decode() == ids[1] and f[b"reason"].startswith(b"malformed")
    assert list(_deliveries(redis_client, redis_prefix)) == [ids[0]]  # the good one waits, unspent
    read_only(False)
    assert _drain(redis_client, fresh, redis_prefix, backoff_s=0)["committed"] == 1
    assert _history(db) == [ids[0]]


def test_an_exhausted_entry_that_was_applied_is_acknowledged_not_dead_lettered(
    db, redis_client, redis_prefix, stored
):
    """Applied, but its acknowledgement was lost again and again: the ledger says it is a replay."""
    from magpie.stats.entry import parse_entry
    from magpie.stats.store import apply_results

    ensure_group(redis_client, redis_prefix)
    [sid] = append_entries(redis_client, redis_prefix, [_entry(stored[0], T0)])
    key = stream_key(redis_prefix)
    [(_, [(_, raw)])] = redis_client.xreadgroup(GROUP, "c1", {key: ">"})
    apply_results(db, [parse_entry(sid, {k.decode(): v.decode() for k, v in raw.items()})])
    for _ in range(5):
        redis_client.xreadgroup(GROUP, "c1", {key: "0"})
    rep = ingest(redis_client, db, redis_prefix, "c1", max_deliveries=3)
    assert (rep.replayed, rep.dead, rep.exhausted, rep.committed) == (1, 0, 0, 0)
    assert redis_client.xlen(dead_key(redis_prefix)) == 0 and not _deliveries(redis_client, redis_prefix)
    assert _history(db) == [sid]


def test_redrive_reingests_exactly_once(db, redis_client, redis_prefix, stored, trigger):
    ids = append_entries(redis_client, redis_prefix, [_entry(stored[0], T0, "poison"), _entry(stored[1], T0 + 1, "poison"),
                   _entry(stored[2], T0 + 2)])
    trigger("23514", when="poison")
    assert ingest(redis_client, db, redis_prefix, "c1").dead == 2
    trigger.remove()
    assert redis_client.xlen(dead_key(redis_prefix)) == 2
    # One of them had in fact been applied too (a stand-in for a lost acknowledgement).
    with db.begin() as c:
        c.exec_driver_sql("INSERT INTO stats_ledger (stream_id) VALUES (%s)", (ids[1],))
    rep = redrive(redis_client, redis_prefix)
    assert (rep.moved, rep.unrecoverable, rep.remaining) == (2, 0, 0)
    assert redrive(redis_client, redis_prefix).moved == 0  # idempotent: nothing left to move
    total = _drain(redis_client, db, redis_prefix)
    assert total == {"committed": 1, "dead": 0, "replayed": 1}
    assert _history(db) == sorted([ids[0], ids[2]])  # recorded under the original id, once
    # Redriven again by hand (the same dead letter appended twice): still applied once.
    fields = dict(_entry(stored[0], T0, "poison"), origin_id=ids[0])
    append_entries(redis_client, redis_prefix, [fields, fields])
    assert _drain(redis_client, db, redis_prefix) == {"committed": 0, "dead": 0, "replayed": 2}
    assert _history(db) == sorted([ids[0], ids[2]])


def test_redrive_limit_unrecoverable_and_a_bad_origin(db, redis_client, redis_prefix, stored):
    dkey = dead_key(redis_prefix)
    good = _entry(stored[0], T0)
    for i in range(3):
        entry = json.dumps(dict(good, checked_at_ms=str(T0 + i)))
        redis_client.xadd(dkey, {"stream_id": f"{T0 + i}-0", "reason": "x", "consumer": "c",
                                 "dead_at_ms": "1", "entry": entry})
    redis_client.xadd(dkey, {"stream_id": "1-1", "reason": "trimmed", "consumer": "c", "dead_at_ms": "1",
                             "entry": "{}"})
    redis_client.xadd(dkey, {"stream_id": "1-2", "reason": "x", "consumer": "c", "dead_at_ms": "1",
                             "entry": json.dumps(dict(good, origin_id="nope"))})
    rep = redrive(redis_client, redis_prefix, limit=2)
    assert (rep.moved, rep.remaining) == (2, 3)
    rep = redrive(redis_client, redis_prefix, chunk=1)
    assert (rep.moved, rep.unrecoverable, rep.remaining) == (2, 1, 1)
    rep = redrive(redis_client, redis_prefix, discard_unrecoverable=True)
    assert (rep.moved, rep.unrecoverable, rep.discarded, rep.remaining) == (0, 1, 1, 0)
    total = _drain(redis_client, db, redis_prefix)
    assert total == {"committed": 3, "dead": 1, "replayed": 0}  # the bad origin id is malformed again
    [(_, f)] = redis_client.xrange(dkey)
    assert b"origin_id" in f[b"reason"]
    assert _history(db) == [f"{T0 + i}-0" for i in range(3)]


@pytest.fixture
def cli_env(monkeypatch, settings, pg_url):
    env = {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
           "MAGPIE_DATABASE_URL": pg_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
           "MAGPIE_BROKER_URL": settings.redis_url,
           "MAGPIE_BROKER_KEY_PREFIX": settings.redis_prefix + "broker:"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()


def test_cli_redrive_status_health_and_metrics_show_dead_letters(
    cli_env, db, redis_client, redis_prefix, stored, trigger, settings
):
    from magpie.cli import main
    from magpie.observability.health import check_health
    from magpie.observability.metrics import build_registry
    from magpie.stats import infra

    def dead_metric() -> float:
        return build_registry(settings, redis=redis_client, engine=db).get_sample_value(
            "magpie_statistics_dead_letters")

    [sid] = append_entries(redis_client, redis_prefix, [_entry(stored[0], T0, "poison")])
    stats = check_health(settings)["checks"]["stats"]
    assert stats["ok"] and not stats.get("warn")
    trigger("23514", when="poison")
    ingest(redis_client, db, redis_prefix, "c1")
    trigger.remove()
    assert dead_metric() == 1
    stats = check_health(settings)["checks"]["stats"]
    assert stats["ok"] and stats["warn"] and "1 dead-lettered" in stats["detail"]
    res = CliRunner().invoke(main, ["health"])
    assert "WARN stats" in res.output
    res = CliRunner().invoke(main, ["stats", "status", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["dead"] == 1
    res = CliRunner().invoke(main, ["stats", "redrive", "--limit", "5", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == {"moved": 1, "unrecoverable": 0, "discarded": 0, "remaining": 0}
    assert _drain(redis_client, db, redis_prefix)["committed"] == 1 and _history(db) == [sid]
    assert dead_metric() == 0
    # A database refusing writes shows as not ready (and as a metric) until a write succeeds.
    infra.record_failure(redis_client, redis_prefix, "InternalError [25006]: read-only", backoff_s=60)
    stats = check_health(settings)["checks"]["stats"]
    assert not stats["ok"] and "25006" in stats["detail"]
    reg = build_registry(settings, redis=redis_client, engine=db)
    assert reg.get_sample_value("magpie_statistics_ingest_backing_off") == 1
    assert reg.get_sample_value("magpie_statistics_ingest_infra_failures") == 1
    infra.clear(redis_client, redis_prefix)
    assert check_health(settings)["checks"]["stats"]["ok"]
