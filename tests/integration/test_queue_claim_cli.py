"""``magpie queue claim | heartbeat | complete | in-flight`` on both schedule providers (real Redis and
PostgreSQL, the command line in process)."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from helpers import elapse

from magpie.cli import main
from magpie.config import get_settings


@pytest.fixture(params=["redis", "postgresql"])
def cli(request, settings, db, monkeypatch):
    env = {
        "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
        "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
        "PROXY_QUEUE_SHARDS": "4", "MAGPIE_CHECK_INTERVAL": "60", "MAGPIE_LEASE_SECONDS": "120", "MAGPIE_RENEW_BELOW_SECONDS": "30",
        "MAGPIE_SCHEDULE_URL": settings.redis_url if request.param == "redis" else settings.database_url,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    runner = CliRunner()

    def run(*args, code=0):
        res = runner.invoke(main, list(args), catch_exceptions=False)
        assert res.exit_code == code, (res.output, res.stderr)
        return res

    yield run
    get_settings.cache_clear()


def test_claim_heartbeat_complete_and_refusals(cli, tmp_path):
    f = tmp_path / "list.txt"
    f.write_text("socks5://user:s3cret@127.0.0.1:1080\n127.0.0.2:3128\n")
    cli("import", str(f), "--workspace", "alpha")
    res = cli("queue", "claim", "--json")
    lease = json.loads(res.stdout)["result"]
    assert "s3cret" not in res.stdout  # credentials masked
    assert 119 <= lease["expires_in_s"] <= 120 and not lease["stalled"]
    # the second route is due half an interval later: nothing claimable now
    empty = cli("queue", "claim", "--json", code=3)
    assert json.loads(empty.stdout) == {"ok": False, "refused": "empty", "member": None}

    elapse(0.05)  # the behaviour: the renewed lease ends at a later server millisecond than the first
    renewed = cli("queue", "heartbeat", lease["token"]).stdout.strip()
    assert renewed != lease["token"] and renewed.split(":")[0] == lease["member"]
    stale = cli("queue", "heartbeat", lease["token"], "--json", code=3)
    assert json.loads(stale.stdout)["refused"] == "lease_lost"

    rows = json.loads(cli("queue", "in-flight", "--json").stdout)["result"]
    assert [r["member"] for r in rows] == [lease["member"]]
    assert 0 <= rows[0]["silent_seconds"] < 5 and rows[0]["expires_in_s"] > 110

    assert cli("queue", "complete", renewed).stdout.strip() == "completed"
    assert json.loads(cli("queue", "complete", renewed, "--json", code=3).stdout)["refused"] == "lease_lost"
    assert json.loads(cli("queue", "in-flight", "--json").stdout)["result"] == []
    info = json.loads(cli("queue", "inspect", lease["member"], "--json").stdout)["result"]
    assert info["state"] == "waiting"


def test_claim_wait_polls_until_the_deadline_then_exits_3(cli):
    t0 = time.monotonic()
    cli("queue", "claim", "--wait", "0.6", code=3)
    assert time.monotonic() - t0 >= 0.6


def test_claim_wait_returns_a_route_that_becomes_due(cli, tmp_path):
    f = tmp_path / "list.txt"
    f.write_text("127.0.0.2:3128\n127.0.0.3:3128\n")
    cli("import", str(f), "--workspace", "alpha")
    first = cli("queue", "claim").stdout.strip().split(":")[0]
    cli("queue", "check-now", first, code=3)  # leased: refused
    other = next(h for h in _members() if h != first)
    cli("queue", "check-now", other, "--in", "0.4")
    t0 = time.monotonic()
    got = json.loads(cli("queue", "claim", "--wait", "10", "--json").stdout)["result"]
    assert got["member"] == other and 0.3 <= time.monotonic() - t0 < 5


def test_a_malformed_token_is_an_error_not_a_refusal(cli):
    res = cli("queue", "complete", "not-a-token", code=2)
    assert "lease token" in res.output + res.stderr



def _members() -> list[str]:
    """Route hashes PostgreSQL knows, in import order."""
    import sqlalchemy as sa

    from magpie.db.session import get_engine

    with get_engine(get_settings().database_url).connect() as c:
        return [r[0] for r in c.execute(sa.text("SELECT route_hash FROM routes ORDER BY id"))]


def test_migrate_payloads_is_refused_in_one_line_on_the_postgresql_schedule(cli, request, tmp_path):
    f = tmp_path / "list.txt"
    f.write_text("socks5://user:s3cret@127.0.0.1:1080\n")
    cli("import", str(f), "--workspace", "alpha")
    if request.node.callspec.params["cli"] == "redis":
        assert json.loads(cli("queue", "migrate-payloads", "--encrypt", "--json").stdout)["result"]["changed"] == 1
        return
    res = cli("queue", "migrate-payloads", "--encrypt", code=3)
    (line,) = [ln for ln in res.output.splitlines() if ln.startswith("refused")]
    assert "unsupported" in line and "Redis schedule only" in line and "s3cret" not in res.output
