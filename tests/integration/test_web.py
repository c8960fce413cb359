"""The dashboard's JSON API and pages against real Redis and PostgreSQL: reads, token checks, refusals."""

from __future__ import annotations

import json
import re

import pytest
from browser.web_seed import (
    ROTATOR_INSTANCE,
    ROTATOR_PASSWORD,
    ROTATOR_USER,
    SECRET_PASSWORD,
    WEBHOOK_SECRET_PATH,
    seed,
)
from fastapi.testclient import TestClient
from helpers import wait_until

TOKEN = "dashboard-token-0123456789"


@pytest.fixture
def seeded(settings, db, redis_client):
    return seed(settings, db, redis_client)


def make_client(settings, db, redis_client, token=TOKEN, base_url="http://127.0.0.1", **kw):
    from magpie.web.app import create_app
    from magpie.web.service import Dashboard

    s = settings.model_copy(update={"web_token": token})
    app = create_app(s, dashboard=Dashboard(s, redis=redis_client, engine=db), sample=False, **kw)
    return TestClient(app, base_url=base_url)


@pytest.fixture
def client(settings, db, redis_client, seeded):
    with make_client(settings, db, redis_client) as c:
        yield c


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_status_is_the_schedule_status(client, settings, redis_client):
    from magpie.queue import RouteQueue

    got = client.get("/api/status").json()
    want = RouteQueue.from_settings(settings, redis_client).status()
    moving = ("oldest_lateness_s",)  # grows with the clock between the two reads
    assert {k: v for k, v in got["totals"].items() if k not in moving} == \
        {k: v for k, v in want["totals"].items() if k not in moving}
    assert got["totals"]["scheduled"] == 13 and got["totals"]["dead"] == 1
    assert [s["scheduled"] for s in got["shards"]] == [s["scheduled"] for s in want["shards"]]
    assert got["shards"][0]["name"] == want["shards"][0]["shard"].rsplit(":", 1)[-1]


def test_routes_filters_and_paging(client):
    everything = client.get("/api/routes").json()
    assert everything["total"] == 14
    assert not any("username" in r for r in everything["routes"])
    socks = client.get("/api/routes", params={"protocol": "socks5"}).json()
    assert socks["total"] == 5 and {r["protocol"] for r in socks["routes"]} == {"socks5"}
    beta = client.get("/api/routes", params={"workspace": "beta"}).json()
    assert beta["total"] == 5
    alive = client.get("/api/routes", params={"alive": "yes"}).json()["routes"]
    dead = client.get("/api/routes", params={"alive": "no"}).json()["routes"]
    unknown = client.get("/api/routes", params={"alive": "unknown"}).json()["routes"]
    assert all(r["alive"] for r in alive) and not any(r["alive"] for r in dead)
    assert [r["host"] for r in unknown] == ["127.0.0.9"]
    assert len(alive) + len(dead) + len(unknown) == 14
    elite = client.get("/api/routes", params={"anonymity": "elite"}).json()["routes"]
    assert elite and {r["anonymity"] for r in elite} == {"elite"}
    fast = client.get("/api/routes", params={"max_latency_ms": 150}).json()["routes"]
    assert fast and all(r["latency_ms"] <= 150 for r in fast)
    slow = client.get("/api/routes", params={"min_latency_ms": 150}).json()["routes"]
    assert len(fast) + len(slow) == len(alive)
    page = client.get("/api/routes", params={"limit": 5, "offset": 10}).json()
    assert page["total"] == 14 and len(page["routes"]) == 4
    assert client.get("/api/routes", params={"q": "127.0.1."}).json()["total"] == 4
    assert client.get("/api/routes", params={"q": "%"}).json()["total"] == 0  # LIKE wildcards are literal
    assert client.get("/api/routes", params={"protocol": "ftp"}).status_code == 422


def test_route_detail_has_history_and_schedule(client, seeded):
    got = client.get(f"/api/routes/{seeded['alive']}").json()
    assert got["route"]["host"] == "127.0.0.2" and got["route"]["workspaces"] == ["acme"]
    assert len(got["history"]) == 6 and got["history"][0]["checked_at"] > got["history"][-1]["checked_at"]
    assert "body" not in got["history"][0]
    assert got["schedule"]["state"] in ("due", "waiting") and "payload" not in got["schedule"]
    assert client.get(f"/api/routes/{'0' * 24}").status_code == 404
    assert client.get("/api/routes/not-a-hash").status_code == 422


