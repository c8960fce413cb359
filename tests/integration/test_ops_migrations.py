"""Alembic: the models declare what the migrations make (autogenerate finds nothing), the whole chain
goes up, down to base and up again, and ``magpie db ...`` reports both."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from magpie.db import migrate

ROOT = Path(__file__).resolve().parents[2]
PG_ADMIN_URL = os.environ.get("MAGPIE_TEST_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")


@pytest.fixture
def fresh_url():
    """An empty database of its own (not migrated); dropped after the test."""
    name = f"magpie_test_mig_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    with admin.connect() as c:
        c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as c:
            return {r[0] for r in c.execute(sa.text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"))}
    finally:
        engine.dispose()


def _compare(url: str) -> list:
    """alembic.autogenerate.compare_metadata of the models against the database (through env.py)."""
    return migrate.schema_diff(url)


def test_models_match_migrations_and_the_chain_round_trips(fresh_url):
    migrate.upgrade(fresh_url)
    assert migrate.current_revision(fresh_url) == migrate.head_revision()
    assert _compare(fresh_url) == []
    migrated = _tables(fresh_url)
    assert {"routes", "check_history", "stats_ledger", "maintenance_runs"} <= migrated

    migrate.downgrade(fresh_url, "base")
    assert migrate.current_revision(fresh_url) is None
    assert _tables(fresh_url) <= {"alembic_version"}  # every revision's downgrade undoes its upgrade

    migrate.upgrade(fresh_url)
    assert migrate.current_revision(fresh_url) == migrate.head_revision()
    assert _tables(fresh_url) == migrated
    assert _compare(fresh_url) == []


def test_every_revision_steps_down_and_up_one_at_a_time(fresh_url):
    revs = [r["revision"] for r in reversed(migrate.history())]  # oldest first
    migrate.upgrade(fresh_url)
    for rev in reversed(revs[:-1]):
        migrate.downgrade(fresh_url, "-1")
        assert migrate.current_revision(fresh_url) == rev
    migrate.downgrade(fresh_url, "-1")
    assert migrate.current_revision(fresh_url) is None
    for rev in revs:
        migrate.upgrade(fresh_url, "+1")
        assert migrate.current_revision(fresh_url) == rev


def test_an_index_missing_from_the_database_is_reported(fresh_url):
    migrate.upgrade(fresh_url)
    engine = sa.create_engine(fresh_url, poolclass=sa.pool.NullPool)
    with engine.begin() as c:
        c.execute(sa.text("DROP INDEX ix_stats_ledger_stream_order"))
    engine.dispose()
    diff = _compare(fresh_url)
    assert [(d[0], d[1].name) for d in diff] == [("add_index", "ix_stats_ledger_stream_order")]


def _cli(url: str, *args: str):
    from magpie.cli import main
    from magpie.config import get_settings

    get_settings.cache_clear()
    env = {"MAGPIE_DATABASE_URL": url, "PROXY_ENCRYPTION_KEY": "test-key-0123456789abcdef"}
    try:
        return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    finally:
        get_settings.cache_clear()


def test_db_commands(fresh_url):
    res = _cli(fresh_url, "db", "check")
    assert res.exit_code == 1 and "run magpie db upgrade" in res.output
    res = _cli(fresh_url, "db", "upgrade")
    assert res.exit_code == 0, res.output
    res = _cli(fresh_url, "db", "current", "--json")
    assert '"at_head": true' in res.output
    res = _cli(fresh_url, "db", "check", "--json")
    assert res.exit_code == 0 and '"differences": []' in res.output
    res = _cli(fresh_url, "db", "history")
    assert res.output.splitlines()[0].endswith(("(head): " + migrate.history()[0]["doc"].splitlines()[0]))
    res = _cli(fresh_url, "db", "downgrade", "0004", "--yes")
    assert res.exit_code == 0 and "revision 0004" in res.output
    res = _cli(fresh_url, "db", "check")
    assert res.exit_code == 1 and "database at 0004" in res.output
    res = _cli(fresh_url, "db", "downgrade", "nonsense", "--yes")
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "***" not in res.output


def test_plain_alembic_check_reads_the_magpie_setting(fresh_url):
    migrate.upgrade(fresh_url)
    alembic = Path(sys.executable).with_name("alembic")
    env = dict(os.environ, MAGPIE_DATABASE_URL=fresh_url)
    res = subprocess.run([str(alembic), "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "No new upgrade operations detected" in res.stdout + res.stderr


def _history_fks(engine) -> set[tuple[str, str]]:
    """(table, referenced table) of every foreign key on ``check_history`` and its partitions."""
    with engine.connect() as c:
        return set(c.execute(sa.text(
            "SELECT conrelid::regclass::text, confrelid::regclass::text FROM pg_constraint WHERE contype = 'f' "
            "AND conrelid IN (SELECT 'check_history'::regclass UNION ALL "
            "SELECT inhrelid FROM pg_inherits WHERE inhparent = 'check_history'::regclass)")).all())


def _history_rows(engine) -> dict[int, int]:
    with engine.connect() as c:
        return dict(c.execute(sa.text("SELECT route_id, count(*) FROM check_history GROUP BY route_id")).all())


def test_history_foreign_key_goes_and_comes_back_on_a_database_holding_data(fresh_url):
    """0017 drops check_history's foreign key on the parent and every partition and keeps every row; its
    downgrade deletes the history of routes deleted meanwhile and puts the key (and the cascade) back."""
    from datetime import UTC, datetime

    from magpie.db.deletion import delete_routes
    from magpie.maintenance.partitions import create_month_partition

    migrate.upgrade(fresh_url, "0016")
    engine = sa.create_engine(fresh_url, poolclass=sa.pool.NullPool)
    try:
        part = create_month_partition(engine, datetime(2096, 3, 1, tzinfo=UTC))["name"]
        with engine.begin() as c:
            c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('w')"))
            ids = list(c.execute(sa.text(
                "INSERT INTO routes (route_hash, protocol, host, port) SELECT lpad(g::text, 24, '0'), 'http', "
                "'10.0.0.' || g, 8080 FROM generate_series(1, 4) g RETURNING id")).scalars())
            c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) SELECT id, 1 FROM routes"))
            c.execute(sa.text(  # one row in the month's partition and one in DEFAULT per route
                "INSERT INTO check_history (route_id, checked_at, alive) SELECT id, t, false FROM routes, "
                "unnest(ARRAY[timestamptz '2096-03-05 12:00Z', timestamptz '2000-01-01 00:00Z']) t"))
        under_fk = {("check_history", "routes"), ("check_history_default", "routes"), (part, "routes")}
        assert _history_fks(engine) == under_fk
        a, b, c_, d = ids

        migrate.upgrade(fresh_url)
        assert migrate.current_revision(fresh_url) == "0017"
        assert _history_fks(engine) == set()
        assert _history_rows(engine) == {a: 2, b: 2, c_: 2, d: 2}
        with engine.begin() as c:
            assert delete_routes(c, [b], owned=True) == [b]  # the code's way: history goes too
            c.execute(sa.text("DELETE FROM routes WHERE id = :i"), {"i": c_})  # behind the code's back
        assert _history_rows(engine) == {a: 2, c_: 2, d: 2}

        migrate.downgrade(fresh_url, "0016")
        assert migrate.current_revision(fresh_url) == "0016"
        assert _history_fks(engine) == under_fk
        assert _history_rows(engine) == {a: 2, d: 2}  # the orphaned rows could not stand under the key
        with engine.begin() as c:  # the cascade is back
            c.execute(sa.text("DELETE FROM routes WHERE id = :i"), {"i": d})
        assert _history_rows(engine) == {a: 2}

        migrate.upgrade(fresh_url)
        assert _history_fks(engine) == set() and _history_rows(engine) == {a: 2}
        assert _compare(fresh_url) == []
    finally:
        engine.dispose()
