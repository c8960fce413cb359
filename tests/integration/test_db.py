"""PostgreSQL schema, migrations and the import repository against a real server (``pg_url``/``db``)."""

from __future__ import annotations

import uuid

import pytest
from helpers import run_concurrently
import sqlalchemy as sa

from magpie.base.crypto import get_keyring
from magpie.db import migrate
from magpie.db.repo import all_route_records, latest_health, upsert_routes
from magpie.db.session import get_engine, session_scope
from magpie.queue.payload import schedule_item
from magpie.queue.payload import Payload
from magpie.base.routes import Route

KEY = "test-key-0123456789abcdef"


@pytest.fixture
def keyring():
    return get_keyring(KEY)


def _routes(n: int, *, base_port: int = 10000, creds: bool = False) -> list[Route]:
    out = []
    for i in range(n):
        user, pw = (f"user{i}", f"pa:ss/{i}") if creds else (None, None)
        out.append(
            Route(
                "socks5" if i % 2 else "http",
                f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}",
                base_port + i % 50000,
                user,
                pw,
            )
        )
    return out


def _count(db, table: str, where: str = "", **params) -> int:
    with db.connect() as c:
        return c.execute(sa.text(f"SELECT count(*) FROM {table} {where}"), params).scalar_one()


# ------------------------------------------------------------------------------------------ migration


def test_migration_at_head_creates_all_tables_and_partitioned_history(pg_url, db):
    assert migrate.current_revision(pg_url) == migrate.head_revision()
    assert migrate.head_revision() == sorted(p.name.split("_")[0] for p in (migrate.MIGRATIONS_DIR / "versions").glob("0*.py"))[-1]
    with db.connect() as c:
        kinds = dict(
            c.execute(
                sa.text(
                    "SELECT c.relname, c.relkind FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p')"
                )
            ).all()
        )
        parts = c.execute(
            sa.text(
                "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
                "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'check_history'::regclass"
            )
        ).all()
        partkey = c.execute(sa.text("SELECT pg_get_partkeydef('check_history'::regclass)")).scalar_one()
        index = c.execute(
            sa.text(
                "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_check_history_route_id_checked_at'"
            )
        ).scalar_one()
    for table in (
        "workspaces",
        "routes",
        "route_workspaces",
        "route_health",
        "stats_ledger",
        "alembic_version",
    ):
        assert kinds.get(table) == "r", table
    assert kinds["check_history"] == "p"
    assert partkey == "RANGE (checked_at)"
    assert parts == [("check_history_default", "DEFAULT")]
    assert "(route_id, checked_at DESC)" in index


def test_upgrade_twice_is_a_no_op(pg_url):
    migrate.upgrade(pg_url)
    assert migrate.current_revision(pg_url) == migrate.head_revision()


def test_ensure_database_creates_missing_database_once():
    url = f"postgresql+psycopg2://postgres@127.0.0.1:5432/magpie_test_ensure_{uuid.uuid4().hex[:8]}"
    try:
        assert migrate.ensure_database(url) is True
        assert migrate.ensure_database(url) is False
        assert migrate.current_revision(url) is None
    finally:
        admin = sa.create_engine(url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}"'))
        admin.dispose()


def test_session_scope_commits_and_rolls_back(db, pg_url):
    from magpie.db.models import Workspace

    assert get_engine(pg_url) is get_engine(pg_url)
    with session_scope(pg_url) as s:
        s.add(Workspace(name="kept"))
    with pytest.raises(RuntimeError), session_scope(pg_url) as s:
        s.add(Workspace(name="dropped"))
        s.flush()
        raise RuntimeError("boom")
    with db.connect() as c:
        assert c.execute(sa.text("SELECT name FROM workspaces")).scalars().all() == ["kept"]


# --------------------------------------------------------------------------------------------- import


def test_upsert_is_idempotent(db, keyring):
    routes = _routes(50)
    first = upsert_routes(db, keyring, "alpha", routes)
    second = upsert_routes(db, keyring, "alpha", routes)
    assert first.inserted == 50 and len(first.new_members) == 50 and first.already_members == []
    assert second.inserted == 0 and second.new_members == [] and len(second.already_members) == 50
    assert [s.route_id for s in first.routes] == [s.route_id for s in second.routes]
    assert [s.route for s in second.routes] == routes  # input order
    assert all(s.route_hash == keyring.route_hash(s.route) for s in second.routes)
    assert all(s.workspace_ids == [first.workspace_id] for s in second.routes)
    assert _count(db, "routes") == 50
    assert _count(db, "route_workspaces") == 50
    assert _count(db, "workspaces") == 1


