"""Alembic environment for magpie.

Run through :mod:`magpie.db.migrate` (programmatic :class:`alembic.config.Config`); the caller puts either
an open SQLAlchemy ``Connection`` in ``config.attributes["connection"]`` or a URL in
``config.attributes["url"]`` (``sqlalchemy.url`` in an ini file works as a fallback).

Online migrations take a transaction-scoped PostgreSQL advisory lock first, so several processes running
``magpie db upgrade`` at once apply each revision exactly once.
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import context

from magpie.db.models import Base
# every package's models, so autogenerate sees all tables
import magpie.alerts.models  # noqa: E402,F401
import magpie.coordination.fencing  # noqa: E402,F401
import magpie.maintenance.models  # noqa: E402,F401
import magpie.outbox.models  # noqa: E402,F401
# models: schedule backend
import magpie.queue.pg.models  # noqa: E402,F401
# models: judges, profiles, failures
import magpie.judges.models  # noqa: E402,F401
# models: enrichment, blacklists
import magpie.blacklists.models  # noqa: E402,F401
import magpie.enrich.models  # noqa: E402,F401
# models: reputation, rollups, instances
import magpie.derived.models  # noqa: E402,F401
# models: rotators
import magpie.rotator.models  # noqa: E402,F401
# models: API tokens
import magpie.apitokens.models  # noqa: E402,F401
# models: proxy-list sources
import magpie.sources.models  # noqa: E402,F401

config = context.config
target_metadata = Base.metadata

MIGRATION_LOCK_KEY = 0x6D61677069650001  # "magpie" + 1: pg_advisory_xact_lock key for migrations

# Partitions of check_history are created by migrations / maintenance, not modelled one by one.
_PARTITION = re.compile(r"^check_history_.+")


def _include_object(obj, name, type_, reflected, compare_to):
    return not (type_ == "table" and name and _PARTITION.match(name))


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:  # the alembic CLI (alembic.ini names no URL): the same setting as magpie
        from magpie.config import load_settings

        url = load_settings().database_url
    if not url:
        raise RuntimeError("no database URL: set config.attributes['url'] or sqlalchemy.url")
    return url


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        include_object=_include_object,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_object=_include_object,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = sa.create_engine(_url(), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
