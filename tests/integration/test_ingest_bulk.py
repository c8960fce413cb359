"""Ingestion's bulk parameters against real PostgreSQL: array literals and ``COPY`` rows read back exactly
as the values they were built from, and ``check_history`` written by ``COPY`` keeps the failure
classification of the statements it replaced."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta, timezone

import psycopg2
import pytest
import sqlalchemy as sa

from helpers import append_entries

from magpie.base.crypto import get_keyring
from magpie.base.routes import Route
from magpie.db import bulk
from magpie.db.repo import upsert_routes
from magpie.stats import dead_key, encode_result, ingest, parse_entry
from magpie.stats.store import apply_results, is_data_error, is_infra_failure

KEY = "test-key-0123456789abcdef"
T0 = 1_700_000_000_000  # ms

NASTY = [
    "", " ", "  padded  ", "NULL", "null", "\\N", "\\", "\\\\", '"', '""', "a,b", "{x}", "}{", "'", "''",
    "tab\there", "new\nline", "cr\rlf\r\n", "\\t literally", "back\\slash\tand tab", "ünïcødé ✓ 🦉",
    "\u2028\u2029", "\x01\x1f\x7f", "end with backslash\\", ".", "\\.",
]


@pytest.fixture
def stored(db):
    routes = [Route("http", "127.0.4.1", 8000 + i) for i in range(3)]
    return upsert_routes(db, get_keyring(KEY), "alpha", routes).routes


def _select(db, sql: str, *params):
    with db.connect() as c:
        return c.exec_driver_sql(sql, params).scalar_one()


def test_text_array_reads_back_every_string_exactly(db):
    values = NASTY + [None] + [random.Random(7).choice(NASTY) + str(i) for i in range(50)]
    assert _select(db, "SELECT %s::text[]", bulk.text_array(values)) == values
    assert _select(db, "SELECT %s::text[]", bulk.text_array([])) == []
    assert _select(db, "SELECT %s::text[]", bulk.text_array([None])) == [None]


def test_number_and_boolean_arrays_equal_what_python_lists_gave(db):
    ints = [0, 1, -1, 2**63 - 1, -(2**63), None, 42, True]
    assert _select(db, "SELECT %s::bigint[]", bulk.int_array(ints)) == [0, 1, -1, 2**63 - 1, -(2**63), None, 42, 1]
    assert _select(db, "SELECT %s::bigint[]", bulk.int_array(iter([3, 2]))) == [3, 2]
    rnd = random.Random(3)
    floats = [0.0, 1e9, 0.001, 12.345, 1 / 3, None, 2999.999, 123.456] + [round(rnd.uniform(0, 5000), 3)
                                                                           for _ in range(200)]
    # the same real (float4) values as the list psycopg2 adapted element by element
    assert _select(db, "SELECT %s::real[] = %s::real[]", bulk.float_array(floats), floats)
    assert _select(db, "SELECT %s::real[]", bulk.float_array(floats)) == _select(db, "SELECT %s::real[]", floats)
    assert _select(db, "SELECT %s::boolean[]", bulk.bool_array([True, False, None])) == [True, False, None]


def test_timestamp_array_keeps_instants_whatever_the_session_time_zone(db):
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    ms = [0, 1, 999, 1000, T0, T0 + 123, 253_402_300_799_999]
    dts = [epoch + timedelta(milliseconds=m) for m in ms]
    other = datetime(2024, 3, 1, 12, 30, 15, 123456, tzinfo=timezone(timedelta(hours=-5)))
    with db.connect() as c:
        c.exec_driver_sql("SET TIME ZONE 'America/St_Johns'")
        got = c.exec_driver_sql("SELECT %s::timestamptz[]", (bulk.timestamp_array([*ms, *dts, other, None]),))
        got = got.scalar_one()
    assert got == [*dts, *dts, other, None]


def test_ms_timestamp_is_the_instant_the_datetime_arithmetic_gives():
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    rnd = random.Random(5)
    samples = [0, 1, 999, 1000, 59_999, 60_000, T0, 253_402_300_799_999, -1, -1000, -1001]
    samples += [rnd.randrange(0, 253_402_300_799_999) for _ in range(5000)]
    samples += [T0 + rnd.randrange(0, 10_000) for _ in range(5000)]  # past the cache's bound
    for m in samples:
        assert datetime.fromisoformat(bulk.ms_timestamp(m)) == epoch + timedelta(milliseconds=m), m


def test_copy_fields_round_trip_exactly(db):
    values = NASTY + [None]
    data = "".join(f"{i}\t{bulk.copy_field(v)}\n" for i, v in enumerate(values))
    with db.begin() as c:
        c.exec_driver_sql("CREATE TEMP TABLE copy_probe (i integer, t text) ON COMMIT DROP")
        bulk.copy_in(c, "copy_probe", ("i", "t"), data)
        got = [t for _, t in c.exec_driver_sql("SELECT i, t FROM copy_probe ORDER BY i")]
    assert got == values


def test_copy_errors_are_wrapped_as_sqlalchemy_errors(db):
    with db.begin() as c:
        c.exec_driver_sql("CREATE TEMP TABLE copy_probe (i smallint NOT NULL) ON COMMIT DROP")
        with pytest.raises(sa.exc.DataError) as bad:
            bulk.copy_in(c, "copy_probe", ("i",), "1\n99999\n")
    assert isinstance(bad.value.orig, psycopg2.errors.NumericValueOutOfRange)
    assert is_data_error(bad.value) and not is_infra_failure(bad.value)
    with db.begin() as c:
        with pytest.raises(sa.exc.ProgrammingError):  # a missing table: infrastructure, not the entry
            bulk.copy_in(c, "no_such_table", ("i",), "1\n")


def _history(db, cols: str = "body, error, judge, anonymity, exit_ip, stream_id") -> list[tuple]:
    with db.connect() as c:
        return [tuple(r) for r in c.exec_driver_sql(f"SELECT {cols} FROM check_history ORDER BY checked_at, id")]


def test_text_fields_reach_check_history_exactly(db, redis_client, redis_prefix, stored):
    a = stored[0]
    texts = NASTY + ["nul\x00inside", "\x00"]
    entries = []
    for i, t in enumerate(texts):
        entries.append(encode_result(route_id=a.route_id, route_hash=a.route_hash, alive=i % 2 == 0,
                                     checked_at_ms=T0 + i, latency_ms=12.5 if i % 2 == 0 else None,
                                     status=200, attempts=1, error=t, body=t, anonymity="elite",
                                     judge="http://127.0.0.1:8899/" + t, exit_ip="127.0.0.11"))
    ids = append_entries(redis_client, redis_prefix, entries)
    rep = ingest(redis_client, db, redis_prefix, "c1")
    assert (rep.committed, rep.dead) == (len(texts), 0)
    stored_text = [t.replace("\x00", "") or None for t in texts]  # NUL removed, "" is NULL, as before
    want = [(t, t, "http://127.0.0.1:8899/" + (t or ""), "elite", "127.0.0.11", sid)
            for t, sid in zip(stored_text, ids)]
    assert _history(db) == want


def test_history_columns_match_the_entry(db, stored):
    a, b, _ = stored
    fields = [
        encode_result(route_id=a.route_id, route_hash=a.route_hash, alive=True, checked_at_ms=T0 + 7,
                      latency_ms=1234.5678, status=201, attempts=3, error=None, body="{}", anonymity="elite",
                      judge="http://127.0.0.1:8899/", exit_ip="::ffff:127.9.8.7"),
        encode_result(route_id=b.route_id, route_hash=b.route_hash, alive=False, checked_at_ms=T0,
                      latency_ms=None, status=None, attempts=0, error="ReadTimeout", body=None,
                      anonymity=None, judge="http://127.0.0.1:8899/"),
    ]
    entries = [parse_entry(f"{T0}-{i}", f) for i, f in enumerate(fields)]
    assert apply_results(db, entries) == (2, 0, [])
    cols = "route_id, checked_at, alive, latency_ms, status, attempts, error, anonymity, body, judge, " \
           "stream_id, exit_ip"
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert _history(db, cols) == [
        (b.route_id, epoch + timedelta(milliseconds=T0), False, None, None, 0, "ReadTimeout", None, None,
         "http://127.0.0.1:8899/", f"{T0}-1", None),
        (a.route_id, epoch + timedelta(milliseconds=T0 + 7), True, pytest.approx(1234.568, rel=1e-6), 201, 3,
         None, "elite", "{}", "http://127.0.0.1:8899/", f"{T0}-0", "127.9.8.7"),
    ]


@pytest.fixture
def no_default_partition(db):
    """check_history without its DEFAULT partition and with one month partition, 2091-01; restored after
    the test."""
    with db.begin() as c:
        c.exec_driver_sql("ALTER TABLE check_history DETACH PARTITION check_history_default")
        c.exec_driver_sql("CREATE TABLE check_history_bulk_test PARTITION OF check_history "
                          "FOR VALUES FROM ('2091-01-01 00:00+00') TO ('2091-02-01 00:00+00')")
    yield datetime(2091, 1, 15, tzinfo=UTC)
    with db.begin() as c:
        c.exec_driver_sql("DROP TABLE check_history_bulk_test")
        c.exec_driver_sql("ALTER TABLE check_history ATTACH PARTITION check_history_default DEFAULT")


def test_a_result_no_partition_covers_is_dead_lettered_alone(db, redis_client, redis_prefix, stored,
                                                             no_default_partition):
    a = stored[0]
    covered = int(no_default_partition.timestamp() * 1000)
    ids = append_entries(redis_client, redis_prefix, [
        encode_result(route_id=a.route_id, route_hash=a.route_hash, alive=False, checked_at_ms=covered,
                      judge="http://127.0.0.1:8899/"),
        encode_result(route_id=a.route_id, route_hash=a.route_hash, alive=False, checked_at_ms=T0,
                      judge="http://127.0.0.1:8899/"),
        encode_result(route_id=a.route_id, route_hash=a.route_hash, alive=True, checked_at_ms=covered + 1,
                      latency_ms=5.0, judge="http://127.0.0.1:8899/"),
    ])
    rep = ingest(redis_client, db, redis_prefix, "c1")
    assert rep.infra_error is None and (rep.committed, rep.dead) == (2, 1)
    assert [r[0] for r in _history(db, "stream_id")] == [ids[0], ids[2]]
    [(_, f)] = redis_client.xrange(dead_key(redis_prefix))
    assert f[b"stream_id"].decode() == ids[1]
    assert f[b"reason"].decode().startswith('rejected by database: no partition of relation "check_history"')


def test_a_connection_lost_during_copy_is_an_infrastructure_failure(db, pg_url, stored):
    a = stored[0]
    with db.begin() as c:  # the server ends the session as the row arrives
        c.exec_driver_sql(
            "CREATE FUNCTION magpie_test_kill() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.error = 'kill' THEN PERFORM pg_terminate_backend(pg_backend_pid()); END IF; "
            "RETURN NEW; END $$")
        c.exec_driver_sql("CREATE TRIGGER magpie_test_kill BEFORE INSERT ON check_history "
                          "FOR EACH ROW EXECUTE FUNCTION magpie_test_kill()")
    engine = sa.create_engine(pg_url, pool_size=1, max_overflow=0)
    try:
        kill = parse_entry(f"{T0}-0", encode_result(route_id=a.route_id, route_hash=a.route_hash, alive=False,
                                                    checked_at_ms=T0, error="kill", judge="j"))
        with pytest.raises(sa.exc.DBAPIError) as lost:
            apply_results(engine, [kill])
        assert lost.value.connection_invalidated
        assert is_infra_failure(lost.value) and not is_data_error(lost.value)
        ok = parse_entry(f"{T0}-1", encode_result(route_id=a.route_id, route_hash=a.route_hash, alive=False,
                                                  checked_at_ms=T0 + 1, error="fine", judge="j"))
        assert apply_results(engine, [ok]) == (1, 0, [])  # the pool replaced the lost connection
    finally:
        engine.dispose()
        with db.begin() as c:
            c.exec_driver_sql("DROP TRIGGER magpie_test_kill ON check_history")
            c.exec_driver_sql("DROP FUNCTION magpie_test_kill()")
    assert [r[0] for r in _history(db, "stream_id")] == [f"{T0}-1"]
