"""Proxy-list sources against real PostgreSQL and Redis and loopback sites (aiohttp): plain lists,
conditional GET, robots.txt, the time and size bounds, a redirect to a forbidden address (refused before
any dial), Basic credentials kept out of every output, backoff and dead-lettering, the schedule, the
``magpie sources`` verbs and ``magpie stats list-sources``; a script-built page in Chromium (slow tier)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import sqlalchemy as sa
from aiohttp import web
from click.testing import CliRunner

from magpie.base import egress
from magpie.cli import main
from magpie.config import get_settings
from magpie.queue import RouteQueue
from magpie.sources.runner import refresh_now, run_due, source_schedule, sync_schedule
from magpie.sources.store import add_source, list_sources, remove_source, source_stats

LIST = b"127.0.50.1:8080\n127.0.50.2:3128\n# comment\n127.0.50.3:99999\n"


class Site:
    """A loopback aiohttp site on its own event loop thread; ``hits`` counts requests per path."""

    def __init__(self):
        self.hits: dict[str, int] = {}
        self.robots = "User-agent: *\nDisallow: /private\n"
        self.fail = False
        self.loop = asyncio.new_event_loop()
        self.app = web.Application()
        self.app.router.add_get("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(self.app)
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.hits[path] = self.hits.get(path, 0) + 1
        if path == "/robots.txt":
            return web.Response(text=self.robots)
        if path in ("/list.txt", "/private/list.txt"):
            if request.headers.get("If-None-Match") == '"v1"':
                return web.Response(status=304)
            return web.Response(body=LIST, headers={"ETag": '"v1"', "Content-Type": "text/plain"})
        if path == "/flaky.txt":
            return web.Response(status=500) if self.fail else web.Response(body=LIST)
        if path == "/slow.txt":
            resp = web.StreamResponse()
            await resp.prepare(request)
            try:
                for _ in range(100):  # a byte every 0.1 s: each read is quick, the whole is not
                    await resp.write(b"1")
                    await asyncio.sleep(0.1)
            except ConnectionError:
                pass  # the fetcher gave up: what the test wants
            return resp
        if path == "/huge.txt":
            return web.Response(body=b"127.0.0.1:80\n" * 100_000)
        if path == "/to-private":
            raise web.HTTPFound("http://10.0.0.1:8080/list.txt")
        if path.startswith("/paged/"):
            n = int(path.rsplit("/", 1)[1])
            lines = f"127.0.52.{n}:8080\n"
            if n == 1:  # an HTTP Link header names the next page
                return web.Response(text=lines, headers={"Link": '</paged/2>; rel="next", </paged/1>; rel="first"'})
            if n < 5:  # an HTML anchor does; the last page links back to the first
                nxt = n + 1 if n < 4 else 1
                return web.Response(content_type="text/html", text=(
                    f"<html><body><pre>\n{lines}</pre><a class=x rel='next' href='/paged/{nxt}'>more</a>"
                    "</body></html>"))
        if path == "/hop":
            raise web.HTTPFound("/list.txt")
        if path == "/auth.txt":
            if request.headers.get("Authorization") != "Basic dXNlcjpzM2NyZXQtcHc=":  # user:s3cret-pw
                return web.Response(status=401)
            return web.Response(body=LIST)
        if path == "/js.html":
            return web.Response(content_type="text/html", text=(
                "<html><body><pre id=l></pre><script>"
                "var a=[]; for (var i=1;i<=3;i++) a.push('127.0.51.'+i+':1080');"
                "document.getElementById('l').textContent=a.join('\\n');</script></body></html>"))
        return web.Response(status=404)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def site():
    s = Site()
    yield s
    s.close()


@pytest.fixture
def s(settings, pg_url):
    return settings.model_copy(update={"source_allow_private": "127.0.0.0/8", "source_backoff_base": 0.01,
                                       "source_backoff_cap": 0.01, "source_fetch_timeout": 5.0,
                                       "source_dead_letter_after": 3})


@pytest.fixture
def q(s, redis_client):
    return RouteQueue.from_settings(s, redis_client)


def _refresh(s, db, redis_client, q, sid):
    return refresh_now(s, db, redis_client, sid, route_queue=q, wait=10)


def test_plain_list_is_imported_linked_and_then_not_modified(s, db, redis_client, q, site):
    src = add_source(db, s, f"{site.url}/list.txt", "alpha", 3600)
    res = _refresh(s, db, redis_client, q, src["id"])
    assert res["status"] == "ok" and (res["valid"], res["imported"]) == (2, 2)
    assert q.route_count() == 2  # the routes are on the check schedule
    row = list_sources(db)[0]
    assert (row["last_status"], row["last_imported"], row["last_invalid"], row["conditional"]) == ("ok", 2, 1, True)
    with db.begin() as c:
        rid = c.execute(sa.text("SELECT route_id FROM list_source_routes ORDER BY route_id LIMIT 1")).scalar_one()
        c.execute(sa.text("INSERT INTO route_health (route_id, last_checked_at, alive) VALUES (:r, now(), true)"),
                  {"r": rid})
    st = source_stats(db)[0]
    assert (st["routes"], st["alive"], st["alive_pct"]) == (2, 1, 50.0)
    # conditional GET: the validator goes back, 304 imports nothing
    again = _refresh(s, db, redis_client, q, src["id"])
    assert again["status"] == "not_modified"
    assert list_sources(db)[0]["last_status"] == "not_modified"
    # the completed lease put the source an `every` ahead: nothing due now
    assert run_due(s, db, redis_client, q)["claimed"] == 0


def test_paged_lists_are_followed_up_to_the_bound(s, db, redis_client, q, site):
    src = add_source(db, s, f"{site.url}/paged/1", "alpha", 3600)
    res = _refresh(s, db, redis_client, q, src["id"])
    assert (res["status"], res["pages"], res["valid"]) == ("ok", 4, 4)  # page 4 links back to 1: the walk ends
    bounded = s.model_copy(update={"source_max_pages": 2})
    other = add_source(db, s, f"{site.url}/paged/1", "beta", 3600)
    res = refresh_now(bounded, db, redis_client, other["id"], route_queue=q, wait=10)
    assert (res["status"], res["pages"], res["valid"]) == ("ok", 2, 2)


def test_robots_txt_is_obeyed_unless_ignored(s, db, redis_client, q, site):
    src = add_source(db, s, f"{site.url}/private/list.txt", "alpha", 3600)
    res = _refresh(s, db, redis_client, q, src["id"])
    assert res["status"] == "error" and "disallowed by robots.txt" in res["error"]
    assert "--ignore-robots" in res["error"]
    add_source(db, s, f"{site.url}/private/list.txt", "alpha", 3600, ignore_robots=True)
    assert _refresh(s, db, redis_client, q, src["id"])["status"] == "ok"


def test_time_and_size_bounds(s, db, redis_client, q, site):
    slow = add_source(db, s, f"{site.url}/slow.txt", "alpha", 3600)
    quick = s.model_copy(update={"source_fetch_timeout": 0.6})
    res = refresh_now(quick, db, redis_client, slow["id"], route_queue=q, wait=10)
    assert res["status"] == "error" and "time bound of 0.6 s" in res["error"]
    remove_source(db, slow["id"])
    huge = add_source(db, s, f"{site.url}/huge.txt", "alpha", 3600)
    small = s.model_copy(update={"source_max_bytes": 64 * 1024})
    res = refresh_now(small, db, redis_client, huge["id"], route_queue=q, wait=10)
    assert res["status"] == "error" and "larger than 65536 bytes" in res["error"]
    assert q.route_count() == 0


def test_a_redirect_to_a_forbidden_address_is_refused_before_any_dial(s, db, redis_client, q, site):
    before = [a for _e, a in egress.blocked_dials()]
    src = add_source(db, s, f"{site.url}/to-private", "alpha", 3600)
    res = _refresh(s, db, redis_client, q, src["id"])
    assert res["status"] == "error"
    assert res["error"].startswith("redirect to http://10.0.0.1:8080/list.txt refused")
    assert "\n" not in res["error"] and "MAGPIE_SOURCE_ALLOW_PRIVATE" in res["error"]
    assert list_sources(db)[0]["last_error"] == res["error"]
    # the socket guard (MAGPIE_EGRESS_ONLY) saw no attempt: the source guard refused before connecting
    assert [a for _e, a in egress.blocked_dials()] == before
    hop = add_source(db, s, f"{site.url}/hop", "alpha", 3600)
    assert _refresh(s, db, redis_client, q, hop["id"])["status"] == "ok"  # an allowed redirect is followed


def test_url_credentials_are_sent_and_never_shown(s, db, redis_client, q, site):
    src = add_source(db, s, f"http://user:s3cret-pw@127.0.0.1:{site.port}/auth.txt?api_key=tok-123456", "alpha",
                     3600)
    assert src["url"] == f"http://***@127.0.0.1:{site.port}/auth.txt?api_key=***"
    assert _refresh(s, db, redis_client, q, src["id"])["status"] == "ok"
    with db.connect() as c:
        stored = json.dumps([list(r) for r in c.execute(sa.text("SELECT * FROM list_sources")).all()], default=str)
    assert "s3cret-pw" not in stored and "tok-123456" not in stored
    assert "s3cret-pw" not in json.dumps(list_sources(db), default=str)


def test_failures_back_off_then_dead_letter_and_refresh_brings_it_back(s, db, redis_client, q, site):
    site.fail = True
    try:
        src = add_source(db, s, f"{site.url}/flaky.txt", "alpha", 3600)
        sched = source_schedule(s, redis_client)
        outcomes = [_refresh(s, db, redis_client, q, src["id"])["status"] for _ in range(2)]
        assert outcomes == ["error", "error"]
        row = list_sources(db)[0]
        assert row["consecutive_failures"] == 2 and "HTTP 500" in row["last_error"]
        assert sched.score(str(src["id"])).endswith(".25")  # a backoff retry, not an ordinary due time
        # the third failure in a row (MAGPIE_SOURCE_DEAD_LETTER_AFTER=3) is retried no more
        from tests.helpers import wait_until

        # the backoff retry comes due by itself; the pass that fails it again dead-letters it
        wait_until(lambda: run_due(s, db, redis_client, q)["dead_lettered"] == 1, timeout=10)
        row = list_sources(db)[0]
        assert row["dead_lettered"] and row["dead_lettered_at"] is not None
        assert sched.score(str(src["id"])) is None
        sync_schedule(db, sched)
        assert sched.score(str(src["id"])) is None  # a sync does not bring a dead letter back
    finally:
        site.fail = False
    res = _refresh(s, db, redis_client, q, src["id"])  # the operator's refresh does
    assert res["status"] == "ok"
    row = list_sources(db)[0]
    assert not row["dead_lettered"] and row["consecutive_failures"] == 0


@pytest.fixture
def cli(s, monkeypatch):
    env = {"MAGPIE_REDIS_URL": s.redis_url, "MAGPIE_REDIS_PREFIX": s.redis_prefix,
           "MAGPIE_DATABASE_URL": s.database_url, "PROXY_ENCRYPTION_KEY": s.encryption_key,
           "MAGPIE_SOURCE_ALLOW_PRIVATE": "127.0.0.0/8", "MAGPIE_SOURCE_FETCH_TIMEOUT": "5"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    runner = CliRunner()

    def run(*args, code=0, env=None):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        get_settings.cache_clear()
        res = runner.invoke(main, list(args), catch_exceptions=False)
        for k in env or {}:
            monkeypatch.delenv(k)
        get_settings.cache_clear()
        assert res.exit_code == code, res.output
        return res

    yield run
    get_settings.cache_clear()


def test_sources_commands(cli, db, site):
    out = json.loads(cli("sources", "add", f"http://u:pw-secret@127.0.0.1:{site.port}/list.txt", "-w", "alpha",
                         "--every", "6h", "--json").stdout)
    sid = out["source"]["id"]
    assert out["source"]["every"] == "6h" and "pw-secret" not in json.dumps(out)
    assert "bad period" in cli("sources", "add", f"{site.url}/x", "-w", "a", "--every", "often", code=2).output
    assert "outside 1m .. 30d" in cli("sources", "add", f"{site.url}/x", "-w", "a", "--every", "5s", code=2).output
    assert "http:// or https://" in cli("sources", "add", "ftp://127.0.0.1/x", "-w", "a", code=2).output
    refused = cli("sources", "add", "http://10.0.0.1/x", "-w", "a", code=2).output
    assert "10.0.0.1 is private" in refused and len(refused.strip().splitlines()) == 1
    assert "source %d: ok: 2 routes, 2 new" % sid in cli("sources", "refresh", str(sid)).stdout
    listed = json.loads(cli("sources", "list", "--json").stdout)["sources"]
    assert listed[0]["last_status"] == "ok" and listed[0]["last_fetch_at"]
    table = cli("sources", "list").stdout
    assert "alpha" in table and "pw-secret" not in table and "***@127.0.0.1" in table
    stats = json.loads(cli("stats", "list-sources", "--json").stdout)
    assert [(r["id"], r["routes"], r["alive"]) for r in stats] == [(sid, 2, 0)]
    assert "proxy-list source statistics" in cli("stats", "list-sources").stdout
    missing = cli("sources", "add", f"{site.url}/js.html", "-w", "alpha", "--browser", code=2,
                  env={"MAGPIE_SOURCE_CHROMIUM": "/nonexistent/chromium"}).output
    assert "--browser needs Chromium at /nonexistent/chromium" in missing and len(missing.strip().splitlines()) == 1
    assert "no source 999" in cli("sources", "refresh", "999", code=2).output
    cli("sources", "remove", str(sid))
    assert "no source" in cli("sources", "remove", str(sid), code=2).output
    assert json.loads(cli("sources", "list", "--json").stdout) == {"sources": []}


@pytest.mark.slow
def test_a_script_built_list_is_rendered_in_chromium(s, db, redis_client, q, site):
    from magpie.sources.browser import close_browser_pool, unavailable

    why = unavailable(s.source_chromium)
    if why:
        pytest.skip(why)
    src = add_source(db, s, f"{site.url}/js.html", "alpha", 3600, browser=True)
    plain = _refresh(s, db, redis_client, q, add_source(db, s, f"{site.url}/js.html", "beta", 3600)["id"])
    assert plain.get("valid", 0) == 0  # without rendering, the page holds no list
    try:
        res = refresh_now(s, db, redis_client, src["id"], route_queue=q, wait=30)
    finally:
        close_browser_pool()
    assert res["status"] == "ok" and res["valid"] == 3, res


def test_the_beat_task_claims_due_sources_and_fetches_them(s, db, redis_client, q, site, monkeypatch):
    from magpie.wiring import runtime, tasks

    s = s.model_copy(update={"source_backoff_base": 60.0, "source_backoff_cap": 60.0})
    for name, value in (("settings", s), ("engine", db), ("redis_client", redis_client), ("route_queue", q)):
        monkeypatch.setattr(runtime, name, lambda v=value: v)
    add_source(db, s, f"{site.url}/list.txt", "alpha", 3600)
    add_source(db, s, f"{site.url}/nope.txt", "alpha", 3600)
    out = tasks.maintenance_fetch_sources()
    assert (out["claimed"], out["ok"], out["error"], out["imported"]) == (2, 1, 1, 2)
    assert tasks.maintenance_fetch_sources()["claimed"] == 0  # nothing due: one every, one backoff, ahead


@pytest.mark.slow
def test_the_source_schedule_and_the_route_schedule_on_a_redis_cluster(s, db, redis_cluster, cluster_client,
                                                                       cluster_prefix, site):
    """The source schedule (tag ``{sources}``) and the check schedule (``{default}``) live on different
    slots of a cluster; a source fetch completes its own lease and imports into the other schedule."""
    from magpie.lab.cluster import key_slot
    from magpie.sources.runner import schedule_keys

    cs = s.model_copy(update={"redis_url": redis_cluster.url, "redis_prefix": cluster_prefix})
    cq = RouteQueue.from_settings(cs, cluster_client)
    assert key_slot(schedule_keys(cs).heads) != key_slot(cq.keys.heads)
    src = add_source(db, cs, f"{site.url}/list.txt", "alpha", 3600)
    res = refresh_now(cs, db, cluster_client, src["id"], route_queue=cq, wait=10)
    assert res["status"] == "ok" and res["imported"] == 2
    assert cq.route_count() == 2
    assert refresh_now(cs, db, cluster_client, src["id"], route_queue=cq, wait=10)["status"] == "not_modified"
    assert run_due(cs, db, cluster_client, cq)["claimed"] == 0
