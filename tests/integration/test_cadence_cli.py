"""``magpie queue set-interval``, ``magpie workspaces set-interval`` and ``magpie profiles set --interval`` on
the command line: the route's next due follows its own interval, the workspace's routes move into theirs, a
profile's cadence wins over the workspace's, the PostgreSQL schedule refuses profile cadences with nothing
written, bad input is one line."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from magpie.cli import main
from magpie.config import get_settings
from magpie.queue import RouteQueue
from magpie.maintenance.rebuild import rebuild_schedule
from magpie.queue.cadence import profile_cadence, route_cadence, workspace_cadence


@pytest.fixture
def cli(settings, db, monkeypatch):
    env = {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
           "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
           "PROXY_QUEUE_SHARDS": "4", "MAGPIE_CHECK_INTERVAL": "600"}
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


def test_cli_route_and_workspace_intervals_move_due_times(cli, tmp_path, db):
    f = tmp_path / "p.txt"
    f.write_text("".join(f"127.0.0.1:{2000 + i}\n" for i in range(20)))
    cli("import", str(f), "-w", "fast")
    with db.connect() as c:
        hashes = [h.strip() for h in c.execute(sa.text("SELECT route_hash FROM routes")).scalars()]
    q = RouteQueue.from_settings(get_settings())
    now = q.server_time_ms()
    out = json.loads(cli("workspaces", "set-interval", "fast", "30s", "--dead-after", "3", "--json").stdout)
    assert out["result"]["routes"] == 20
    assert workspace_cadence(q, _ws_id(db, "fast")) == {"interval_ms": 30_000, "dead_after": 3,
                                                                "dead_factor": 4}
    assert all(float(q.score(h)) <= now + 31_000 for h in hashes)
    assert route_cadence(q, hashes[0])["policy"] == "3:4"
    res = json.loads(cli("queue", "set-interval", hashes[0], "2m", "--json").stdout)["result"]
    assert res["interval_ms"] == 120_000
    cli("queue", "set-interval", hashes[0], "--clear")
    assert route_cadence(q, hashes[0])["interval_ms"] == 30_000  # back to the workspace's
    cli("workspaces", "set-interval", "fast", "--clear")
    assert route_cadence(q, hashes[0]) == {"interval_ms": None, "override_ms": None, "policy": None,
                                           "dead_streak": 0}
    bad = cli("queue", "set-interval", hashes[0], "soon", code=2)
    assert "duration" in bad.output and len(bad.output.strip().splitlines()) == 1
    cli("queue", "set-interval", hashes[0], code=2)  # neither INTERVAL nor --clear


def _ws_id(db, name):
    with db.connect() as c:
        return c.execute(sa.text("SELECT id FROM workspaces WHERE name = :n"), {"n": name}).scalar()


def test_cli_profile_interval_and_dead_policy(cli, tmp_path, db, settings):
    f = tmp_path / "p.txt"
    f.write_text("".join(f"127.0.0.1:{3000 + i}\n" for i in range(12)))
    cli("import", str(f), "-w", "prof")
    cli("import", str(f), "-w", "slow")  # the same routes in a second workspace with no cadence
    with db.connect() as c:
        hashes = [h.strip() for h in c.execute(sa.text("SELECT route_hash FROM routes")).scalars()]
    q = RouteQueue.from_settings(get_settings())
    wid = _ws_id(db, "prof")
    cli("workspaces", "set-interval", "prof", "2m")
    now = q.server_time_ms()
    out = json.loads(cli("profiles", "set", "prof", "--interval", "45s", "--dead-after", "3", "--json").stdout)
    prof = out["result"]
    assert (prof["check_interval"], prof["dead_after"], prof["dead_factor"]) == (45.0, 3, 4)
    assert prof["walk"]["routes"] == 12
    assert profile_cadence(q, wid) == {"interval_ms": 45_000, "dead_after": 3, "dead_factor": 4}
    assert all(float(q.score(h)) <= now + 46_000 for h in hashes)
    assert route_cadence(q, hashes[0])["interval_ms"] == 45_000  # the profile beats the workspace's 2 m
    assert route_cadence(q, hashes[0])["policy"] == "3:4"
    shown = json.loads(cli("profiles", "show", "prof", "--json").stdout)["result"]
    assert shown["check_interval"] == 45.0 and shown["dead_factor"] == 4
    # Redis lost the cadences and the routes: a rebuild brings the profile's back from PostgreSQL
    q.r.delete(*q.r.scan_iter(match=settings.redis_prefix + "*"))
    res = rebuild_schedule(get_settings(), engine=db, queue=q, lock=False)
    assert res["profile_cadences"] == 1 and res["new"] == 12
    assert route_cadence(q, hashes[0])["interval_ms"] == 45_000
    cli("profiles", "set", "prof", "--reset", "check_interval", "--reset", "dead_after")
    assert profile_cadence(q, wid) is None
    assert route_cadence(q, hashes[0])["interval_ms"] is None  # the workspace's 2 m was in Redis only
    bad = cli("profiles", "set", "prof", "--dead-factor", "5", code=2)
    assert "dead_factor needs dead_after" in bad.output and len(bad.output.strip().splitlines()) == 1
    bad = cli("profiles", "set", "prof", "--interval", "soon", code=2)
    assert "duration" in bad.output


def test_cli_profile_cadence_is_refused_by_the_postgresql_schedule(cli, db, monkeypatch, settings):
    with db.begin() as c:
        c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('pgprof')"))
    monkeypatch.setenv("MAGPIE_SCHEDULE_URL", settings.database_url)
    get_settings.cache_clear()
    res = cli("profiles", "set", "pgprof", "--interval", "60s", code=3)  # refused
    assert "postgresql" in res.output and len(res.output.strip().splitlines()) == 1
    with db.connect() as c:  # nothing written
        assert c.execute(sa.text("SELECT count(*) FROM check_profiles")).scalar() == 0
    cli("profiles", "set", "pgprof", "--timeout", "5")  # the other fields still work there