def test_dead_letters_and_series(client, seeded):
    dead = client.get("/api/dead").json()
    assert dead["total"] == 1 and dead["dead"][0]["member"] == seeded["dead"]
    assert dead["dead"][0]["route"] == {"protocol": "socks5", "host": "127.0.0.9", "port": 1090}
    assert dead["dead"][0]["reason"] == "stalled"
    points = client.get("/api/series").json()["points"]
    assert len(points) == 39 and all(p["checks_per_s"] > 0 for p in points)
    # half of each batch is late 0.3 s (bucket 0.5), half 0.8-0.95 s (bucket 1.0)
    assert all(p["lateness_p50_s"] in (0.5, 1.0) and p["lateness_p99_s"] == 1.0 for p in points)
    assert len(client.get("/api/series", params={"limit": 5}).json()["points"]) == 5


def test_alerts_show_no_secret(client):
    inc = client.get("/api/incidents").json()
    assert [(i["rule"], i["status"], i["workspace"]) for i in inc] == \
        [("enough usable routes", "open", "acme")]
    dels = client.get("/api/deliveries").json()
    assert {d["status"] for d in dels} == {"sent", "failed"}
    assert {d["target"] for d in dels} == {"http://127.0.0.1:9"}
    text = json.dumps(dels)
    assert WEBHOOK_SECRET_PATH not in text and "hmac-secret-value" not in text


def test_no_page_or_answer_holds_a_credential(client, seeded):
    paths = ["/", "/dead", "/routes", "/routes?workspace=beta", f"/routes/{seeded['with_password']}",
             f"/routes/{seeded['dead']}", "/alerts", "/health", "/api/status", "/api/dead", "/api/routes",
             f"/api/routes/{seeded['with_password']}", "/api/deliveries", "/api/incidents", "/api/series",
             "/api/health", "/api/openapi.json", "/rotators", "/instances", "/instances?role=rotator",
             "/api/rotators", "/api/instances"]
    for path in paths:
        res = client.get(path)
        assert res.status_code == 200, (path, res.status_code, res.text[:300])
        for secret in (SECRET_PASSWORD, WEBHOOK_SECRET_PATH, TOKEN, "operator@", "hmac-secret-value",
                       ROTATOR_PASSWORD, ROTATOR_USER):
            assert secret not in res.text, (path, secret)
    page = client.get(f"/routes/{seeded['with_password']}").text
    assert "credentials stored, never shown" in page and "127.0.2.1:8888" in page


def test_actions_need_the_token(client, seeded, settings, redis_client):
    from magpie.queue import RouteQueue

    q = RouteQueue.from_settings(settings, redis_client)
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}):
        res = client.post("/api/actions/pause", headers=headers)
        assert res.status_code == 401 and res.json()["ok"] is False
        assert res.json()["refused"] in ("token_required", "bad_token")
    assert not q.is_paused()
    assert client.post("/api/actions/pause", headers=AUTH).json() == {"ok": True, "result": "paused"}
    assert q.is_paused() and client.get("/api/status").json()["paused"] is True
    assert client.post("/api/actions/resume", headers=AUTH).json()["result"] == "resumed"
    assert not q.is_paused()

    h = seeded["alive"]
    due = client.post(f"/api/routes/{h}/check-now", headers=AUTH).json()["result"]["due_ms"]
    assert q.inspect(h)["state"] == "due" and abs(due - q.server_time_ms()) < 5000
    later = client.post(f"/api/routes/{h}/check-now", params={"delay_s": 600}, headers=AUTH).json()
    assert later["result"]["due_ms"] > due + 590_000 and q.inspect(h)["state"] == "waiting"

    refused = client.post(f"/api/routes/{h}/reprocess", headers=AUTH)
    assert refused.status_code == 409
    assert refused.json() == {"ok": False, "refused": "not_dead", "detail": f"not_dead: route {h}",
                              "member": h}
    res = client.post(f"/api/routes/{seeded['dead']}/check-now", headers=AUTH)
    assert res.status_code == 409 and res.json()["refused"] == "dead"
    res = client.post(f"/api/routes/{seeded['dead']}/reprocess", headers=AUTH)
    assert res.status_code == 200 and q.inspect(seeded["dead"])["state"] == "due"
    assert client.get("/api/dead").json()["total"] == 0
    gone = client.post(f"/api/routes/{'a' * 24}/check-now", headers=AUTH)
    assert gone.status_code == 409 and gone.json()["refused"] == "gone"


