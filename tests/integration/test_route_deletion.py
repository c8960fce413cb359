"""Deleting a route deletes its check history (``check_history`` has no foreign key to ``routes``), and
ingestion never lands a row for a deleted route, whichever transaction gets to the route first.

The removal paths themselves (bulk verbs, workspace deletion, orphan sweep, ownership verification,
blacklist removal) assert the same on their own tests; this file covers the shared statement and its
races with ingestion on real PostgreSQL (``db``)."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

from helpers import add_history, history_by_route, wait_until
from magpie.base.crypto import get_keyring
from magpie.base.routes import Route
from magpie.db.deletion import delete_routes
from magpie.db.repo import upsert_routes
from magpie.stats.entry import encode_result, parse_entry
from magpie.stats.store import _apply_tx, apply_results

KEY = "test-key-0123456789abcdef"
T0 = 1_700_000_000_000  # ms


@pytest.fixture
def routes(db):
    """Three routes of workspace ``alpha``: list of StoredRoute."""
    stored = upsert_routes(db, get_keyring(KEY), "alpha", [Route("http", "127.0.9.1", 8000 + i) for i in range(3)])
    return stored.routes


def _entries(route, n: int, first: int = 0):
    return [parse_entry(f"{T0 + first + i}-0", encode_result(
        route_id=route.route_id, route_hash=route.route_hash, alive=False, checked_at_ms=T0 + first + i,
        error="timeout", judge="http://127.0.0.1:8899/")) for i in range(n)]


def _unlink(db, route_ids) -> None:
    with db.begin() as c:
        c.execute(sa.text("DELETE FROM route_workspaces WHERE route_id = ANY(:i)"), {"i": list(route_ids)})


def _route_count(db, route_id) -> int:
    with db.connect() as c:
        return c.execute(sa.text("SELECT count(*) FROM routes WHERE id = :i"), {"i": route_id}).scalar_one()


def _waiting_on_a_lock(db, statement: str) -> bool:
    with db.connect() as c:
        return bool(c.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE :q"), {"q": f"%{statement}%"}).scalar_one())


def test_delete_routes_takes_the_history_of_the_routes_it_deletes_only(db, routes):
    a, b, c = (r.route_id for r in routes)
    add_history(db, [a, b, c], per_route=3)
    _unlink(db, [a])
    with db.begin() as conn:  # b is still owned: kept, with its history
        assert delete_routes(conn, [a, b, 999_999]) == [a]
    assert history_by_route(db) == {b: 3, c: 3}
    with db.begin() as conn:  # owned=True deletes an owned route too
        assert delete_routes(conn, [b], owned=True) == [b]
        assert delete_routes(conn, []) == []
    assert history_by_route(db) == {c: 3}
    assert (_route_count(db, a), _route_count(db, b), _route_count(db, c)) == (0, 0, 1)


def test_a_rolled_back_deletion_keeps_the_route_and_its_history(db, routes):
    a = routes[0].route_id
    add_history(db, [a])
    _unlink(db, [a])
    with db.connect() as conn:
        with conn.begin() as tx:
            assert delete_routes(conn, [a]) == [a]
            tx.rollback()
    assert _route_count(db, a) == 1 and history_by_route(db) == {a: 2}


def test_results_for_a_deleted_route_are_dead_lettered_and_leave_no_row(db, routes):
    a, b = routes[0], routes[1]
    _unlink(db, [a.route_id])
    with db.begin() as conn:
        assert delete_routes(conn, [a.route_id]) == [a.route_id]
    committed, replayed, dead = apply_results(db, _entries(a, 2) + _entries(b, 1, first=10))
    assert (committed, replayed) == (1, 0)
    assert [d.reason for d in dead] == [f"route {a.route_id} no longer exists"] * 2
    assert history_by_route(db) == {b.route_id: 1}


def test_a_deletion_waits_for_an_ingestion_in_flight_and_takes_its_rows_too(db, routes):
    """Ingestion holds the route ``FOR KEY SHARE`` with its rows written but not committed; the deletion
    waits for it and, in its second statement (a fresh snapshot), deletes the rows it committed."""
    a, b = routes[0], routes[1]
    add_history(db, [a.route_id, b.route_id], per_route=1)
    _unlink(db, [a.route_id])
    outcome: dict = {}

    def delete():
        try:
            with db.begin() as conn:
                outcome["deleted"] = delete_routes(conn, [a.route_id])
        except Exception as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    with db.connect() as ingest:
        tx = ingest.begin()
        assert _apply_tx(ingest, _entries(a, 3) + _entries(b, 1, first=10))[0] == 4
        worker = threading.Thread(target=delete)
        worker.start()
        try:
            wait_until(lambda: _waiting_on_a_lock(db, "DELETE FROM routes"), timeout=10,
                       what="the deletion waiting for the ingestion's lock")
            assert worker.is_alive()
        finally:
            tx.commit()
        worker.join(10)
    assert not worker.is_alive() and "error" not in outcome, outcome
    assert outcome["deleted"] == [a.route_id]
    assert history_by_route(db) == {b.route_id: 2}  # a's old row and the 3 ingested in flight are gone


def test_an_ingestion_waits_for_a_deletion_in_flight_and_dead_letters_the_route(db, routes):
    a, b = routes[0], routes[1]
    _unlink(db, [a.route_id])
    outcome: dict = {}

    def ingest():
        try:
            outcome["result"] = apply_results(db, _entries(a, 2) + _entries(b, 1, first=10))
        except Exception as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    with db.connect() as deleter:
        tx = deleter.begin()
        assert delete_routes(deleter, [a.route_id]) == [a.route_id]
        worker = threading.Thread(target=ingest)
        worker.start()
        try:
            wait_until(lambda: _waiting_on_a_lock(db, "FOR KEY SHARE"), timeout=10,
                       what="the ingestion waiting for the deletion's lock")
            assert worker.is_alive()
        finally:
            tx.commit()
        worker.join(10)
    assert not worker.is_alive() and "error" not in outcome, outcome
    committed, replayed, dead = outcome["result"]
    assert (committed, replayed) == (1, 0)
    assert [d.reason for d in dead] == [f"route {a.route_id} no longer exists"] * 2
    assert history_by_route(db) == {b.route_id: 1}


def test_check_history_has_no_foreign_key_on_any_partition(db):
    from datetime import UTC, datetime

    from magpie.maintenance.partitions import create_month_partition

    made = create_month_partition(db, datetime(2096, 3, 1, tzinfo=UTC))
    try:
        with db.connect() as c:
            fks = c.execute(sa.text(
                "SELECT conrelid::regclass::text, conname FROM pg_constraint WHERE contype = 'f' AND conrelid IN "
                "(SELECT 'check_history'::regclass UNION ALL "
                " SELECT inhrelid FROM pg_inherits WHERE inhparent = 'check_history'::regclass)")).all()
        assert fks == []
    finally:
        if made["created"]:
            with db.begin() as c:
                c.exec_driver_sql(f"DROP TABLE {made['name']}")
