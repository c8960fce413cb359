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
