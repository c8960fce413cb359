"""Measure proxy-list source fetches per minute against a loopback site, the local PostgreSQL and Redis.

Creates a throwaway database, starts an aiohttp site on 127.0.0.1 serving ``--sources`` distinct lists of
``--routes`` proxies each (with an ``ETag``), adds one source per list and times passes of
:func:`magpie.sources.runner.run_due` (``--concurrency`` threads, every due source in one pass) until
every source was fetched and imported; then a second round, where every list answers ``304``; then, when
Playwright and Chromium are present, ``--browser-sources`` script-built pages rendered in Chromium. Prints
sources per minute of each. The database and the Redis keys are dropped afterwards.

    .venv/bin/python benchmarks/sources_bench.py [--sources 200] [--routes 100] [--concurrency 4]
        [--browser-sources 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
import uuid

import redis
import sqlalchemy as sa

os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only
from aiohttp import web  # noqa: E402

from magpie.config import load_settings  # noqa: E402
from magpie.db.migrate import upgrade  # noqa: E402
from magpie.queue import RouteQueue  # noqa: E402
from magpie.sources.runner import run_due  # noqa: E402
from magpie.sources.store import add_source  # noqa: E402

ADMIN = os.environ.get("MAGPIE_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/x").rsplit("/", 1)[0] + "/postgres"
REDIS = os.environ.get("MAGPIE_REDIS_URL", "redis://127.0.0.1:6379/15")


def start_site(routes: int):
    async def plain(request):
        n = int(request.match_info["n"])
        if request.headers.get("If-None-Match") == f'"{n}"':
            return web.Response(status=304)
        body = "".join(f"127.{50 + n // 250}.{n % 250}.{i % 250}:{1024 + i}\n" for i in range(routes))
        return web.Response(text=body, headers={"ETag": f'"{n}"'})

    async def js(request):
        n = int(request.match_info["n"])
        return web.Response(content_type="text/html", text=(
            f"<html><body><pre id=l></pre><script>var a=[];for(var i=0;i<{routes};i++)"
            f"a.push('127.200.{n % 250}.'+(i%250)+':'+(2000+i));"
            "document.getElementById('l').textContent=a.join('\\n');</script></body></html>"))

    async def robots(request):
        return web.Response(text="User-agent: *\nAllow: /\n")

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/list/{n}", plain)
    app.router.add_get("/js/{n}", js)
    app.router.add_get("/robots.txt", robots)
    runner = web.AppRunner(app, access_log=None)
    ready, box = threading.Event(), {}

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["port"] = site._server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(10)
    return f"http://127.0.0.1:{box['port']}"


def drain(s, engine, r, q, n: int) -> tuple[float, dict]:
    """Run passes until ``n`` sources were handled; seconds taken and summed counts."""
    total = {"ok": 0, "not_modified": 0, "error": 0, "imported": 0}
    t0 = time.perf_counter()
    handled = 0
    while handled < n:
        out = run_due(s, engine, r, q, limit=n)
        for k in total:
            total[k] += out[k]
        handled += out["claimed"]
        if out["claimed"] == 0:
            time.sleep(0.05)
    return time.perf_counter() - t0, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", type=int, default=200)
    ap.add_argument("--routes", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--browser-sources", type=int, default=10)
    a = ap.parse_args()
    name = f"magpie_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = ADMIN.rsplit("/", 1)[0] + "/" + name
    prefix = f"magpie-bench:{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(REDIS)
    try:
        upgrade(url)
        s = load_settings(database_url=url, redis_url=REDIS, redis_prefix=prefix,
                          encryption_key="bench-key-0123456789abcdef", check_allow_private="127.0.0.0/8",
                          source_allow_private="127.0.0.0/8", source_concurrency=a.concurrency)
        engine = sa.create_engine(url, pool_size=a.concurrency + 2)
        q = RouteQueue.from_settings(s, r)
        base = start_site(a.routes)
        for n in range(a.sources):
            add_source(engine, s, f"{base}/list/{n}", "bench", 3600)
        secs, got = drain(s, engine, r, q, a.sources)
        print(f"plain: {a.sources} sources x {a.routes} routes in {secs:.2f} s = {60 * a.sources / secs:,.0f} "
              f"sources/min (ok={got['ok']} error={got['error']} imported={got['imported']}, "
              f"concurrency {a.concurrency})")
        from magpie.sources.runner import source_schedule

        sched = source_schedule(s, r)
        for n in range(1, a.sources + 1):
            sched.enqueue_in(str(n), 0)
        secs, got = drain(s, engine, r, q, a.sources)
        print(f"304:   {a.sources} sources in {secs:.2f} s = {60 * a.sources / secs:,.0f} sources/min "
              f"(not_modified={got['not_modified']})")
        from magpie.sources.browser import close_browser_pool, unavailable

        why = unavailable(s.source_chromium)
        if why or a.browser_sources <= 0:
            print(f"browser: skipped ({why or 'no --browser-sources'})")
            return
        with engine.begin() as c:
            c.execute(sa.text("DELETE FROM list_sources"))
        for n in range(a.browser_sources):
            add_source(engine, s, f"{base}/js/{n}", "bench-js", 3600, browser=True)
        secs, got = drain(s, engine, r, q, a.browser_sources)
        close_browser_pool()
        print(f"browser: {a.browser_sources} sources in {secs:.2f} s = {60 * a.browser_sources / secs:,.0f} "
              f"sources/min (ok={got['ok']} error={got['error']} imported={got['imported']}, {s.source_browser_pages} pages at once)")
    finally:
        keys = list(r.scan_iter(match="*" + prefix + "*", count=10_000))
        for i in range(0, len(keys), 500):
            r.delete(*keys[i:i + 500])
        with admin.connect() as c:
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                      {"n": name})
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))


if __name__ == "__main__":
    main()
