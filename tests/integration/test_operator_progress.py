"""Long operator verbs report progress as they go, and obliterate asks before deleting."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from magpie.cli import main
from magpie.config import get_settings
from magpie.queue import Payload, RouteQueue
from magpie.base.routes import Route


@pytest.fixture
def cli(settings, db, monkeypatch):
    env = {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
           "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
           "PROXY_QUEUE_SHARDS": "4", "MAGPIE_CHECK_INTERVAL": "60"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    runner = CliRunner()

    def run(*args, code=0, input=None):
        res = runner.invoke(main, list(args), input=input, catch_exceptions=False)
        assert res.exit_code == code, res.output
        return res

    yield run
    get_settings.cache_clear()


def fill(n: int) -> RouteQueue:
    q = RouteQueue.from_settings(get_settings())
    items = [(f"{i:024x}", Payload(i, Route("http", "127.0.0.1", 1000 + i), f"{i:024x}", [1]).encode())
             for i in range(n)]
    q.schedule(items)
    return q


def test_obliterate_without_a_terminal_needs_yes(cli):
    q = fill(30)
    cli("queue", "pause")
    res = cli("queue", "obliterate", code=2)
    assert res.stderr.strip() == "Error: refusing to delete the whole schedule (30 routes) without " \
                                 "confirmation: pass --yes"
    assert q.route_count() == 30
    assert json.loads(cli("queue", "obliterate", "--yes", "--json").stdout)["result"]["deleted_routes"] == 30


def test_obliterate_asks_on_a_terminal(cli, monkeypatch):
    q = fill(5)
    cli("queue", "pause")
    monkeypatch.setattr("magpie.cli.progress.interactive", lambda: True)
    res = cli("queue", "obliterate", input="n\n", code=1)  # click's Abort
    assert "Delete the whole schedule (5 routes)?" in res.stderr and q.route_count() == 5
    cli("queue", "obliterate", input="y\n")
    assert q.route_count() == 0


def test_drain_and_respread_report_progress_per_batch():
    from magpie.maintenance.interval import respread_now

    q = fill(40)
    q.r.delete(q.keys.paused)
    seen = []
    respread_now(q, batch=8, progress=lambda done, total: seen.append((done, total)))
    assert len(seen) > 1 and seen == sorted(seen) and {t for _, t in seen} == {40}
    seen.clear()
    q.drain(batch=8, progress=lambda done, total: seen.append((done, total)))
    assert len(seen) > 1 and seen[-1] == (40, 40)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_rebuild_reports_progress_per_chunk(cli, tmp_path, db):
    from magpie.maintenance.rebuild import rebuild_schedule

    f = tmp_path / "l.txt"
    f.write_text("".join(f"127.0.0.1:{2000 + i}\n" for i in range(25)))
    cli("import", str(f), "-w", "alpha")
    seen = []
    out = rebuild_schedule(get_settings(), engine=db, chunk=10, progress=lambda d, t: seen.append((d, t)))
    assert out["routes"] == 25 and seen == [(10, 25), (20, 25), (25, 25)]


def test_progress_bar_draws_on_stderr_only_when_asked(capsys):
    from magpie.cli.progress import progress

    with progress("draining", enabled=False) as update:
        update(1, 2)
    assert capsys.readouterr() == ("", "")
