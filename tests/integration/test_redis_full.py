"""Redis at ``maxmemory`` under ``noeviction`` (a private redis-server): what refuses writes is said,
never hidden. The import says what it stored and what it scheduled and exits non-zero, a completion
Redis refused counts no stall against its route, and ``magpie health`` names the memory state."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from magpie.cli import main
from magpie.config import get_settings
from tests.private_redis import PrivateRedis

LIST = "\n".join(f"127.0.0.{1 + i // 200}:{20000 + i}" for i in range(30)) + "\n"


@pytest.fixture
def full_redis(tmp_path):
    srv = PrivateRedis(tmp_path)
    r = srv.start()
    r.config_set("maxmemory-policy", "noeviction")
    yield srv, r
    srv.stop()


def fill(r) -> None:
    """Refuse every write from now on: maxmemory below what Redis already uses."""
    r.config_set("maxmemory", 1)


@pytest.fixture
def cli_on(settings, monkeypatch, full_redis):
    srv, _ = full_redis
    env = {
        "MAGPIE_REDIS_URL": f"redis://127.0.0.1:{srv.port}/0", "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
        "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
        "PROXY_QUEUE_SHARDS": "4", "MAGPIE_CHECK_INTERVAL": "60",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    runner = CliRunner()

    def run(*args):
        return runner.invoke(main, list(args), catch_exceptions=False)

    yield run
    get_settings.cache_clear()


def test_import_into_a_full_redis_says_what_was_stored_and_scheduled(cli_on, full_redis, db, tmp_path):
    _, r = full_redis
    f = tmp_path / "list.txt"
    f.write_text(LIST)
    assert cli_on("import", str(f), "-w", "alpha").exit_code == 0  # bootstraps the schedule
    f2 = tmp_path / "more.txt"
    f2.write_text("\n".join(f"127.0.0.9:{30000 + i}" for i in range(20)) + "\n")
    fill(r)
    res = cli_on("import", str(f2), "-w", "alpha")
    assert res.exit_code == 3, res.output
    text = res.output
    assert "stored 20" in text and "scheduled 0" in text and "maxmemory" in text
    assert "Traceback" not in text and text.strip().count("\n") <= 2
    res = cli_on("import", str(f2), "-w", "alpha", "--json")
    assert res.exit_code == 3
    out = json.loads(res.stdout)
    assert out["stored"] == 20 and out["scheduled"] == 0 and "maxmemory" in out["schedule_error"]
    r.config_set("maxmemory", 0)
    res = cli_on("import", str(f2), "-w", "alpha", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["scheduled"] == 20 and out["schedule_error"] is None
    st = json.loads(cli_on("status", "--json").stdout)
    assert st["totals"]["scheduled"] == 50


def test_health_is_not_ready_while_redis_refuses_writes(cli_on, full_redis, db):
    from magpie.observability.health import redis_write_probe

    _, r = full_redis
    assert redis_write_probe(r, "x:") == "PING ok, writes ok"
    fill(r)
    with pytest.raises(RuntimeError, match="Redis refuses writes: .*maxmemory .*noeviction"):
        redis_write_probe(r, "x:")
    res = cli_on("health", "--json")
    assert res.exit_code != 0
    out = json.loads(res.stdout)
    assert out["ready"] is False and "refuses writes" in out["checks"]["redis"]["detail"]
    r.config_set("maxmemory", 0)
    assert redis_write_probe(r, "x:") == "PING ok, writes ok"
