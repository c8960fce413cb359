"""The dashboard in a real browser: Playwright drives Debian's Chromium against a real ``magpie web`` process.

Seeded data (routes, history, a dead letter, chart samples, an incident, deliveries); every page is visited
and saved as a screenshot in ``tests/browser/screenshots/``; operator actions are clicked with the token;
the browser may load nothing from outside loopback. Chromium must be installed
(``scripts/install_browser.sh``): without it these tests fail with that hint, they never skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from helpers import wait_until
from web_seed import (
    ROTATOR_INSTANCE,
    ROTATOR_PASSWORD,
    ROTATOR_USER,
    SECRET_PASSWORD,
    WEBHOOK_SECRET_PATH,
    seed,
)

pytestmark = pytest.mark.slow  # a real browser: the slow tier (the default drives the pages over HTTP)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = Path(__file__).parent / "screenshots"
TOKEN = "browser-token-0123456789abcdef"


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/install_browser.sh (Debian's chromium package)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def server(settings, db, redis_client, tmp_path):
    """A ``magpie web`` process on a free loopback port over seeded data: ``(base_url, seeded)``."""
    seeded = seed(settings, db, redis_client)
    env = dict(os.environ, MAGPIE_REDIS_URL=settings.redis_url, MAGPIE_REDIS_PREFIX=settings.redis_prefix,
               MAGPIE_DATABASE_URL=settings.database_url, PROXY_ENCRYPTION_KEY=settings.encryption_key,
               MAGPIE_WEB_TOKEN=TOKEN, MAGPIE_WEB_SAMPLE_INTERVAL="5")
    log = open(tmp_path / "web.log", "w+")  # noqa: SIM115 - closed after the process, in the finally
    proc = subprocess.Popen([sys.executable, "-m", "magpie", "web", "--host", "127.0.0.1", "--port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        if not m:
            log.seek(0)
            pytest.fail(f"magpie web did not start: {line!r} {log.read()[-2000:]}")
        base = f"http://127.0.0.1:{m.group(1)}"
        yield base, seeded
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def page(browser, server):
    outside: list[str] = []
    ctx = browser.new_context(viewport={"width": 1360, "height": 900})
    pg = ctx.new_page()

    def only_loopback(route):
        host = urlsplit(route.request.url).hostname or ""
        if route.request.url.startswith(("data:", "about:")) or host in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    pg.route("**/*", only_loopback)
    errors: list[str] = []
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    ctx.close()
    assert outside == [], f"the dashboard loaded from outside loopback: {outside}"
    assert errors == [], f"browser errors: {errors}"


def shot(page, name: str) -> None:
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def no_secret(page) -> None:
    html = page.content()
    for secret in (SECRET_PASSWORD, WEBHOOK_SECRET_PATH, TOKEN, ROTATOR_PASSWORD, ROTATOR_USER):
        assert secret not in html


def test_every_page_renders(page, server):
    base, seeded = server
    page.goto(base + "/")
    assert page.locator("h1").inner_text() == "Schedule"
    assert page.locator("#total-scheduled").inner_text() == "13"
    assert page.locator("#shards tbody tr").count() == 17  # 16 shards and the total
    assert page.locator("svg.chart polyline").count() >= 4  # every chart has a line from the samples
    no_secret(page)
    shot(page, "01-schedule")

    page.click("nav >> text=Dead letters")
    assert page.locator("#dead tbody tr").count() == 1
    assert "127.0.0.9:1090" in page.locator("#dead").inner_text()
    shot(page, "02-dead-letters")

    page.click("nav >> text=Routes")
    assert page.locator("#route-count").inner_text().startswith("14 route(s)")
    page.select_option("select[name=protocol]", "socks5")
    page.select_option("select[name=alive]", "yes")
    page.click("form.filters button")
    rows = page.locator("#routes tbody tr")
    assert rows.count() >= 1 and all("socks5" in rows.nth(i).inner_text() for i in range(rows.count()))
    page.goto(base + "/routes")
    no_secret(page)
    shot(page, "03-routes")

    page.goto(base + "/routes?" + "workspace=beta&max_latency_ms=400")
    assert page.locator("select[name=workspace]").input_value() == "beta"
    shot(page, "04-routes-filtered")

    page.goto(base + f"/routes/{seeded['with_password']}")
    assert "127.0.2.1:8888" in page.content() and "credentials stored, never shown" in page.content()
    assert page.locator("#history tbody tr").count() == 6
    assert page.locator("svg.chart polyline, svg.chart circle").count() >= 1
    no_secret(page)
    shot(page, "05-route")

    page.click("nav >> text=Alerts")
    assert "enough usable routes" in page.locator("#incidents").inner_text()
    assert page.locator("#deliveries tbody tr").count() == 2
    no_secret(page)
    shot(page, "06-alerts")

    page.click("nav >> text=Health")
    assert page.locator("#probes tbody tr").count() >= 5
    shot(page, "07-health")


def test_rotators_and_instances(page, server):
    base, _seeded = server
    page.goto(base + "/")
    assert page.locator("#rotators-serving").inner_text() == "1 / 4"
    assert page.locator("#live-instances").inner_text() == "1 beat · 1 rotator · 2 worker"

    page.click("#rotators-serving a")
    assert page.locator("h1").inner_text() == "Rotators"
    assert page.locator("#rotators tbody tr").count() == 4
    states = {page.locator("#rotators tbody tr").nth(i).get_attribute("data-rotator"):
              page.locator("#rotators tbody tr td.state .badge").nth(i).inner_text() for i in range(4)}
    assert states == {"front": "serving", "sticky-beta": "error", "stale": "not running", "spare": "unassigned"}
    assert "Address already in use" in page.locator("tr[data-rotator=sticky-beta]").inner_text()
    front = page.locator("tr[data-rotator=front]").inner_text()
    assert ROTATOR_INSTANCE in front and "yes" in front and "941.9 MiB" in front
    no_secret(page)
    shot(page, "11-rotators")

    page.click("nav >> text=Instances")
    assert page.locator("#instance-total").inner_text() == "4"
    assert page.locator("#instances-worker tbody tr").count() == 2
    assert "37 / 64" in page.locator("#instances-worker").inner_text()
    assert page.locator("#instances-rotator tbody tr").inner_text().count("front") == 1
    no_secret(page)
    shot(page, "12-instances")
    page.click(".rolebar >> text=beat")
    assert page.locator("table.instances").count() == 1 and page.locator("#instances-beat").count() == 1


def test_actions_with_the_token(page, server, settings, redis_client):
    from magpie.queue import RouteQueue

    base, seeded = server
    q = RouteQueue.from_settings(settings, redis_client)
    page.goto(base + "/")
    page.fill("form.action input.token", "not-the-token-at-all")
    page.click("button[data-action=pause]")
    assert "refused: the token does not match" in page.locator(".flash").inner_text()
    assert not q.is_paused()

    page.fill("form.action input.token", TOKEN)
    page.click("button[data-action=pause]")
    assert page.locator(".flash.ok").inner_text() == "paused" and q.is_paused()
    assert page.locator("#claiming").inner_text() == "paused"
    shot(page, "08-paused")
    page.click("button[data-action=resume]")  # the token is remembered for this tab
    assert page.locator(".flash.ok").inner_text() == "resumed" and not q.is_paused()

    page.goto(base + "/dead")
    page.click("button[data-action=reprocess]")
    assert "reprocessed" in page.locator(".flash.ok").inner_text()
    assert page.locator("p.empty").inner_text() == "No dead letters."
    assert q.inspect(seeded["dead"])["state"] == "due"
    shot(page, "09-reprocessed")

    h = seeded["alive"]
    q.enqueue_in(h, 3_600_000)
    page.goto(base + f"/routes/{h}")
    assert page.locator("#schedule .badge").inner_text() == "waiting"
    page.click("button[data-action=check-now]")
    assert page.locator(".flash.ok").inner_text().startswith(f"route {h} due")
    assert page.locator("#schedule .badge").inner_text() == "due" and q.inspect(h)["state"] == "due"
    shot(page, "10-checked-now")


def test_chart_sampler_runs_in_the_server(server, redis_client, settings):
    from magpie.observability.samples import read_samples

    before = len(read_samples(redis_client, settings.redis_prefix, 1000))
    def count() -> int:
        return len(read_samples(redis_client, settings.redis_prefix, 1000))

    wait_until(lambda: count() > before, timeout=15, interval=0.25, what="a chart sample")