def test_actions_refused_without_a_configured_token(settings, db, redis_client, seeded):
    from magpie.queue import RouteQueue

    with make_client(settings, db, redis_client, token=None) as c:
        for headers in ({}, AUTH):
            res = c.post("/api/actions/pause", headers=headers)
            assert res.status_code == 403
            assert res.json()["refused"] == "actions_disabled" and "MAGPIE_WEB_TOKEN" in res.json()["detail"]
        form = c.post("/ui/actions/pause", data={"token": TOKEN, "next": "/"}, follow_redirects=False)
        assert form.status_code == 303
        page = c.get(form.headers["location"]).text
        assert "operator actions are disabled: set MAGPIE_WEB_TOKEN" in page
        assert "actions disabled (MAGPIE_WEB_TOKEN not set)" in page
        assert c.get("/api/status").status_code == 200  # reads stay open on loopback
    assert not RouteQueue.from_settings(settings, redis_client).is_paused()


def test_form_actions(client, seeded, settings, redis_client):
    from magpie.queue import RouteQueue

    q = RouteQueue.from_settings(settings, redis_client)
    bad = client.post("/ui/actions/pause", data={"token": "nope", "next": "/dead"}, follow_redirects=False)
    assert bad.headers["location"].startswith("/dead?") and not q.is_paused()
    assert "refused" in client.get(bad.headers["location"]).text
    ok = client.post("/ui/actions/pause", data={"token": TOKEN, "next": "//elsewhere.example/"},
                     follow_redirects=False)
    assert ok.headers["location"].startswith("/?") and q.is_paused()  # never redirected off the site
    form = {"token": TOKEN, "member": seeded["dead"], "next": "/dead"}
    res = client.post("/ui/actions/reprocess", data=form)
    assert res.status_code == 200 and "reprocessed" in res.text and "No dead letters." in res.text
    res = client.post("/ui/actions/check-now", data={"token": TOKEN, "member": seeded["dead"], "next": "/"})
    assert "due" in res.text


def test_reads_need_the_token_off_loopback(settings, db, redis_client, seeded):
    with make_client(settings, db, redis_client, reads_need_token=True, base_url="https://127.0.0.1") as c:
        assert c.get("/api/status").status_code == 401
        assert c.get("/api/status", headers=AUTH).status_code == 200
        res = c.get("/routes", follow_redirects=False)
        assert res.status_code == 303 and res.headers["location"] == "/login"
        assert c.get("/static/style.css").status_code == 200
        c.post("/login", data={"token": "wrong"}, follow_redirects=False)
        assert c.get("/routes", follow_redirects=False).status_code == 303
        c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        assert c.get("/routes").status_code == 200
        assert c.post("/api/actions/pause").status_code == 401  # a cookie never authorises an action


def test_storage_down_is_one_line(settings, db, seeded):
    import redis

    dead_redis = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    with make_client(settings, db, dead_redis) as c:
        res = c.get("/api/status")
        assert res.status_code == 503 and res.json()["detail"].startswith("Redis error (MAGPIE_REDIS_URL)")
        page = c.get("/")
        assert page.status_code == 503 and "Redis error" in page.text
        assert c.get("/api/routes").status_code == 200  # PostgreSQL reads still work


def test_sampler_writes_a_bounded_ring(settings, redis_client, db):
    from magpie.queue import RouteQueue
    from magpie.observability.samples import read_samples, record

    q = RouteQueue.from_settings(settings, redis_client)
    assert record(redis_client, settings.redis_prefix, q, interval_s=0.001, keep=10) is not None
    guard = f"{settings.redis_prefix}web:sampled"
    wait_until(lambda: not redis_client.exists(guard), 5, 0.001, "the 1 ms guard to expire")
    assert record(redis_client, settings.redis_prefix, q, interval_s=60, keep=10) is not None
    # the guard: one sample per interval, whichever process takes it
    assert record(redis_client, settings.redis_prefix, q, interval_s=60, keep=10) is None
    for _ in range(15):
        redis_client.delete(f"{settings.redis_prefix}web:sampled")
        record(redis_client, settings.redis_prefix, q, interval_s=60, keep=10)
    samples = read_samples(redis_client, settings.redis_prefix, 100)
    assert len(samples) == 10 and samples[0]["t_ms"] <= samples[-1]["t_ms"]


