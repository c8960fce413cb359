"""The ``magpie`` command line against real Redis and PostgreSQL (and the lab for ``check``)."""

from __future__ import annotations

import json
import socket

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from magpie.cli import main
from magpie.config import get_settings

LIST = """\
# Free proxy list - updated hourly
Proxy list updated at 2026-11-29 10:00:00 UTC

127.0.0.1:3128
127.0.0.1:3128
socks5://user:p%40ss@127.0.0.2:1080
127.0.0.3:8080 US-N-S +
[::1]:8888
127.0.0.1:99999
ftp://127.0.0.1:21
127.0.0.4
Total: 4 proxies
"""


@pytest.fixture
def cli(settings, monkeypatch):
    env = {
        "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
        "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
        "PROXY_QUEUE_SHARDS": "4", "MAGPIE_CHECK_INTERVAL": "60",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    runner = CliRunner()

    def run(*args, code=0):
        res = runner.invoke(main, list(args), catch_exceptions=False)
        assert res.exit_code == code, res.output
        return res

    yield run
    get_settings.cache_clear()


def test_import_reports_counts_and_line_numbers(cli, db, tmp_path):
    f = tmp_path / "list.txt"
    f.write_text(LIST)
    out = json.loads(cli("import", str(f), "--workspace", "alpha", "--json").stdout)
    assert out["valid"] == 4 and out["imported"] == 4 and out["duplicates"] == 1
    assert out["skipped"] == 4  # comment, prose, blank, footer
    assert [(x["line"], x["reason"].split(" ")[0]) for x in out["invalid"]] == [(9, "bad"), (10, "unknown"),
                                                                               (11, "missing")]
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM routes")).scalar() == 4
        enc = c.execute(sa.text("SELECT password_enc FROM routes WHERE password_enc IS NOT NULL")).scalar()
    assert "p@ss" not in enc
    again = json.loads(cli("import", str(f), "-w", "alpha", "--json").stdout)
    assert again["imported"] == 0 and again["duplicates"] == 5
    other = json.loads(cli("import", str(f), "-w", "beta", "--json").stdout)
    assert other["imported"] == 4
    st = json.loads(cli("status", "--json").stdout)
    assert st["totals"]["scheduled"] == 4 and st["totals"]["leased"] == 0
    rows = json.loads(cli("routes", "--json").stdout)
    assert len(rows) == 4 and all(r["alive"] is None for r in rows)


def test_dry_run_stores_nothing(cli, db, tmp_path):
    f = tmp_path / "list.txt"
    f.write_text(LIST)
    out = json.loads(cli("import", str(f), "-w", "alpha", "--dry-run", "--json").stdout)
    assert out["valid"] == 4 and out["imported"] == 0
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM routes")).scalar() == 0
    assert json.loads(cli("status", "--json").stdout)["totals"]["scheduled"] == 0


GUARDED = """\
10.0.0.1:3128
127.0.0.1:3128
[fd00::1]:1080
socks5://u:p@169.254.169.254:1080
[2002:a9fe:a9fe::1]:80
localhost:8080
10.0.0.1:3128
proxy.example.net:3128 US
999.1.1.1:80
user:pa ss@127.0.0.5:80
"""


def test_import_refuses_private_routes_per_line_and_imports_the_rest(cli, db, tmp_path, monkeypatch):
    monkeypatch.setenv("MAGPIE_CHECK_ALLOW_PRIVATE", "127.0.0.0/8,::1")
    get_settings.cache_clear()
    f = tmp_path / "list.txt"
    f.write_text(GUARDED)
    dry = json.loads(cli("import", str(f), "-w", "alpha", "--dry-run", "--json").stdout)
    out = json.loads(cli("import", str(f), "-w", "alpha", "--json").stdout)
    assert {**dry, "imported": 3, "stored": 3, "scheduled": 3} == out  # a dry run reports the same lines
    assert (out["valid"], out["imported"], out["refused"], out["duplicates"]) == (3, 3, 5, 0)
    reasons = {x["line"]: x["reason"] for x in out["invalid"]}
    assert sorted(reasons) == [1, 3, 4, 5, 7, 9, 10]
    for line, what in [(1, "10.0.0.1 is private"), (3, "fd00::1 is unique-local"),
                       (4, "169.254.169.254 is link-local"),
                       (5, "2002:a9fe:a9fe::1 is an IPv6 form of link-local IPv4 169.254.169.254"),
                       (7, "10.0.0.1 is private")]:
        assert reasons[line] == f"refused by the egress guard: {what} (allow it with MAGPIE_CHECK_ALLOW_PRIVATE)"
    assert reasons[9].startswith("bad address") and reasons[10].startswith("credentials contain whitespace")
    with db.connect() as c:
        hosts = sorted(c.execute(sa.text("SELECT host FROM routes")).scalars())
    assert hosts == ["127.0.0.1", "localhost", "proxy.example.net"]
    text = cli("import", str(f), "-w", "beta")
    assert "invalid=7 (refused by the egress guard: 5)" in text.stdout
    assert "  line 5: refused by the egress guard: 2002:a9fe:a9fe::1 is an IPv6 form" in text.stderr
    assert "pa ss" not in text.output

    monkeypatch.setenv("MAGPIE_CHECK_ALLOW_PRIVATE", "10.0.0.0/8")  # the setting decides, nothing else
    # (an import dials nothing; without the suite's loopback-only list on top, so 10.0.0.1 passes; the
    # process's socket guard keeps loopback only)
    monkeypatch.delenv("MAGPIE_EGRESS_ONLY")
    get_settings.cache_clear()
    other = json.loads(cli("import", str(f), "-w", "gamma", "--dry-run", "--json").stdout)
    assert (other["valid"], other["duplicates"], other["refused"]) == (2, 1, 5)  # 10.0.0.1 (twice), the name
    assert {x["line"] for x in other["invalid"]} == {2, 3, 4, 5, 6, 9, 10}


def test_broken_config_value_is_named(cli, monkeypatch, tmp_path):
    monkeypatch.setenv("PROXY_QUEUE_SHARDS", "500")
    get_settings.cache_clear()
    res = cli("status", code=2)
    assert "PROXY_QUEUE_SHARDS" in res.output


def test_queue_verbs_and_typed_refusals(cli, db, tmp_path):
    f = tmp_path / "list.txt"
    f.write_text("127.0.0.1:3128\n127.0.0.1:3129\n")
    cli("import", str(f), "-w", "alpha")
    hashes = [r["route_hash"] for r in json.loads(cli("routes", "--json").stdout)]
    states = {h: json.loads(cli("queue", "inspect", h, "--json").stdout)["result"]["state"] for h in hashes}
    assert sorted(states.values()) == ["due", "waiting"]  # first due times spread over the interval
    h = next(h for h, st in states.items() if st == "waiting")
    assert json.loads(cli("queue", "check-now", h, "--json").stdout)["ok"]
    assert json.loads(cli("queue", "inspect", h, "--json").stdout)["result"]["state"] == "due"
    refused = json.loads(cli("queue", "obliterate", "--json", code=3).stdout)
    assert refused == {"ok": False, "refused": "not_paused", "member": None}
    cli("queue", "pause")
    assert json.loads(cli("status", "--json").stdout)["paused"] is True
    done = json.loads(cli("queue", "obliterate", "--yes", "--json").stdout)["result"]
    assert done == {"status": "done", "deleted_routes": 2}
    gone = json.loads(cli("queue", "reprocess", h, "--json", code=3).stdout)
    assert gone["refused"] == "not_dead"
    assert json.loads(cli("queue", "inspect", h, "--json", code=3).stdout)["refused"] == "gone"
    cli("queue", "update", h, "not json", "--expected-revision", "0" * 16, code=2)


def test_one_shot_check_needs_no_redis_or_postgres(tmp_path, monkeypatch):
    from magpie.lab.lab import start_free_lab

    monkeypatch.setenv("MAGPIE_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    monkeypatch.setenv("MAGPIE_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:1/none")
    get_settings.cache_clear()
    lab = start_free_lab(slow_delay=0.5)
    try:
        f = tmp_path / "lab.txt"
        lab.write_list(f)
        res = CliRunner().invoke(main, ["check", str(f), "--judge", lab.judge_url, "--timeout", "3", "--json"])
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout)
        by_route = {r["route"]: r for r in out["results"]}
        for p in lab.proxies:
            r = by_route[p.route.display()]
            assert r["alive"] == p.expect_alive and r["anonymity"] == p.expect_anonymity, (p.name, r)
    finally:
        lab.stop()
        get_settings.cache_clear()


def test_one_shot_check_spread_over_processes_gives_each_route_its_own_result_in_order(tmp_path):
    from magpie.lab.lab import start_free_lab

    lab = start_free_lab(slow_delay=0.5)
    try:
        f = tmp_path / "lab.txt"
        lab.write_list(f)
        args = ["check", str(f), "--judge", lab.judge_url, "--timeout", "3", "--json"]
        one = CliRunner().invoke(main, args + ["--processes", "1"])
        three = CliRunner().invoke(main, args + ["--processes", "3", "--concurrency", "2"])
    finally:
        lab.stop()
    assert one.exit_code == 0 and three.exit_code == 0, (one.output, three.output)
    a, b = json.loads(one.stdout)["results"], json.loads(three.stdout)["results"]
    assert len(a) == len(lab.proxies) >= 3
    assert [(r["route"], r["alive"], r["anonymity"]) for r in a] == [(r["route"], r["alive"], r["anonymity"]) for r in b]
    expected = {p.route.display(): p.expect_alive for p in lab.proxies}
    assert {r["route"]: r["alive"] for r in b} == expected


def test_one_shot_check_exits_nonzero_when_the_judge_is_unreachable(tmp_path):
    from magpie.lab.lab import start_free_lab

    lab = start_free_lab(slow_delay=0.5)
    try:
        f = tmp_path / "lab.txt"
        lab.write_list(f)
        with socket.socket() as held:  # bound, never listening: the judge's port refuses connections
            held.bind(("127.0.0.1", 0))
            judge = f"http://127.0.0.1:{held.getsockname()[1]}/"
            res = CliRunner().invoke(main, ["check", str(f), "--judge", judge, "--timeout", "2", "--json"])
    finally:
        lab.stop()
    assert res.exit_code == 1, res.output
    assert "does not answer a direct request" in res.stderr and res.stdout == ""


def test_queue_rebuild_after_redis_lost_the_schedule(cli, db, tmp_path, redis_client, redis_prefix):
    f = tmp_path / "list.txt"
    f.write_text("127.0.0.1:3128\nsocks5://u:p@127.0.0.1:1080\n")
    cli("import", str(f), "-w", "alpha")
    for k in list(redis_client.scan_iter(match=f"*{redis_prefix}*")):
        redis_client.delete(k)  # Redis lost this deployment's data
    assert json.loads(cli("status", "--json").stdout)["totals"]["scheduled"] == 0
    out = json.loads(cli("queue", "rebuild", "--json").stdout)
    assert out["ok"]
    assert json.loads(cli("status", "--json").stdout)["totals"]["scheduled"] == 2


def test_tables_print_user_text_literally(cli, db, tmp_path, monkeypatch):
    """Credentials and hosts are data, not rich markup: '[/x]' or '[fe80::1]' must not break a table."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("MAGPIE_CHECK_ALLOW_PRIVATE", "127.0.0.0/8,fe80::/10")  # a link-local route on purpose
    monkeypatch.delenv("MAGPIE_EGRESS_ONLY")  # import and listing dial nothing; the socket guard stays
    get_settings.cache_clear()
    f = tmp_path / "list.txt"
    f.write_text("http://%5B%2Fx%5D:p@127.0.0.1:7001\n[fe80::1]:80\n")
    cli("import", str(f), "-w", "alpha")
    out = cli("routes").stdout
    assert "[/x]@127.0.0.1:7001" in out and "[fe80::1]:80" in out


def test_changing_shard_count_is_refused(cli, db, tmp_path, monkeypatch):
    f = tmp_path / "list.txt"
    f.write_text("127.0.0.1:3128\n127.0.0.1:3129\n")
    cli("import", str(f), "-w", "alpha")
    monkeypatch.setenv("PROXY_QUEUE_SHARDS", "8")
    get_settings.cache_clear()
    res = cli("status", code=3)
    assert "layout_mismatch" in res.output and "PROXY_QUEUE_SHARDS=8" in res.output
    refused = json.loads(cli("status", "--json", code=3).stdout)
    assert refused == {"ok": False, "refused": "layout_mismatch", "member": None}
    monkeypatch.setenv("PROXY_QUEUE_SHARDS", "4")
    get_settings.cache_clear()
    assert json.loads(cli("status", "--json").stdout)["totals"]["scheduled"] == 2


def test_unreachable_storage_is_one_line_and_exit_status_2(cli, monkeypatch):
    monkeypatch.setenv("MAGPIE_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    monkeypatch.setenv("MAGPIE_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:1/none")
    get_settings.cache_clear()
    res = cli("status", "--json", code=2)
    assert res.stdout == "" and res.stderr.startswith("Error: Redis error (MAGPIE_REDIS_URL)")
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = cli("routes", code=2)
    assert res.stderr.startswith("Error: cannot reach PostgreSQL (MAGPIE_DATABASE_URL)"), res.stderr


def test_lab_with_a_taken_port_names_it_and_exits_2(tmp_path):
    from magpie.lab import find_free_base_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = CliRunner().invoke(main, ["lab", "--base-port", str(find_free_base_port()), "--judge-port",
                                        str(port)])
    assert res.exit_code == 2, res.output
    assert f"127.0.0.1:{port}" in res.stderr and "Traceback" not in res.output


def test_lab_hints_at_the_loopback_allowance_only_when_it_is_missing(monkeypatch):
    from magpie.cli.lab import LOOPBACK_HINT, _needs_loopback_hint

    assert "MAGPIE_CHECK_ALLOW_PRIVATE=127.0.0.0/8" in LOOPBACK_HINT
    lab_hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.9"]
    for value, hint in [("false", True), ("127.0.0.1/32", True), ("127.0.0.0/8", False), ("true", False)]:
        monkeypatch.setenv("MAGPIE_CHECK_ALLOW_PRIVATE", value)
        assert _needs_loopback_hint(lab_hosts) is hint, value


def test_one_shot_check_names_the_setting_that_refuses_the_judge(tmp_path, monkeypatch):
    f = tmp_path / "list.txt"
    f.write_text("127.0.0.2:8080\n")
    monkeypatch.setenv("MAGPIE_CHECK_ALLOW_PRIVATE", "false")
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(main, ["check", str(f), "--judge", "http://127.0.0.1:9/"])
        assert res.exit_code == 2 and "MAGPIE_CHECK_ALLOW_PRIVATE" in res.stderr, res.output
        monkeypatch.setenv("MAGPIE_JUDGE_URL", "notaurl")
        get_settings.cache_clear()
        res = CliRunner().invoke(main, ["check", str(f)])
        assert res.exit_code == 2 and "MAGPIE_JUDGE_URL" in res.stderr and "--judge" not in res.stderr
    finally:
        get_settings.cache_clear()
