"""``magpie queue set-interval`` and ``magpie workspaces set-interval`` on the command line: the route's next
due follows its own interval, the workspace's routes move into theirs, bad input is one line."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from magpie.cli import main
from magpie.config import get_settings
from magpie.queue import RouteQueue
from magpie.queue.cadence import route_cadence, workspace_cadence


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