@pytest.fixture
def web_cli(settings, db, monkeypatch):
    from click.testing import CliRunner

    from magpie.cli import main
    from magpie.config import get_settings

    for k, v in {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
                 "MAGPIE_DATABASE_URL": settings.database_url,
                 "PROXY_ENCRYPTION_KEY": settings.encryption_key}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MAGPIE_WEB_TOKEN", raising=False)
    get_settings.cache_clear()
    yield lambda *args: CliRunner().invoke(main, list(args))
    get_settings.cache_clear()


def test_cli_refuses_an_open_address_without_a_token(web_cli):
    res = web_cli("web", "--host", "0.0.0.0", "--port", "0")
    assert res.exit_code == 2
    assert "refusing to serve the dashboard on 0.0.0.0 without MAGPIE_WEB_TOKEN" in res.output


def test_cli_port_in_use_is_one_line(web_cli):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        res = web_cli("web", "--port", str(busy.getsockname()[1]))
    assert res.exit_code == 2 and "cannot listen on 127.0.0.1:" in res.output


def test_cli_short_token_is_refused(web_cli, monkeypatch):
    monkeypatch.setenv("MAGPIE_WEB_TOKEN", "short")
    from magpie.config import get_settings

    get_settings.cache_clear()
    res = web_cli("web", "--port", "0")
    assert res.exit_code == 2 and "MAGPIE_WEB_TOKEN" in res.output and "short" not in res.output


def test_page_details(client):
    assert '<meta http-equiv="refresh" content="10">' in client.get("/?refresh=10").text
    assert "http-equiv" not in client.get("/").text
    assert client.get("/?refresh=1").status_code == 422
    missing = client.get(f"/routes/{'0' * 24}")
    assert missing.status_code == 404 and "no route" in missing.text
    res = client.get("/routes")
    assert "default-src 'self'" in res.headers["content-security-policy"]
    assert client.get("/api/docs").status_code == 404  # the interactive docs would load remote scripts


def test_user_text_is_escaped(client, db):
    from magpie.db.repo import ensure_workspace

    ensure_workspace(db, "<i>evil</i>")
    page = client.get("/routes").text
    assert "&lt;i&gt;evil&lt;/i&gt;" in page and "<i>evil</i>" not in page


# -- rotators and instances --------------------------------------------------------------------------------
def test_rotators_api_is_the_rotators_list_merge(client, seeded, web_cli, db):
    import sqlalchemy as sa

    got = client.get("/api/rotators").json()
    assert (got["total"], got["serving"]) == (4, 1)
    rows = {r["name"]: r for r in got["rotators"]}
    assert [r["port"] for r in got["rotators"]] == [20000, 20001, 20002, 20003]
    front, sticky, stale, spare = rows["front"], rows["sticky-beta"], rows["stale"], rows["spare"]
    assert (front["state"], front["instance"], front["workspace"], front["auth"]) == \
        ("serving", ROTATOR_INSTANCE, "acme", True)
    assert (front["pool"], front["connections"], front["active"], front["upstream_failures"],
            front["bytes_up"], front["bytes_down"]) == (7, 1234, 3, 17, 5_242_880, 987_654_321)
    assert front["listen"] == ["http", "socks5"] and front["error"] is None
    assert front["filters"] == {"protocols": ["http", "socks5"], "anonymity": ["elite"]}
    assert (sticky["state"], sticky["policy"], sticky["sticky_seconds"]) == ("error", "sticky", 300)
    assert sticky["error"] == "cannot listen on 127.0.0.1:20001: Address already in use"
    assert sticky["pool"] is None and sticky["auth"] is False
    assert (stale["state"], stale["instance"], stale["connections"]) == ("not running", "rotator-gonehost-1-dead",
                                                                         None)
    assert (spare["state"], spare["instance"]) == ("unassigned", None)
    assert all("username" not in r and "password_enc" not in r for r in got["rotators"])
    # the client password is stored (encrypted): the dashboard leaves it out, it does not lack it
    with db.connect() as c:
        assert c.execute(sa.text("SELECT password_enc IS NOT NULL FROM rotators WHERE name = 'front'")).scalar()

    res = web_cli("rotators", "list", "--json")
    assert res.exit_code == 0, res.output
    cli = {r["name"]: r for r in json.loads(res.output)}
    keys = ("state", "instance", "pool", "connections", "active", "upstream_failures", "bytes_up", "bytes_down",
            "port", "listen", "auth", "policy", "filters")
    for name, row in rows.items():
        assert {k: row[k] for k in keys} == {k: cli[name][k] for k in keys}, name
        assert row["error"] == cli[name].get("error")
    table = web_cli("rotators", "list").output
    assert "cannot listen on 127.0.0.1:20001" in table and ROTATOR_PASSWORD not in table


