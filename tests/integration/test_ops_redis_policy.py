"""Workers and beat refuse a Redis whose maxmemory-policy can evict schedule keys; an unreadable policy
only warns."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from private_redis import PrivateRedis

from helpers import wait_until

from magpie.db.keycheck import verify_key
from magpie.queue.redis_policy import EvictionPolicyError, check_policy, eviction_policy, verify_redis_policy_at_start

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-0123456789abcdef"


@pytest.fixture
def private(tmp_path):
    srv = PrivateRedis(tmp_path)
    yield srv
    srv.stop()


def _start(srv: PrivateRedis, *extra: str) -> redis.Redis:
    """Start the private server with extra redis-server arguments (``--maxmemory-policy x`` ...)."""
    srv.proc = subprocess.Popen(
        [srv.exe, "--port", str(srv.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", srv.dir, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c = redis.Redis(port=srv.port, socket_timeout=1, socket_connect_timeout=1)

    def up():
        try:
            return c.ping()
        except redis.ConnectionError:
            return False

    wait_until(up, timeout=5, interval=0.025, what="the private redis-server")
    return c


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl", "allkeys-random"])
def test_an_evicting_policy_is_refused_with_one_line(policy):
    with pytest.raises(EvictionPolicyError) as err:
        check_policy(policy)
    text = str(err.value)
    assert "\n" not in text and policy in text and "noeviction" in text


def test_noeviction_and_unknown_pass():
    check_policy("noeviction")
    check_policy(None)


def test_policy_read_from_a_real_server_and_unknown_when_config_is_disabled(private, settings, caplog):
    c = _start(private, "--maxmemory-policy", "volatile-lru")
    assert eviction_policy(c) == "volatile-lru"
    with pytest.raises(EvictionPolicyError):
        verify_redis_policy_at_start(settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{private.port}/0"}))
    c.config_set("maxmemory-policy", "noeviction")
    assert verify_redis_policy_at_start(
        settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{private.port}/0"})) == "noeviction"
    private.stop()

    c = _start(private, "--rename-command", "CONFIG", "", "--maxmemory-policy", "allkeys-lru")
    assert eviction_policy(c) is None
    with caplog.at_level(logging.WARNING, logger="magpie.queue.redis_policy"):
        assert verify_redis_policy_at_start(
            settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{private.port}/0"})) is None
    assert any("refused CONFIG GET" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["worker", "beat"])
def test_a_celery_process_on_an_evicting_redis_exits_2_with_one_line(kind, private, settings, db, pg_url, tmp_path):
    _start(private, "--maxmemory-policy", "allkeys-lru")
    verify_key(db, KEY)
    url = f"redis://127.0.0.1:{private.port}/0"
    env = dict(os.environ, MAGPIE_REDIS_URL=url, MAGPIE_REDIS_PREFIX=settings.redis_prefix,
               MAGPIE_BROKER_URL=url, MAGPIE_DATABASE_URL=pg_url, PROXY_ENCRYPTION_KEY=KEY)
    args = {"worker": ["worker", "-Q", "checks", "--pool=solo", "--without-mingle", "--without-gossip"],
            "beat": ["beat", f"--schedule={tmp_path / 'beat'}"]}[kind]
    log = tmp_path / f"{kind}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "magpie", *args], cwd=ROOT, env=env,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        pytest.fail(f"{kind} on an evicting Redis kept running:\n{log.read_text()[-2000:]}")
    out = log.read_text()
    hits = [ln for ln in out.splitlines() if "maxmemory-policy" in ln]
    assert code == 2, out
    assert len(hits) == 1 and hits[0].startswith("Error: Redis at MAGPIE_REDIS_URL has maxmemory-policy allkeys-lru")
    assert "Traceback" not in out