def test_membership_merges_across_workspaces(db, keyring):
    r = _routes(3)
    a = upsert_routes(db, keyring, "alpha", r[:2])
    b = upsert_routes(db, keyring, "beta", r[1:])
    assert b.workspace_id != a.workspace_id
    assert b.inserted == 1  # r[1] already stored
    assert {s.route for s in b.new_members} == {r[1], r[2]}  # both new to beta
    shared = {s.route: s for s in b.routes}[r[1]]
    assert shared.workspace_ids == sorted([a.workspace_id, b.workspace_id])
    assert shared.route_id == a.routes[1].route_id
    assert {s.route: s for s in b.routes}[r[2]].workspace_ids == [b.workspace_id]
    again = upsert_routes(db, keyring, "alpha", [r[1]])
    assert again.new_members == [] and [s.route for s in again.already_members] == [r[1]]
    assert again.routes[0].workspace_ids == sorted([a.workspace_id, b.workspace_id])
    key, entry = schedule_item(again.routes[0])  # what the schedule gets: the full workspace list
    assert key == again.routes[0].route_hash
    assert Payload.decode(entry).workspaces == sorted([a.workspace_id, b.workspace_id])


def test_concurrent_imports_of_the_same_routes_do_not_duplicate(db, keyring):
    routes = _routes(3000, creds=True)
    results, errors = run_concurrently(lambda: upsert_routes(db, keyring, "shared", routes, chunk=500), 3)
    assert errors == []
    assert _count(db, "routes") == 3000 and _count(db, "route_workspaces") == 3000
    assert sum(r.inserted for r in results) == 3000
    new = [s.route_id for r in results for s in r.new_members]
    assert len(new) == len(set(new)) == 3000  # every route is new to the workspace in exactly one import
    ids = [[s.route_id for s in r.routes] for r in results]
    assert ids[0] == ids[1] == ids[2]


def test_credentials_are_encrypted_at_rest(db, keyring):
    route = Route("socks5", "192.0.2.7", 1080, "alice", "s3cret:pw")
    stored = upsert_routes(db, keyring, "alpha", [route]).routes[0]
    with db.connect() as c:
        uenc, penc = c.execute(
            sa.text("SELECT username_enc, password_enc FROM routes WHERE id = :i"), {"i": stored.route_id}
        ).one()
    assert uenc != "alice" and "alice" not in uenc
    assert penc != "s3cret:pw" and "s3cret" not in penc
    assert keyring.decrypt(uenc) == "alice" and keyring.decrypt(penc) == "s3cret:pw"
    [record] = list(all_route_records(db, keyring))
    assert record.route == route and record.route_hash == stored.route_hash
    [row] = latest_health(db, keyring=keyring)
    assert row["username"] == "alice" and "password" not in row
    assert "s3cret:pw" not in repr(row)
    assert latest_health(db)[0]["username"] is None  # no keyring, no plaintext


def test_latest_health_lists_never_checked_routes_in_order(db, keyring):
    routes = [
        Route("socks5", "10.0.0.1", 1080),
        Route("http", "10.0.0.2", 8080),
        Route("http", "10.0.0.1", 9090),
        Route("http", "10.0.0.1", 8080),
    ]
    upsert_routes(db, keyring, "alpha", routes[:3])
    upsert_routes(db, keyring, "beta", routes[3:])
    rows = latest_health(db)
    assert [(r["protocol"], r["host"], r["port"]) for r in rows] == [
        ("http", "10.0.0.1", 8080),
        ("http", "10.0.0.1", 9090),
        ("http", "10.0.0.2", 8080),
        ("socks5", "10.0.0.1", 1080),
    ]
    assert all(r["alive"] is None and r["checks_total"] == 0 and r["last_checked_at"] is None for r in rows)
    assert [r["port"] for r in latest_health(db, "beta")] == [8080]
    assert len(latest_health(db, "alpha")) == 3
    assert latest_health(db, "nope") == []


def test_all_route_records_skips_routes_without_workspace(db, keyring):
    store = upsert_routes(db, keyring, "alpha", _routes(5, creds=True))
    orphan = store.routes[0].route_id
    with db.begin() as c:
        c.execute(sa.text("DELETE FROM route_workspaces WHERE route_id = :i"), {"i": orphan})
    records = list(all_route_records(db, keyring))
    assert [p.route_id for p in records] == sorted(s.route_id for s in store.routes[1:])
    assert all(p.workspace_ids == [store.workspace_id] for p in records)
    assert {p.route for p in records} == {s.route for s in store.routes[1:]}
    everything = list(all_route_records(db, keyring, include_orphans=True))
    assert len(everything) == 5
    assert {p.route_id: p.workspace_ids for p in everything}[orphan] == []