def test_instances_api_by_role(client):
    got = client.get("/api/instances").json()
    assert got["by_role"] == {"beat": 1, "rotator": 1, "worker": 2} and got["total"] == 4
    assert [i["role"] for i in got["instances"]] == ["beat", "rotator", "worker", "worker"]
    w = {i["id"]: i for i in got["instances"]}["worker-seedhost-101-c0de"]
    assert (w["queues"], w["checks_in_flight"], w["check_slots"], w["check_processes"]) == (["checks"], 37, 64, 2)
    assert w["pid"] > 0 and w["host"] and w["version"] and w["ttl_s"] == 3600
    assert w["started_at"] <= w["refreshed_at"] and 0 <= w["heartbeat_age_s"] < 120
    rot = client.get("/api/instances", params={"role": "rotator"}).json()
    assert rot["total"] == 1 and rot["by_role"] == got["by_role"]
    assert (rot["instances"][0]["id"], rot["instances"][0]["rotators"], rot["instances"][0]["connections"]) == \
        (ROTATOR_INSTANCE, ["front"], 3)
    beat = client.get("/api/instances", params={"role": "beat"}).json()["instances"][0]
    assert beat["schedule"] == {"entries": 9, "bootstrapped": True, "last_tick_age_s": 1.5}
    assert client.get("/api/instances", params={"role": "nobody"}).json()["instances"] == []
    assert client.get("/api/instances", params={"role": "a b"}).status_code == 422


def test_an_expired_instance_leaves_the_list(client, settings, redis_client):
    from magpie.coordination.instances import Heartbeat

    Heartbeat("worker", redis_client, settings.redis_prefix, interval=1, ttl=1,
              instance_id="worker-short-lived").beat_once()
    ids = [i["id"] for i in client.get("/api/instances").json()["instances"]]
    assert "worker-short-lived" in ids
    redis_client.delete(f"{settings.redis_prefix}instance:worker-short-lived")  # as its TTL would
    got = client.get("/api/instances").json()
    assert "worker-short-lived" not in [i["id"] for i in got["instances"]] and got["by_role"]["worker"] == 2


def test_rotator_and_instance_pages(client):
    page = client.get("/rotators").text
    for text in ("front", "sticky-beta", "stale", "spare", "http+socks5", "sticky 300 s", "anonymity=elite",
                 "max_latency_ms=400", "Address already in use", "not running", "unassigned", "5.0 MiB",
                 "941.9 MiB", "1,234", ROTATOR_INSTANCE):
        assert text in page, text
    assert 'href="/rotators" class="current"' in page
    inst = client.get("/instances").text
    for text in ("worker (2)", "beat (1)", "rotator (1)", "worker-seedhost-101-c0de", "37 / 64", "bootstrapped",
                 "ingest, maintenance", "9 entries"):
        assert text in inst, text
    only = client.get("/instances?role=beat").text
    assert "beat (1)" in only and "worker (2)" not in only
    assert "No live nobody instance." in client.get("/instances?role=nobody").text
    over = client.get("/").text
    assert '<div class="value" id="rotators-serving"><a href="/rotators">1 / 4</a>' in over
    counts = re.sub(r"<[^>]+>", "", over.split('id="live-instances">', 1)[1].split("</div>", 1)[0])
    assert counts == "1 beat · 1 rotator · 2 worker"
    assert 'href="/instances"' in over


