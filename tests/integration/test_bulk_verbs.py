"""Operator bulk verbs on the command line and the dashboard: workspaces, removing routes by filter,
reprocessing dead letters, retrying failed deliveries; every one with --dry-run and --json, removals
through the schedule's fenced calls."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from helpers import add_history, history_by_route
from magpie.cli import main
from magpie.config import get_settings
from magpie.queue import Payload, RouteQueue


@pytest.fixture
def cli(settings, db, monkeypatch):
    env = {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
           "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
           "PROXY_QUEUE_SHARDS": "4", "MAGPIE_CHECK_INTERVAL": "60"}
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


def js(res):
    return json.loads(res.stdout)["result"]


@pytest.fixture
def two_workspaces(cli, tmp_path, db):
    """Route a only in alpha, b in alpha and beta, c only in beta (socks5). Returns ``{letter: hash}``."""
    a, b, c = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    a.write_text("127.0.0.1:1001\n127.0.0.1:1002\n")
    b.write_text("127.0.0.1:1002\nsocks5://127.0.0.1:1003\n")
    cli("import", str(a), "-w", "alpha")
    cli("import", str(b), "-w", "beta")
    with db.connect() as c:
        rows = dict(c.execute(sa.text("SELECT port, route_hash FROM routes")).all())
    return {"a": rows[1001].strip(), "b": rows[1002].strip(), "c": rows[1003].strip()}


def queue() -> RouteQueue:
    return RouteQueue.from_settings(get_settings())


def route_ids(db) -> dict[str, int]:
    """Route hash -> id."""
    with db.connect() as c:
        return {h.strip(): int(i) for h, i in c.execute(sa.text("SELECT route_hash, id FROM routes"))}


def ws_of(q, h):
    p = q.payload(h)
    return None if p is None else Payload.decode(p, None).workspaces if '"c":' not in p else json.loads(p)["w"]


def test_workspaces_list_create_delete(cli, two_workspaces, db):
    q, h = queue(), two_workspaces
    names = {r["name"]: r["routes"] for r in js(cli("workspaces", "list", "--json"))}
    assert names == {"alpha": 2, "beta": 2}
    assert js(cli("workspaces", "create", "gamma", "--dry-run", "--json"))["created"] is False
    assert "gamma" not in {r["name"] for r in js(cli("workspaces", "list", "--json"))}
    assert js(cli("workspaces", "create", "gamma", "--json"))["created"] is True
    assert "exists" in cli("workspaces", "create", "gamma", code=2).stderr
    res = cli("workspaces", "create", "bad\x1b[31mname", code=2)
    assert "bad workspace name" in res.stderr and "\x1b" not in res.output

    beta_id = next(r["id"] for r in js(cli("workspaces", "list", "--json")) if r["name"] == "beta")
    ids = route_ids(db)
    add_history(db, ids.values())
    dry = js(cli("workspaces", "delete", "alpha", "--dry-run", "--json"))
    assert (dry["matched"], dry["removed"], dry["deleted"]) == (2, 0, False)
    assert q.payload(h["a"]) is not None
    assert "pass --yes" in cli("workspaces", "delete", "alpha", code=2).stderr
    out = js(cli("workspaces", "delete", "alpha", "--yes", "--json"))
    assert (out["matched"], out["removed"], out["updated"], out["skipped_leased"], out["deleted"]) == (2, 1, 1, 0, True)
    assert q.payload(h["a"]) is None and q.score(h["a"]) is None  # alpha's own route is gone
    assert ws_of(q, h["b"]) == [beta_id] and q.score(h["b"]) is not None  # beta keeps the shared one
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM routes")).scalar() == 2
    # the deleted route's history went with it; the routes beta keeps have theirs
    assert history_by_route(db) == {ids[h["b"]]: 2, ids[h["c"]]: 2}
    assert {r["name"] for r in js(cli("workspaces", "list", "--json"))} == {"beta", "gamma"}
    assert "no workspace named" in cli("workspaces", "delete", "alpha", "--yes", code=2).stderr


def test_workspace_delete_leaves_a_leased_route_and_the_workspace(cli, two_workspaces):
    q, h = queue(), two_workspaces
    q.enqueue_in(h["a"], 0)
    leases = q.pop(5)
    assert h["a"] in {le.member for le in leases}
    res = cli("workspaces", "delete", "alpha", "--yes", "--json", code=1)
    out = json.loads(res.stdout)["result"]
    assert out["skipped_leased"] == 1 and out["deleted"] is False
    assert q.payload(h["a"]) is not None
    assert "alpha" in {r["name"] for r in js(cli("workspaces", "list", "--json"))}


def test_detach_keeps_a_workspace_an_import_adds_between_read_and_removal(cli, two_workspaces, db):
    from magpie.admin.operations import _detach

    q, h = queue(), two_workspaces
    alpha = next(r["id"] for r in js(cli("workspaces", "list", "--json")) if r["name"] == "alpha")
    real, calls = q.payload, []

    def payload_then_import(member):
        text = real(member)
        if not calls:  # an import merges workspace 99 right after this read
            calls.append(1)
            d = json.loads(text)
            d["w"] = sorted(d["w"] + [99])
            q.schedule([(member, json.dumps(d, separators=(",", ":")))])
        return text

    q.payload = payload_then_import
    assert _detach(q, h["a"], alpha) == "updated"
    q.payload = real
    assert json.loads(q.payload(h["a"]))["w"] == [99]


def test_bulk_remove_routes_by_protocol_workspace_and_dead_days(cli, two_workspaces, db):
    q, h = queue(), two_workspaces
    ids = route_ids(db)
    add_history(db, ids.values())
    assert "at least one filter" in cli("bulk", "remove-routes", "--yes", code=2).stderr
    dry = js(cli("bulk", "remove-routes", "--protocol", "socks5", "--dry-run", "--json"))
    assert dry["matched"] == 1 and q.payload(h["c"]) is not None
    out = js(cli("bulk", "remove-routes", "--protocol", "socks5", "--yes", "--json"))
    assert (out["matched"], out["removed"]) == (1, 1) and q.payload(h["c"]) is None
    assert history_by_route(db) == {ids[h["a"]]: 2, ids[h["b"]]: 2}  # c's history went with it
    with db.begin() as c:  # b failing and not alive for 10 days; a alive
        ids = dict(c.execute(sa.text("SELECT route_hash, id FROM routes")).all())
        c.execute(sa.text("INSERT INTO route_health (route_id, alive, last_checked_at, last_alive_at) VALUES "
                          "(:b, false, now(), now() - interval '10 days'), (:a, true, now(), now())"),
                  {"a": ids[h["a"].ljust(24)], "b": ids[h["b"].ljust(24)]})
    assert js(cli("bulk", "remove-routes", "--dead-days", "30", "--dry-run", "--json"))["matched"] == 0
    out = js(cli("bulk", "remove-routes", "--dead-days", "7", "-w", "beta", "--yes", "--json"))
    assert (out["matched"], out["removed"], out["updated"]) == (1, 0, 1)
    assert ws_of(q, h["b"]) and q.score(h["b"]) is not None  # still alpha's
    assert history_by_route(db) == {ids[h["a"]]: 2, ids[h["b"]]: 2}  # and keeps its history
    out = js(cli("bulk", "remove-routes", "--dead-days", "7", "--yes", "--json"))
    assert (out["matched"], out["removed"]) == (1, 1) and q.payload(h["b"]) is None
    assert q.payload(h["a"]) is not None
    assert history_by_route(db) == {ids[h["a"]]: 2}


def dead_letter(q, member, reason="stalled", at_ms=1_000):
    shard = q.keys.shard_of(member)
    q.r.zrem(shard, member)
    q.r.zadd(q.keys.dead, {member: at_ms})
    q.r.hset(q.keys.dead_info, member, json.dumps({"reason": reason, "stalls": 3, "at": at_ms}))


def test_bulk_reprocess_dead_all_or_filtered(cli, two_workspaces):
    q, h = queue(), two_workspaces
    dead_letter(q, h["a"], "stalled")
    dead_letter(q, h["b"], "other", at_ms=q.server_time_ms())
    dry = js(cli("bulk", "reprocess-dead", "--dry-run", "--json"))
    assert (dry["matched"], dry["reprocessed"]) == (2, 0) and len(q.dead_letters()) == 2
    out = js(cli("bulk", "reprocess-dead", "--reason", "stalled", "--json"))
    assert (out["matched"], out["reprocessed"]) == (1, 1)
    assert [d["member"] for d in q.dead_letters()] == [h["b"]] and q.score(h["a"]) is not None
    assert js(cli("bulk", "reprocess-dead", "--older-than", "3600", "--json"))["matched"] == 0
    assert js(cli("bulk", "reprocess-dead", "--json"))["reprocessed"] == 1 and q.dead_letters() == []


def test_bulk_retry_failed_emails(cli, db, settings):
    from magpie.outbox.service import OUTBOX, enqueue_email

    ids = [enqueue_email(db, get_settings(), f"ops{i}@example.test", "s", "b") for i in range(3)]
    with db.begin() as c:
        c.execute(sa.text("UPDATE email_outbox SET status = 'failed' WHERE id = ANY(:ids)"), {"ids": ids[:2]})
    assert js(cli("bulk", "retry-deliveries", "--kind", "email", "--dry-run", "--json"))["matched"] == 2
    assert OUTBOX.counts(db)["failed"] == 2
    out = js(cli("bulk", "retry-deliveries", "--kind", "email", "--json"))
    assert (out["matched"], out["retried"]) == (2, 2) and OUTBOX.counts(db)["failed"] == 0
    assert js(cli("bulk", "retry-deliveries", "--json"))["matched"] == 0  # no failed webhook deliveries


def test_dashboard_bulk_verbs_need_the_token(cli, two_workspaces, settings):
    from fastapi.testclient import TestClient

    from magpie.web.app import create_app

    s = get_settings().model_copy(update={"web_token": "t0ken-for-tests-0123456789"})
    q, h = queue(), two_workspaces
    with TestClient(create_app(s, sample=False), base_url="http://127.0.0.1") as client:
        assert client.get("/api/bulk/workspaces").status_code == 401
        assert client.post("/api/bulk/workspaces/delete", json={"name": "alpha"}).status_code == 401
        auth = {"Authorization": "Bearer t0ken-for-tests-0123456789"}
        names = {r["name"] for r in client.get("/api/bulk/workspaces", headers=auth).json()["result"]}
        assert names == {"alpha", "beta"}
        assert client.post("/api/bulk/workspaces/create", headers=auth,
                           json={"name": "gamma"}).json()["result"]["created"]
        dry = client.post("/api/bulk/workspaces/delete", headers=auth,
                          json={"name": "alpha", "dry_run": True}).json()["result"]
        assert dry["matched"] == 2 and q.payload(h["a"]) is not None
        r = client.post("/api/bulk/remove-routes", headers=auth, json={})
        assert r.status_code == 409 and r.json()["refused"] == "no_filter"
        r = client.post("/api/bulk/workspaces/delete", headers=auth, json={"name": "nope"})
        assert r.status_code == 404 and r.json()["refused"] == "unknown_workspace"
        out = client.post("/api/bulk/remove-routes", headers=auth, json={"protocol": "socks5"}).json()["result"]
        assert out["removed"] == 1 and q.payload(h["c"]) is None
        assert client.post("/api/bulk/workspaces/delete", headers=auth,
                           json={"name": "alpha"}).json()["result"]["deleted"] is True
        dead_letter(q, h["b"])
        assert client.post("/api/bulk/reprocess-dead", headers=auth, json={}).json()["result"]["reprocessed"] == 1
        assert client.post("/api/bulk/retry-deliveries", headers=auth,
                           json={"dry_run": True}).json()["result"]["matched"] == 0
