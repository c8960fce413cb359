"""``make demo`` can be pointed elsewhere: exported settings win, its identity (key prefix, database) is its
own, and its reset deletes only its own keys and a database it created."""

from __future__ import annotations

import os
import uuid

import pytest
import sqlalchemy as sa

from magpie.lab import demo
from magpie.config import ConfigError

PG_ADMIN_URL = os.environ.get("MAGPIE_TEST_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")


def test_exported_settings_win_and_the_identity_is_the_demos(monkeypatch):
    for k in ("MAGPIE_DEMO_PREFIX", "MAGPIE_DEMO_DATABASE"):
        monkeypatch.delenv(k, raising=False)
    env = demo.demo_env({"MAGPIE_REDIS_URL": "redis://127.0.0.1:6390/3", "MAGPIE_CHECK_INTERVAL": "5",
                         "MAGPIE_REDIS_PREFIX": "prod:",
                         "MAGPIE_DATABASE_URL": "postgresql+psycopg2://u:pw@10.0.0.5:5433/production",
                         "MAGPIE_BROKER_URL": "amqp://guest@127.0.0.1//"})
    assert env["MAGPIE_REDIS_URL"] == "redis://127.0.0.1:6390/3" and env["MAGPIE_CHECK_INTERVAL"] == "5"
    assert env["MAGPIE_REDIS_PREFIX"] == "magpie-demo:"
    assert env["MAGPIE_DATABASE_URL"] == "postgresql+psycopg2://u:pw@10.0.0.5:5433/magpie_demo"
    assert env["MAGPIE_BROKER_URL"] == "redis://127.0.0.1:6390/3"  # never a shared AMQP vhost
    assert env["MAGPIE_BROKER_KEY_PREFIX"] == "magpie-demo:broker:"
    assert demo.demo_env({})["MAGPIE_CHECK_INTERVAL"] == "8"


def test_its_own_prefix_and_database_can_be_chosen_but_not_the_products(monkeypatch):
    monkeypatch.setenv("MAGPIE_DEMO_PREFIX", "demo-b:")
    monkeypatch.setenv("MAGPIE_DEMO_DATABASE", "magpie_demo_b")
    env = demo.demo_env({"MAGPIE_DEMO_PREFIX": "demo-b:", "MAGPIE_DEMO_DATABASE": "magpie_demo_b",
                         "MAGPIE_BROKER_URL": "redis://127.0.0.1:6379/4"})
    assert env["MAGPIE_REDIS_PREFIX"] == "demo-b:" and env["MAGPIE_DATABASE_URL"].endswith("/magpie_demo_b")
    assert env["MAGPIE_BROKER_URL"] == "redis://127.0.0.1:6379/4"
    with pytest.raises(ConfigError, match="MAGPIE_DEMO_PREFIX"):
        demo.demo_env({"MAGPIE_DEMO_PREFIX": "magpie:"})
    with pytest.raises(ConfigError, match="MAGPIE_DEMO_DATABASE"):
        demo.demo_env({"MAGPIE_DEMO_DATABASE": "x; drop"})


@pytest.fixture
def demo_db_url():
    name = f"magpie_test_demo_{uuid.uuid4().hex[:8]}"
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    yield url
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


def _exists(url: str) -> bool:
    name = url.rsplit("/", 1)[1]
    admin = sa.create_engine(PG_ADMIN_URL)
    with admin.connect() as c:
        found = c.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first()
    admin.dispose()
    return found is not None


def test_reset_deletes_only_its_keys_and_its_own_database(settings, redis_client, redis_prefix, demo_db_url):
    mine = redis_prefix + "demo:"
    redis_client.set(mine + "{default}:proxy_queue:0", "x")
    redis_client.set(mine + "broker:celery", "x")
    redis_client.set(redis_prefix + "other-deployment", "keep")
    s = settings.model_copy(update={"redis_prefix": mine, "broker_url": settings.redis_url,
                                    "database_url": demo_db_url})
    demo._create_own_database(demo_db_url)
    demo._reset(s)
    assert not _exists(demo_db_url)
    assert list(redis_client.scan_iter(match=mine + "*")) == []
    assert redis_client.get(redis_prefix + "other-deployment") == b"keep"


def test_a_database_the_demo_did_not_create_is_never_dropped(demo_db_url, capsys):
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{demo_db_url.rsplit("/", 1)[1]}"'))
    admin.dispose()
    with pytest.raises(SystemExit) as stop:
        demo._drop_own_database(demo_db_url)
    assert stop.value.code == 2 and _exists(demo_db_url)
    err = capsys.readouterr().err
    assert "was not created by the demo" in err and "MAGPIE_DEMO_DATABASE" in err