def test_overview_without_postgresql_still_shows_the_schedule(settings, redis_client, seeded):
    import sqlalchemy as sa

    from magpie.web.app import create_app
    from magpie.web.service import Dashboard

    down = sa.create_engine("postgresql+psycopg2://postgres@127.0.0.1:1/none", connect_args={"connect_timeout": 2})
    app = create_app(settings, dashboard=Dashboard(settings, redis=redis_client, engine=down), sample=False)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        page = c.get("/")
        assert page.status_code == 200 and 'id="rotators-serving"><a href="/rotators">unavailable' in page.text
        assert "2 worker" in page.text
        res = c.get("/api/rotators")
        assert res.status_code == 503 and "PostgreSQL" in res.json()["detail"]
        assert c.get("/api/instances").status_code == 200


def test_a_running_rotator_process_shows_as_serving(settings, db, redis_client):
    """A real rotator process: its assigner picks the rotator up, the listener serves, one client
    connection is counted, and the dashboard shows all of it."""
    import asyncio
    import socket
    import threading

    from magpie.base.crypto import get_keyring
    from magpie.db.repo import ensure_workspace
    from magpie.rotator.process import RotatorProcess
    from magpie.rotator.service import add_rotator

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    s = settings.model_copy(update={"rotator_ports": f"{port}-{port}", "rotator_reconcile": 0.3,
                                        "instance_heartbeat": 0.3, "instance_ttl": 30.0,
                                        "rotator_pool_refresh": 0.5})  # a long TTL: a loaded machine's stall
    # never expires the instance mid-test (a clean stop withdraws it at once, asserted below)
    keyring = get_keyring(s.encryption_key)
    ensure_workspace(db, "live")
    add_rotator(db, keyring, name="live-one", workspace="live", ports=s.rotator_ports, username="u",
                password=ROTATOR_PASSWORD)
    proc = RotatorProcess(s, engine=db, redis=redis_client, keyring=keyring)
    box: dict = {}

    async def main():
        box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
        await proc.run(box["stop"])

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()

    def wait(pred, what):
        return wait_until(pred, timeout=30, interval=0.1, what=what)

    try:
        with make_client(s, db, redis_client) as c:
            def row():
                return c.get("/api/rotators").json()["rotators"][0]

            def serving():
                r = row()
                return r if r["state"] == "serving" else None

            got = wait(serving, "a serving listener")
            assert (got["instance"], got["port"], got["pool"], got["auth"]) == (proc.id, port, 0, True)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as cl:
                cl.sendall(b"CONNECT 127.0.0.1:9 HTTP/1.1\r\nHost: 127.0.0.1:9\r\n\r\n")
                assert cl.recv(100).startswith(b"HTTP/1.1 407")  # credentials required
            wait(lambda: (row()["connections"] or 0) >= 1, "the connection counted")

            def listed():
                inst = c.get("/api/instances", params={"role": "rotator"}).json()["instances"]
                return [(i["id"], i["rotators"]) for i in inst] == [(proc.id, ["live-one"])]

            wait(listed, "the rotator instance listed with its rotator")
            page = c.get("/rotators").text
            assert "live-one" in page and "serving" in page and ROTATOR_PASSWORD not in page
    finally:
        wait(lambda: "loop" in box, "the rotator's event loop")
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(15)
    assert not thread.is_alive()
    with make_client(s, db, redis_client) as c:  # a clean stop withdraws the instance record at once
        assert c.get("/api/instances", params={"role": "rotator"}).json()["instances"] == []


def test_a_request_naming_another_host_is_refused(settings, db, redis_client, seeded):
    from magpie.web.auth import allowed_hosts

    with make_client(settings, db, redis_client) as c:
        assert c.get("/api/workspaces", headers={"Host": "evil.example"}).status_code == 400
        assert "evil" not in c.get("/", headers={"Host": "evil.example:8080"}).text
        assert c.get("/api/workspaces", headers={"Host": "localhost:8080"}).status_code == 200
        assert c.get("/api/workspaces", headers={"Host": "127.0.0.1:8080"}).status_code == 200
    assert allowed_hosts(settings.model_copy(update={"web_host": "::1"})) == ["[::1]", "localhost"]
    assert allowed_hosts(settings.model_copy(update={"web_host": "0.0.0.0"})) == ["*"]
    assert allowed_hosts(settings.model_copy(update={"web_allowed_hosts": "Magpie.example, *.ops.example"})) == [
        "magpie.example", "*.ops.example"]


