"""The program API against real Redis and PostgreSQL: API tokens (CLI, scopes, refusals), the per-token rate
limit, imports (a body, or a URL fetched through the egress guard), keyset paging and route history."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from fastapi.testclient import TestClient

WEB_TOKEN = "web-token-0123456789abcdef"


def _no_dns(host, *a, **kw):
    raise OSError("name resolution is off in this test")


def make_app(settings, db, redis_client, **updates):
    from magpie.web.app import create_app
    from magpie.web.service import Dashboard

    s = settings.model_copy(update={"web_token": WEB_TOKEN, **updates})
    app = create_app(s, dashboard=Dashboard(s, redis=redis_client, engine=db), sample=False)
    app.state.resolve = _no_dns
    return app


@pytest.fixture
def workspaces(db):
    from magpie.admin.operations import create_workspace

    return {name: create_workspace(db, name)["id"] for name in ("acme", "beta")}


@pytest.fixture
def tokens(db, workspaces):
    from magpie.apitokens.store import create_token

    out = {}
    for ws in ("acme", "beta"):
        for role in ("read", "operate"):
            out[f"{ws}-{role}"] = create_token(db, role=role, workspace=ws)["secret"]
    out["admin"] = create_token(db, role="admin", workspace=None)["secret"]
    return out


@pytest.fixture
def client(settings, db, redis_client, tokens):
    with TestClient(make_app(settings, db, redis_client), base_url="http://127.0.0.1") as c:
        yield c


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


def upload(client, secret, text, **params):
    return client.post("/api/imports", content=text.encode(), params=params,
                       headers={**bearer(secret), "Content-Type": "text/plain"})


LIST = "\n".join([f"http://127.0.3.{i}:{8000 + i}" for i in range(1, 26)] + ["127.0.9.9:99999", "10.1.2.3:8080"]) + "\n"


# -- tokens -----------------------------------------------------------------------------------------
def _cli(settings, *args):
    from magpie.cli import main
    from magpie.config import get_settings

    env = {"MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
           "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix}
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    finally:
        get_settings.cache_clear()


def test_tokens_cli_shows_the_secret_once_and_revokes(settings, db, redis_client, workspaces):
    res = _cli(settings, "tokens", "create", "--workspace", "acme", "--role", "read", "--name", "ci",
               "--expires", "30d")
    assert res.exit_code == 0, res.output
    secret = res.stdout.strip().splitlines()[-1]
    assert secret.startswith("mgp_") and len(secret) > 40
    listed = _cli(settings, "tokens", "list", "--json")
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["role"], r["workspace"], r["state"]) for r in rows] == [("ci", "read", "acme", "active")]
    assert 29 * 86400 < (datetime.fromisoformat(rows[0]["expires_at"]) - datetime.now(timezone.utc)).total_seconds()
    with db.connect() as c:
        stored = c.execute(sa.text("SELECT token_hash FROM api_tokens")).scalar_one()
    table = _cli(settings, "tokens", "list").stdout
    for out in (listed.stdout, table):
        assert secret not in out and secret[12:] not in out and stored not in out
    assert rows[0]["prefix"] == secret[:12] and secret[:12] in table

    with TestClient(make_app(settings, db, redis_client), base_url="http://127.0.0.1") as c:
        assert c.get("/api/routes", headers=bearer(secret)).status_code == 200
        res = _cli(settings, "tokens", "revoke", str(rows[0]["id"]))
        assert res.exit_code == 0 and "revoked" in res.output
        got = c.get("/api/routes", headers=bearer(secret))
        assert got.status_code == 401 and got.json()["refused"] == "revoked"
        assert got.text.count("\n") == 0
    assert "already revoked" in _cli(settings, "tokens", "revoke", str(rows[0]["id"])).output
    res = _cli(settings, "tokens", "revoke", "999")
    assert res.exit_code == 2 and "no token with id 999" in res.output

    for args, why in ((["--workspace", "nowhere", "--role", "read"], "no workspace named 'nowhere'"),
                      (["--role", "operate"], "needs --workspace"),
                      (["--workspace", "acme", "--role", "read", "--expires", "soon"], "bad --expires")):
        res = _cli(settings, "tokens", "create", *args)
        assert res.exit_code == 2 and why in res.output and res.output.count("\n") == 1, res.output


def _flip(secret: str) -> str:
    """``secret`` with its last character changed."""
    return secret[:-1] + ("A" if secret[-1] != "A" else "B")


def test_missing_bad_expired_and_revoked_tokens_get_401(client, db, workspaces, tokens):
    from magpie.apitokens.store import create_token, revoke_token

    old = create_token(db, role="operate", workspace="acme",
                       expires_at=datetime.now(timezone.utc) - timedelta(seconds=1))
    gone = create_token(db, role="operate", workspace="acme")
    revoke_token(db, gone["id"])
    cases = [({}, "token_required"), (bearer("mgp_" + "x" * 43), "bad_token"),
             (bearer(_flip(tokens["acme-operate"])), "bad_token"),
             (bearer(old["secret"]), "expired"), (bearer(gone["secret"]), "revoked")]
    for headers, code in cases:
        res = client.post("/api/imports", content=b"127.0.0.1:80\n", params={"workspace": "acme"},
                          headers={**headers, "Content-Type": "text/plain"})
        assert res.status_code == 401, (code, res.text)
        assert res.json()["refused"] == code and "\n" not in res.text
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM routes")).scalar() == 0


def test_roles_and_workspaces_are_enforced_with_403(client, tokens):
    acme_read, acme_op = tokens["acme-read"], tokens["acme-operate"]
    assert upload(client, acme_read, LIST).status_code == 403  # read cannot import
    res = upload(client, acme_op, LIST, workspace="beta")
    assert res.status_code == 403 and res.json()["refused"] == "forbidden" and "'acme'" in res.json()["detail"]
    assert client.get("/api/routes", params={"workspace": "beta"}, headers=bearer(acme_read)).status_code == 403
    for path in ("/api/status", "/api/dead", "/api/workspaces", "/api/bulk/workspaces"):
        assert client.get(path, headers=bearer(acme_op)).status_code == 403, path
        assert client.get(path, headers=bearer(tokens["admin"])).status_code == 200, path
    assert client.post("/api/actions/pause", headers=bearer(acme_op)).status_code == 403
    assert client.post("/api/actions/pause", headers=bearer(tokens["admin"])).json() == \
        {"ok": True, "result": "paused"}
    assert client.post("/api/actions/resume", headers=bearer(WEB_TOKEN)).status_code == 200


# -- imports ----------------------------------------------------------------------------------------
def test_import_body_answers_the_per_line_report_and_the_job_keeps_it(client, tokens):
    res = upload(client, tokens["acme-operate"], LIST)
    assert res.status_code == 201, res.text
    job = res.json()
    rep = job["report"]
    assert job["status"] == "done" and job["workspace"] == "acme" and job["source"] == "<api upload>"
    assert (rep["valid"], rep["imported"], rep["scheduled"], rep["refused"]) == (25, 25, 25, 1)
    assert [x["line"] for x in rep["invalid"]] == [26, 27]
    assert "refused by the egress guard" in rep["invalid"][1]["reason"]

    again = client.get(f"/api/imports/{job['id']}", headers=bearer(tokens["acme-read"])).json()
    assert again["report"] == rep and again["status"] == "done"
    assert client.get(f"/api/imports/{job['id']}", headers=bearer(tokens["beta-read"])).status_code == 404
    assert client.get(f"/api/imports/{'0' * 32}", headers=bearer(tokens["acme-read"])).status_code == 404
    assert client.get(f"/api/imports/{job['id']}", headers=bearer(tokens["admin"])).status_code == 200
    # MAGPIE_WEB_TOKEN is an admin token: it imports into a workspace it names
    res = upload(client, WEB_TOKEN, "127.0.4.1:80\n", workspace="beta", dry_run="true")
    assert res.status_code == 201 and res.json()["report"]["valid"] == 1 and res.json()["dry_run"] is True
    assert upload(client, WEB_TOKEN, "127.0.4.1:80\n").status_code == 422  # no workspace of its own


def test_import_body_over_the_limit_is_413(settings, db, redis_client, tokens):
    app = make_app(settings, db, redis_client, api_import_max_bytes=1024)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        res = upload(c, tokens["acme-operate"], "127.0.0.1:80\n" * 200)
    assert res.status_code == 413 and "MAGPIE_API_IMPORT_MAX_BYTES" in res.json()["detail"]


class _ListServer:
    """A loopback HTTP server: ``/list.txt`` answers ``body``; ``/slow`` trickles a byte every 0.2 s."""

    def __init__(self, body: bytes):
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                if self.path == "/slow":
                    for _ in range(100):
                        if outer.stop.is_set():
                            return
                        try:
                            self.wfile.write(b"1")
                            self.wfile.flush()
                        except OSError:
                            return
                        outer.stop.wait(0.2)
                else:
                    self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.stop = threading.Event()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def list_server():
    srv = _ListServer(LIST.encode())
    yield srv
    srv.close()


def test_import_from_a_url_goes_through_the_egress_guard_bounded(settings, db, redis_client, tokens, list_server):
    op = bearer(tokens["acme-operate"])
    url = f"http://127.0.0.1:{list_server.port}/list.txt"
    refused = make_app(settings, db, redis_client)  # MAGPIE_API_FETCH_ALLOW_PRIVATE=false: loopback refused
    with TestClient(refused, base_url="http://127.0.0.1") as c:
        res = c.post("/api/imports", json={"source_url": url}, headers=op)
        assert res.status_code == 422 and "egress guard" in res.json()["detail"], res.text
        job = c.get(f"/api/imports/{res.json()['job']}", headers=op).json()
        assert job["status"] == "failed" and "egress guard" in job["error"]
        res = c.post("/api/imports", json={"source_url": "http://lists.invalid/p.txt"}, headers=op)
        assert res.status_code == 422 and "cannot resolve" in res.json()["detail"]
        res = c.post("/api/imports", json={"source_url": url, "extra": 1}, headers=op)
        assert res.status_code == 422 and "source_url" in res.json()["detail"]

    allowed = make_app(settings, db, redis_client, api_fetch_allow_private="127.0.0.0/8", api_fetch_timeout=1.0)
    with TestClient(allowed, base_url="http://127.0.0.1") as c:
        res = c.post("/api/imports", json={"source_url": url}, headers=op)
        assert res.status_code == 201, res.text
        assert res.json()["source"] == "list.txt" and res.json()["report"]["imported"] == 25
        started = time.monotonic()
        res = c.post("/api/imports", json={"source_url": f"http://127.0.0.1:{list_server.port}/slow"}, headers=op)
        took = time.monotonic() - started
        assert res.status_code == 422 and "took too long" in res.json()["detail"]
        assert took < 3.0, took  # MAGPIE_API_FETCH_TIMEOUT bounds the whole download
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT source FROM route_sources GROUP BY source")).scalars().all() == ["list.txt"]


# -- reads ------------------------------------------------------------------------------------------
def test_keyset_paging_walks_a_workspace_once_in_id_order(client, tokens):
    assert upload(client, tokens["acme-operate"], LIST).status_code == 201
    assert upload(client, tokens["beta-operate"], "127.0.5.1:80\n127.0.3.1:8001\n").status_code == 201
    seen, after = [], 0
    while after is not None:
        page = client.get("/api/routes", params={"after": after, "limit": 10},
                          headers=bearer(tokens["acme-read"])).json()
        assert page["total"] is None and len(page["routes"]) <= 10
        seen += [r["route_id"] for r in page["routes"]]
        after = page["next_after"]
    assert len(seen) == 25 and seen == sorted(set(seen))
    beta = client.get("/api/routes", params={"after": 0}, headers=bearer(tokens["beta-read"])).json()
    assert sorted(r["host"] for r in beta["routes"]) == ["127.0.3.1", "127.0.5.1"] and beta["next_after"] is None
    everything = client.get("/api/routes", params={"after": 0, "limit": 1000}, headers=bearer(tokens["admin"])).json()
    assert len(everything["routes"]) == 26
    socks = client.get("/api/routes", params={"after": 0, "protocol": "socks5"}, headers=bearer(tokens["admin"]))
    assert socks.json()["routes"] == []


def test_route_and_history_pages_are_scoped(client, db, tokens):
    upload(client, tokens["acme-operate"], LIST)
    upload(client, tokens["beta-operate"], "127.0.5.1:80\n")
    with db.begin() as c:
        rid, h = c.execute(sa.text("SELECT id, route_hash FROM routes WHERE host = '127.0.3.1'")).one()
        other = c.execute(sa.text("SELECT route_hash FROM routes WHERE host = '127.0.5.1'")).scalar_one().strip()
        t0 = datetime.now(timezone.utc).replace(microsecond=123456) - timedelta(hours=1)
        for k in range(7):  # three rows share one checked_at: the cursor keeps them apart
            at = t0 + timedelta(minutes=max(k, 2))
            c.execute(sa.text("INSERT INTO check_history (checked_at, route_id, alive, latency_ms, attempts, error)"
                              " VALUES (:t, :r, :a, :l, 1, :e)"),
                      {"t": at, "r": rid, "a": k % 2 == 0, "l": 10.0 + k,
                       "e": "http://user:pw-Secret@127.0.3.1:8001 refused"})
    h = h.strip()
    read = bearer(tokens["acme-read"])
    got, cursor, pages = [], None, 0
    while True:
        page = client.get(f"/api/routes/{h}/history", params={"limit": 2, **({"cursor": cursor} if cursor else {})},
                          headers=read).json()
        got += page["history"]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(got) == 7 and pages == 4
    assert sorted(r["latency_ms"] for r in got) == [10.0 + k for k in range(7)]
    stamps = [r["checked_at"] for r in got]
    assert stamps == sorted(stamps, reverse=True)
    assert "pw-Secret" not in json.dumps(got)
    assert client.get(f"/api/routes/{h}", headers=read).json()["route"]["route_hash"] == h
    assert client.get(f"/api/routes/{other}", headers=read).status_code == 404
    assert client.get(f"/api/routes/{other}/history", headers=read).status_code == 404
    assert client.get(f"/api/routes/{other}/history", headers=bearer(tokens["admin"])).status_code == 200
    assert client.get(f"/api/routes/{h}/history", params={"cursor": "12:x"}, headers=read).status_code == 422


# -- rate limit ---------------------------------------------------------------------------------------
def test_rate_limit_is_per_token_with_retry_after_and_counted(settings, db, redis_client, tokens):
    from magpie.observability.metrics import build_registry

    app = make_app(settings, db, redis_client, api_rate=0.5, api_burst=3)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        codes = [c.get("/api/routes", headers=bearer(tokens["acme-read"])).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        res = c.get("/api/routes", headers=bearer(tokens["acme-read"]))
        assert res.status_code == 429 and res.json()["refused"] == "rate_limited"
        assert 1 <= int(res.headers["Retry-After"]) <= 2
        assert c.get("/api/routes", headers=bearer(tokens["beta-read"])).status_code == 200  # its own bucket
    text = "\n".join(f"{s.name} {s.labels} {s.value}" for m in build_registry(settings, redis=redis_client).collect()
                     for s in m.samples if s.name.startswith("magpie_api_rate_limited"))
    assert "magpie_api_rate_limited_total {'role': 'read'} 2" in text, text


def test_the_bucket_is_taken_atomically_under_concurrency(settings, redis_client):
    from helpers import run_concurrently

    from magpie.apitokens.ratelimit import limited_counts, take

    got = []

    def one():
        got.append(take(redis_client, settings.redis_prefix, "77", "operate", rate=0.001, burst=10))

    run_concurrently(lambda: [one() for _ in range(10)], threads=8)
    assert sum(w is None for w in got) == 10 and len(got) == 80
    assert limited_counts(redis_client, settings.redis_prefix)["operate"] == 70
    assert all(w is None or w > 100 for w in got)  # at 0.001/s the next token is ~1000 s away


def test_tokens_never_reach_the_logs(client, tokens, caplog):
    caplog.set_level(logging.DEBUG)
    for secret in (tokens["acme-read"], _flip(tokens["acme-read"])):
        client.get("/api/routes", headers=bearer(secret))
        upload(client, secret, LIST)
    assert caplog.records  # something was logged at all
    assert tokens["acme-read"][12:] not in caplog.text and tokens["acme-read"][:-2] not in caplog.text


def test_export_streams_the_scoped_workspace_and_guards_credentials(client, tokens):
    creds = "http://alice:s3cret-pw@127.0.6.1:8080\n"
    assert upload(client, tokens["acme-operate"], LIST + creds).status_code == 201
    assert upload(client, tokens["beta-operate"], "127.0.5.1:80\n").status_code == 201
    res = client.get("/api/export", headers=bearer(tokens["acme-read"]))
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain")
    assert 'filename="acme.txt"' in res.headers["content-disposition"]
    lines = res.text.splitlines()
    assert len(lines) == 26 and "127.0.5.1:80" not in res.text and "s3cret-pw" not in res.text
    no_ws = client.get("/api/export", params={"format": "jsonl"}, headers=bearer(tokens["admin"]))
    assert no_ws.status_code == 422  # an admin token has no workspace of its own: it must name one
    rows = [json.loads(x) for x in client.get("/api/export", params={"format": "jsonl", "workspace": "beta"},
                                              headers=bearer(tokens["admin"])).text.splitlines()]
    assert [r["host"] for r in rows] == ["127.0.5.1"]
    assert client.get("/api/export", params={"workspace": "beta"},
                      headers=bearer(tokens["acme-read"])).status_code == 403
    denied = client.get("/api/export", params={"with_credentials": "true"}, headers=bearer(tokens["acme-read"]))
    assert denied.status_code == 403 and "s3cret-pw" not in denied.text
    assert client.get("/api/export", params={"with_credentials": "true", "workspace": "acme"}).status_code == 401
    full = client.get("/api/export", params={"with_credentials": "true", "format": "url"},
                      headers=bearer(tokens["acme-operate"]))
    assert full.status_code == 200 and "alice:s3cret-pw@127.0.6.1:8080" in full.text
    bad = client.get("/api/export", params={"format": "xml"}, headers=bearer(tokens["acme-read"]))
    assert bad.status_code == 422
