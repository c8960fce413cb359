"""The bad-input battery a new user and an attacker ran against the command line: every case ends with
one line (exit 2 for a usage error, 3 for a refusal, or an invalid line of an import), never a traceback,
and nothing stored is lost."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from magpie.cli import main
from magpie.config import get_settings
from magpie.queue import RouteQueue
from magpie.queue.payload import payload_revision


@pytest.fixture
def env(settings):
    return {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
            "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
            "PROXY_QUEUE_SHARDS": "4", "MAGPIE_CHECK_INTERVAL": "60"}


@pytest.fixture
def cli(env, db, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    runner = CliRunner()

    def run(*args, code=0, extra=None):
        for k, v in (extra or {}).items():
            monkeypatch.setenv(k, v)
        get_settings.cache_clear()
        res = runner.invoke(main, list(args), catch_exceptions=False)
        assert res.exit_code == code, res.output
        return res

    yield run
    get_settings.cache_clear()


def one_line_error(res) -> str:
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in res.output, res.output
    return err


def subprocess_cli(env, *args, timeout=60):
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-m", "magpie", *args], env=full, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_import_survives_nested_json_control_characters_and_utf16(cli, tmp_path, settings):
    f = tmp_path / "list.jsonl"
    f.write_text('{"a":' * 100_000 + "1\n" + "us\x1b[31mer:pw@127.0.0.5:80\n" + "127.0.0.6:8080\n")
    out = json.loads(cli("import", str(f), "-w", "alpha", "--json").stdout)
    assert out["imported"] == 1
    assert [(x["line"], x["reason"]) for x in out["invalid"]] == [
        (1, "malformed JSON line: nested too deeply"), (2, "control character in the user name")]
    text = cli("import", str(f), "-w", "alpha").output
    assert "\x1b" not in text
    u16 = tmp_path / "win.txt"
    u16.write_bytes("127.0.0.7:3128\r\n127.0.0.8:3128\r\n".encode("utf-16"))
    assert json.loads(cli("import", str(u16), "-w", "alpha", "--json").stdout)["imported"] == 2
    bare = tmp_path / "bare.txt"
    bare.write_bytes("127.0.0.9:3128\n".encode("utf-16-le"))
    out = json.loads(cli("import", str(bare), "-w", "alpha", "--json").stdout)
    assert out["imported"] == 0 and "UTF-16" in out["invalid"][0]["reason"]


def test_workspace_name_with_control_characters_is_refused(cli, tmp_path, db):
    f = tmp_path / "l.txt"
    f.write_text("127.0.0.1:8080\n")
    res = cli("import", str(f), "-w", "acme\x1b[2J\x00", code=2)
    assert "control characters" in one_line_error(res) and "\x1b" not in res.output
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM workspaces")).scalar() == 0


def test_non_numeric_redis_database_is_a_setting_error(cli, settings):
    res = cli("status", code=2, extra={"MAGPIE_REDIS_URL": "redis://127.0.0.1:6379/abc"})
    assert "MAGPIE_REDIS_URL" in one_line_error(res)


def test_judge_on_a_busy_port_is_one_line(env, busy_port):
    res = subprocess_cli(env, "judge", "--port", str(busy_port))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and str(busy_port) in res.stderr


def test_rotator_with_a_busy_metrics_port_is_one_line(env, db, busy_port):
    res = subprocess_cli(dict(env, MAGPIE_ROTATOR_METRICS_PORT=str(busy_port)), "rotator")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "MAGPIE_ROTATOR_METRICS_PORT" in res.stderr.strip().splitlines()[-1]


def test_failed_blacklist_refresh_json_has_no_traceback(env, db, tmp_path):
    with db.begin() as c:
        c.execute(sa.text("INSERT INTO blacklist_sources (name, location) VALUES ('gone', :l)"),
                  {"l": str(tmp_path / "missing.txt")})
    res = subprocess_cli(env, "blacklists", "refresh", "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["status"] == "error"
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 1


@pytest.mark.parametrize("url", ["http://127.1:8899/", "http://0x7f000001/", "http://2130706433/",
                                 "http://0177.0.0.1/", "http://[::ffff:127.0.0.1]/", "http://localhost./",
                                 "http://0/"])
def test_judges_add_refuses_loopback_spellings(cli, url):
    res = cli("judges", "add", url, code=2, extra={"MAGPIE_CHECK_ALLOW_PRIVATE": ""})
    assert "refused" in one_line_error(res)
    assert json.loads(cli("judges", "list", "--json").stdout)["result"] == []


@pytest.mark.parametrize("location", ["/etc/shadow", "/proc/self/environ", "http://2130706433/list.txt"])
def test_blacklists_add_refuses_forbidden_targets(cli, location):
    res = cli("blacklists", "add", "x", location, code=2, extra={"MAGPIE_ENRICH_ALLOW_PRIVATE": ""})
    assert "refused" in one_line_error(res)
    assert json.loads(cli("blacklists", "list", "--json").stdout)["sources"] == []


def test_never_probed_judge_lists_as_unknown(cli):
    cli("judges", "add", "http://judge.example/")
    [row] = json.loads(cli("judges", "list", "--json").stdout)["result"]
    assert row["health"] == "unknown" and row["healthy"] is None
    assert "unknown" in cli("judges", "list").output


def test_stale_expected_revision_is_a_refusal(cli, db):
    from magpie.db.repo import ensure_workspace

    ensure_workspace(db, "acme")
    rule = json.loads(cli("alerts", "rules", "create", "-w", "acme", "few", "--kind", "usable_routes",
                          "--threshold", "3", "--json").stdout)
    cli("alerts", "rules", "edit", str(rule["id"]), "--threshold", "4", "--expected-revision", "1")
    res = cli("alerts", "rules", "edit", str(rule["id"]), "--threshold", "5", "--expected-revision", "1", code=3)
    assert one_line_error(res).startswith("refused: revision_changed")


def test_queue_update_from_an_older_read_is_refused(cli, settings, tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("127.0.0.1:8080\n")
    cli("import", str(f), "-w", "alpha")
    q = RouteQueue.from_settings(get_settings())
    [h] = [m.decode().rsplit(":", 1)[-1] for m in q.r.scan_iter(match=q.keys.payload_prefix + "*")]
    old = json.loads(cli("queue", "inspect", h, "--json").stdout)["result"]
    assert old["payload_revision"] == payload_revision(q.payload(h))
    stale = q.payload(h)
    cli("import", str(f), "-w", "beta")  # the import merges workspace beta meanwhile
    merged = q.payload(h)
    res = cli("queue", "update", h, stale, "--expected-revision", old["payload_revision"], code=3)
    assert one_line_error(res) == f"refused: payload_changed: route {h}"
    assert q.payload(h) == merged


def test_check_now_after_the_lease_expired_is_not_refused(cli, settings, tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("127.0.0.1:8080\n")
    cli("import", str(f), "-w", "alpha")
    q = RouteQueue.from_settings(get_settings())
    for shard in q.keys.all_shards():
        for m in q.r.zrange(shard, 0, -1):
            q.r.zadd(shard, {m: 1000})
            q.r.zadd(q.keys.heads, {shard: 1000})
    [le] = q.pop(1, lease_ms=1)
    deadline_ms = q.server_time_ms() + 5000
    while q.status()["totals"]["leased"] and q.server_time_ms() < deadline_ms:
        time.sleep(0.005)  # the 1 ms lease expires on the Redis clock
    out = json.loads(cli("queue", "check-now", le.member, "--json").stdout)
    assert out["ok"] and q.score(le.member) is not None and not q.score(le.member).endswith(".50")