def test_sign_in_is_a_session_with_an_expiry_and_a_sign_out(settings, db, redis_client, seeded):
    from magpie.web.auth import COOKIE

    with make_client(settings, db, redis_client, reads_need_token=True, base_url="https://127.0.0.1") as c:
        res = c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        cookie = res.headers["set-cookie"]
        sid = c.cookies.get(COOKIE)
        assert sid and TOKEN not in cookie and TOKEN not in sid
        attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")}
        assert {"secure", "httponly", "max-age", "samesite"} <= attrs and "samesite=strict" in cookie.lower()
        keys = list(redis_client.scan_iter(match=f"{settings.redis_prefix}web:session:*"))
        assert len(keys) == 1 and 0 < redis_client.pttl(keys[0]) <= settings.web_session_ttl * 1000
        assert c.get("/routes").status_code == 200
        assert "Sign out" in c.get("/routes").text
        res = c.post("/logout", follow_redirects=False)
        assert res.status_code == 303 and res.headers["location"].startswith("/login")
        assert not list(redis_client.scan_iter(match=f"{settings.redis_prefix}web:session:*"))
        c.cookies.set(COOKIE, sid)  # the old cookie, replayed
        assert c.get("/routes", follow_redirects=False).status_code == 303
        c.cookies.set(COOKIE, TOKEN)  # the raw token is no session
        assert c.get("/routes", follow_redirects=False).status_code == 303
    # a session opened with one token ends when the token changes
    with make_client(settings, db, redis_client, reads_need_token=True, base_url="https://127.0.0.1") as c:
        c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        sid = c.cookies.get(COOKIE)
    other = "another-token-0123456789"
    with make_client(settings, db, redis_client, token=other, reads_need_token=True,
                     base_url="https://127.0.0.1") as c:
        c.cookies.set(COOKIE, sid)
        assert c.get("/routes", follow_redirects=False).status_code == 303


def test_token_guessing_at_sign_in_is_throttled_per_address(settings, db, redis_client, seeded, caplog):
    import logging

    from magpie.web.auth import COOKIE

    with (caplog.at_level(logging.WARNING, logger="magpie.web"),
          make_client(settings, db, redis_client, reads_need_token=True, base_url="https://127.0.0.1") as c):
        for i in range(20):
            c.post("/login", data={"token": f"guess-{i:020d}"}, follow_redirects=False)
        res = c.post("/login", data={"token": TOKEN})
        assert COOKIE not in c.cookies and "too many failed sign-ins" in res.text
        assert c.get("/routes", follow_redirects=False).status_code == 303
    lines = [r.getMessage() for r in caplog.records if "failed sign-ins" in r.getMessage()]
    assert lines and not any("guess-" in ln or TOKEN in ln for ln in lines)


def test_the_banner_shows_only_messages_the_dashboard_wrote(client):
    page = client.get("/", params={"flash": "Your session expired: call +1 555 0100", "ok": "1"})
    assert page.status_code == 200 and "555 0100" not in page.text
    res = client.post("/ui/actions/pause", data={"token": TOKEN, "next": "/dead"})
    assert res.status_code == 200 and 'class="flash ok"' in res.text and "paused" in res.text
    forged = str(res.url).replace("paused", "send%20your%20token")
    assert "send your token" not in client.get(forged).text


def test_sign_in_over_plain_http_off_loopback_says_the_cookie_needs_https(settings, db, redis_client, seeded):
    s = settings.model_copy(update={"web_host": "10.9.8.7"})  # in process: nothing listens or dials there
    with make_client(s, db, redis_client, base_url="http://10.9.8.7") as c:
        assert "plain HTTP" in c.get("/login").text
        assert c.get("/api/status").status_code == 401  # reads need the token on that bind
    with make_client(s, db, redis_client, base_url="https://10.9.8.7") as c:
        assert "plain HTTP" not in c.get("/login").text
