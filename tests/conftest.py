"""Shared fixtures: real Redis (own key prefix per test) and real PostgreSQL (own database per session).

Every test cleans up what it wrote, so the suite can run twice in a row against the same servers.
"""

from __future__ import annotations

import os
import uuid

import pytest
import redis
import sqlalchemy as sa

# Tests run every proxy, judge and webhook on loopback: allow it explicitly (the default refuses it).
os.environ.setdefault("MAGPIE_CHECK_ALLOW_PRIVATE", "127.0.0.0/8,::1")
# Deny-by-default egress for the whole session and every subprocess (they inherit the environment):
# nothing outside loopback is ever dialled, whatever a test or the code under test asks for.
os.environ["MAGPIE_EGRESS_ONLY"] = os.environ.get("MAGPIE_TEST_EGRESS_ONLY", "127.0.0.0/8,::1")
from magpie.base.egress import install_socket_guard  # noqa: E402

install_socket_guard()
REDIS_URL = os.environ.get("MAGPIE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
from private_cluster import cluster_client, cluster_prefix, fault_cluster, redis_cluster  # noqa: E402,F401

PG_ADMIN_URL = os.environ.get("MAGPIE_TEST_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")


@pytest.fixture
def redis_prefix():
    """A fresh key prefix; every key under it is deleted after the test."""
    prefix = f"magpie-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    r = redis.Redis.from_url(REDIS_URL)
    # one pass finds both forms: "<prefix>..." and hash-tagged "{<prefix>...}..."
    keys = list(r.scan_iter(match="*" + prefix + "*", count=10_000))
    for i in range(0, len(keys), 500):
        r.delete(*keys[i : i + 500])
    r.close()


@pytest.fixture
def redis_client():
    r = redis.Redis.from_url(REDIS_URL)
    yield r
    r.close()


@pytest.fixture(scope="session")
def pg_url():
    """URL of a throwaway PostgreSQL database migrated to head; dropped after the session."""
    name = f"magpie_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    from magpie.db.migrate import upgrade

    upgrade(url)
    yield url
    with admin.connect() as c:
        c.execute(
            sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name}
        )
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


@pytest.fixture
def settings(redis_prefix, request):
    """Settings pointing at the test Redis prefix (and the test database when ``pg_url`` is in use)."""
    from magpie.config import load_settings

    overrides = dict(redis_url=REDIS_URL, redis_prefix=redis_prefix, encryption_key="test-key-0123456789abcdef")
    if "pg_url" in request.fixturenames or "db" in request.fixturenames:
        overrides["database_url"] = request.getfixturevalue("pg_url")
    return load_settings(**overrides)


def empty_tables(engine) -> list[str]:
    """Empty every magpie table and restart every sequence, as ``TRUNCATE ... RESTART IDENTITY`` of all
    tables would, touching only the tables that hold rows: a ``TRUNCATE`` of the ~40 tables costs 0.3-0.8 s
    (one cascading from ``workspaces`` about as much), a ``DELETE`` of a test's few rows about 1 ms. Rows
    go with ``DELETE`` (foreign-key triggers off for the transaction: every table is emptied anyway); the
    PostgreSQL schedule's tables are truncated, so no dead tuples reach its health check. Returns the
    tables emptied."""
    with engine.begin() as c:
        tables = [
            r[0]
            for r in c.execute(
                sa.text(
                    "SELECT tablename FROM pg_tables WHERE schemaname='public' AND tablename <> 'alembic_version'"
                )
            )
        ]
        if not tables:
            return []
        probe = " UNION ALL ".join(f'SELECT {i} WHERE EXISTS (SELECT 1 FROM "{t}")'
                                   for i, t in enumerate(tables))
        full = [tables[r[0]] for r in c.execute(sa.text(probe))]
        superuser = c.execute(sa.text("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")).scalar()
        schedule = [t for t in full if t.startswith("schedule_") or not superuser]  # DELETE needs superuser
        if schedule:
            names = ", ".join(f'"{t}"' for t in schedule)
            c.execute(sa.text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
        rest = [t for t in full if t not in schedule]
        if rest:
            c.execute(sa.text("SET LOCAL session_replication_role = replica"))
            for t in rest:
                c.execute(sa.text(f'DELETE FROM "{t}"'))
        used = c.execute(sa.text(  # sequences of tables that are empty again (rows deleted, or rolled back)
            "SELECT sequencename FROM pg_sequences WHERE schemaname = 'public' AND last_value IS NOT NULL"
        )).all()
        for (name,) in used:
            c.execute(sa.text(f'ALTER SEQUENCE "{name}" RESTART'))
    return full


@pytest.fixture
def db(pg_url):
    """An engine on the session database; all magpie tables are emptied after the test."""
    engine = sa.create_engine(pg_url)
    yield engine
    empty_tables(engine)
    engine.dispose()


@pytest.fixture
def amqp_vhost():
    """A RabbitMQ vhost of the test's own (``magpie-test-<random>``, ``guest`` granted everything on it),
    deleted with its queues afterwards: a :class:`magpie.lab.rabbitmq.Vhost` (``.url``, ``.name``).
    Skips the test when RabbitMQ (127.0.0.1:5672, ``rabbitmqctl``) is not reachable."""
    from magpie.lab.rabbitmq import RabbitUnavailable, Vhost

    vh = Vhost()
    try:
        vh.create()
    except RabbitUnavailable as exc:
        vh.delete()
        pytest.skip(f"RabbitMQ not available: {exc}")
    yield vh
    vh.delete()
