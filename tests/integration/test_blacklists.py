"""Blacklists against real PostgreSQL and Redis: the ``blacklist_refresh`` job (flag / skip / remove per
workspace, fenced removal, leader lock, limits, run records, idempotence), URL sources through the egress
guard on a loopback server, import-time refusals and the ``magpie blacklists`` commands."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from helpers import add_history, history_by_route

from magpie.blacklists.sources import add_source, parse_entries, set_policy
from magpie.cli import main
from magpie.config import get_settings
from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.importer.service import import_file
from magpie.queue.payload import schedule_item
from magpie.coordination.leader import LeaderLock
from magpie.wiring.jobs import run_job
from magpie.maintenance.runner import read_job_status
from magpie.queue import RouteQueue
from magpie.base.routes import Route

JOB = "blacklist_refresh"


@pytest.fixture
def s(settings, pg_url):
    return settings.model_copy(update={"enrich_allow_private": "127.0.0.0/8"})


@pytest.fixture
def q(s, redis_client):
    return RouteQueue.from_settings(s, redis_client)


def _store(db, s, q, ws: str, hosts: list[str], port: int = 8080):
    rows = upsert_routes(db, get_keyring(s.encryption_key), ws, [Route("http", h, port) for h in hosts]).routes
    q.schedule([schedule_item(r) for r in rows])
    return {r.route.host: r for r in rows}


def _members(db, route_id: int) -> list[str]:
    with db.connect() as c:
        return [n for (n,) in c.execute(sa.text(
            "SELECT w.name FROM route_workspaces rw JOIN workspaces w ON w.id = rw.workspace_id "
            "WHERE rw.route_id = :r ORDER BY w.name"), {"r": route_id})]


def _flags(db) -> dict[int, tuple[str, bool]]:
    with db.connect() as c:
        return {r: (str(n), u) for r, n, u in c.execute(sa.text(
            "SELECT route_id, network, unscheduled FROM route_blacklist"))}


def _exists(db, route_id: int) -> bool:
    with db.connect() as c:
        return c.execute(sa.text("SELECT count(*) FROM routes WHERE id = :i"), {"i": route_id}).scalar_one() == 1


def test_parse_entries_reads_addresses_ranges_and_comments():
    data = (b"# DROP list\n198.51.100.0/24 ; SBL1\n203.0.113.7\n203.0.113.8-203.0.113.11\n2001:db8::/32\n"
            b"10.0.0.5/8  listed 2026\nnot an address\n\n198.51.100.0/24\n")
    parsed = parse_entries(data, max_entries=100)
    assert [str(n) for n in parsed.networks] == ["198.51.100.0/24", "203.0.113.7/32", "203.0.113.8/30",
                                                 "2001:db8::/32", "10.0.0.0/8"]
    assert parsed.invalid == 1 and len(parsed.digest) == 64
    from magpie.blacklists.sources import SourceError

    with pytest.raises(SourceError, match="more than 3 entries"):
        parse_entries(data, max_entries=3)


def test_refresh_flags_skips_and_removes_per_workspace_policy(s, db, q, tmp_path):
    listed = tmp_path / "bad.txt"
    listed.write_text("127.0.0.2\n127.0.1.0/24\n")
    a = _store(db, s, q, "alpha", ["127.0.0.1", "127.0.0.2", "127.0.1.5"])  # flag (the default)
    _store(db, s, q, "beta", ["127.0.0.2", "127.0.1.6"])  # remove
    g = _store(db, s, q, "gamma", ["127.0.1.5", "127.0.1.7"])  # skip
    set_policy(db, "beta", "remove")
    set_policy(db, "gamma", "skip")
    add_source(db, "local", str(listed))
    by_host = {**a, **_store(db, s, q, "beta", ["127.0.0.2", "127.0.1.6"]), **g}
    rid = {h: r.route_id for h, r in by_host.items()}
    member = {h: r.route_hash.strip() for h, r in by_host.items()}
    add_history(db, rid.values())

    res = run_job(JOB, s, engine=db, redis=q.r)
    assert res["status"] == "ok", res
    r = res["result"]
    assert (r["sources"], r["sources_changed"], r["entries"], r["listed"]) == (1, 1, 2, 4)
    assert (r["memberships_removed"], r["routes_removed"], r["unscheduled"]) == (2, 1, 1)
    # the removed route's history went with it; every route kept keeps its own
    assert history_by_route(db) == {i: 2 for h, i in rid.items() if h != "127.0.1.6"}
    flags = _flags(db)
    assert set(flags) == {rid["127.0.0.2"], rid["127.0.1.5"], rid["127.0.1.7"]}
    # 127.0.0.2: alpha (flag) keeps it, beta (remove) lost it; still scheduled.
    assert _members(db, rid["127.0.0.2"]) == ["alpha"] and q.score(member["127.0.0.2"]) is not None
    # 127.0.1.6: beta only (remove): gone from the schedule and PostgreSQL.
    assert not _exists(db, rid["127.0.1.6"]) and q.payload(member["127.0.1.6"]) is None
    # 127.0.1.5: alpha flags, gamma skips: a workspace still wants it checked.
    assert flags[rid["127.0.1.5"]] == ("127.0.1.0/24", False) and q.score(member["127.0.1.5"]) is not None
    # 127.0.1.7: gamma only (skip): off the schedule, kept in PostgreSQL with its membership.
    assert flags[rid["127.0.1.7"]] == ("127.0.1.0/24", True)
    assert q.payload(member["127.0.1.7"]) is None and _members(db, rid["127.0.1.7"]) == ["gamma"]
    # 127.0.0.1 is not listed.
    assert rid["127.0.0.1"] not in flags and q.score(member["127.0.0.1"]) is not None

    again = run_job(JOB, s, engine=db, redis=q.r)["result"]  # idempotent: nothing changes
    assert (again["sources_changed"], again["memberships_removed"], again["routes_removed"],
            again["unscheduled"], again["rescheduled"], again["unflagged"]) == (0, 0, 0, 0, 0, 0)
    assert _flags(db) == flags

    # The range leaves the list: its routes are unflagged and the skipped one goes back on the schedule.
    listed.write_text("127.0.0.2\n")
    back = run_job(JOB, s, engine=db, redis=q.r)["result"]
    assert (back["sources_changed"], back["unflagged"], back["rescheduled"]) == (1, 2, 1)
    assert set(_flags(db)) == {rid["127.0.0.2"]}
    assert q.score(member["127.0.1.7"]) is not None


def test_a_flag_workspace_brings_a_skipped_route_back(s, db, q, tmp_path):
    listed = tmp_path / "bad.txt"
    listed.write_text("127.0.3.0/24\n")
    g = _store(db, s, q, "gamma", ["127.0.3.1"])
    set_policy(db, "gamma", "skip")
    add_source(db, "local", str(listed))
    run_job(JOB, s, engine=db, redis=q.r)
    member = g["127.0.3.1"].route_hash.strip()
    assert q.payload(member) is None
    set_policy(db, "gamma", "flag")
    r = run_job(JOB, s, engine=db, redis=q.r)["result"]
    assert r["rescheduled"] == 1 and q.payload(member) is not None
    assert _flags(db)[g["127.0.3.1"].route_id][1] is False


def test_a_route_under_a_live_lease_is_removed_after_its_check(s, db, q, tmp_path):
    listed = tmp_path / "bad.txt"
    listed.write_text("127.0.4.1\n")
    b = _store(db, s, q, "beta", ["127.0.4.1"])
    set_policy(db, "beta", "remove")
    add_source(db, "local", str(listed))
    member = b["127.0.4.1"].route_hash.strip()
    q.enqueue_in(member, 0)
    [lease] = q.pop(1)
    r = run_job(JOB, s, engine=db, redis=q.r)["result"]
    assert r["skipped_leased"] == 1 and r["routes_removed"] == 0 and _exists(db, b["127.0.4.1"].route_id)
    q.complete([lease])
    r = run_job(JOB, s, engine=db, redis=q.r)["result"]
    assert r["routes_removed"] == 1 and not _exists(db, b["127.0.4.1"].route_id) and q.payload(member) is None


def test_runs_under_its_lock_is_bounded_and_records_failures(s, db, q, tmp_path, redis_client):
    listed = tmp_path / "bad.txt"
    listed.write_text("127.0.5.0/24\n")
    _store(db, s, q, "alpha", [f"127.0.5.{i}" for i in range(1, 8)])
    add_source(db, "local", str(listed))
    other = LeaderLock(redis_client, s.redis_prefix, JOB, ttl_ms=5000)
    assert other.acquire()
    held = run_job(JOB, s, engine=db, redis=redis_client)
    assert held["status"] == "skipped" and _flags(db) == {}
    other.release()

    first = run_job(JOB, s, engine=db, redis=redis_client, batch_size=2, max_batches=3)
    r = first["result"]  # one batch for the source, two of two routes
    assert (r["complete"], r["scanned"], r["listed"]) == (False, 4, 4)
    rest = run_job(JOB, s, engine=db, redis=redis_client, batch_size=2, max_batches=10)["result"]
    assert rest["complete"] and rest["scanned"] == 3 and len(_flags(db)) == 7

    listed.unlink()  # the source fails; its entries stay in use and the pass is recorded as a failure
    (tmp_path / "ok.txt").write_text("127.0.9.9\n")
    add_source(db, "second", str(tmp_path / "ok.txt"))
    bad = run_job(JOB, s, engine=db, redis=redis_client)
    assert bad["status"] == "error" and "1 of 2 blacklist sources failed: local: cannot read" in bad["error"]
    assert len(_flags(db)) == 7
    [row] = [x for x in read_job_status(db) if x["job"] == JOB]
    assert row["failures_total"] == 1 and row["runs_total"] == 3 and "local" in row["last_error"]
    with db.connect() as c:
        errs = dict(c.execute(sa.text("SELECT name, last_error FROM blacklist_sources")).all())
        entries = c.execute(sa.text("SELECT count(*) FROM blacklist_entries")).scalar_one()
    assert errs["second"] is None and "cannot read" in errs["local"] and entries == 2


class _Lists(http.server.BaseHTTPRequestHandler):
    body = b"127.0.6.0/24\n"

    def do_GET(self):
        self.send_response(200 if self.path.split("?", 1)[0] == "/drop.txt" else 404)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def list_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Lists)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_url_source_through_the_egress_guard(s, db, q, list_server):
    _store(db, s, q, "alpha", ["127.0.6.1"])
    add_source(db, "remote", f"{list_server}/drop.txt")
    assert run_job(JOB, s, engine=db, redis=q.r)["result"]["listed"] == 1
    add_source(db, "missing", f"{list_server}/nope.txt")
    res = run_job(JOB, s, engine=db, redis=q.r)
    assert res["status"] == "error" and "missing: HTTP 404" in res["error"]
    guarded = s.model_copy(update={"enrich_allow_private": "false"})
    res = run_job(JOB, guarded, engine=db, redis=q.r)
    assert "remote: '127.0.0.1' refused by the egress guard" in res["error"]
    assert "MAGPIE_ENRICH_ALLOW_PRIVATE" in res["error"]


def test_import_keeps_listed_routes_out_of_skip_and_remove_workspaces(s, db, q, tmp_path):
    listed = tmp_path / "bad.txt"
    listed.write_text("127.0.7.0/24\n")
    add_source(db, "local", str(listed))
    run_job(JOB, s, engine=db, redis=q.r)
    proxies = tmp_path / "list.txt"
    proxies.write_text("127.0.7.1:80\n127.0.8.1:80\n# c\n127.0.7.2:80\n")
    flagged = import_file(str(proxies), "alpha", s, queue=q, engine=db)
    assert (flagged.valid, flagged.imported, flagged.flagged, flagged.blacklisted) == (3, 3, 2, 0)
    upsert_routes(db, get_keyring(s.encryption_key), "beta", [])
    set_policy(db, "beta", "skip")
    kept = import_file(str(proxies), "beta", s, queue=q, engine=db)
    assert (kept.valid, kept.imported, kept.blacklisted) == (1, 1, 2)
    assert [(x["line"], x["reason"].split(" ")[0]) for x in kept.invalid] == [(1, "blacklisted:"), (4, "blacklisted:")]
    assert "127.0.7.1 is in 127.0.7.0/24 of source 'local' (workspace policy skip)" in kept.invalid[0]["reason"]


@pytest.fixture
def cli(s, monkeypatch):
    env = {"MAGPIE_REDIS_URL": s.redis_url, "MAGPIE_REDIS_PREFIX": s.redis_prefix,
           "MAGPIE_DATABASE_URL": s.database_url, "PROXY_ENCRYPTION_KEY": s.encryption_key,
           "MAGPIE_ENRICH_ALLOW_PRIVATE": "127.0.0.0/8"}
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


def test_blacklists_commands(cli, s, db, q, tmp_path, list_server):
    listed = tmp_path / "bad.txt"
    listed.write_text("127.0.10.1\n")
    _store(db, s, q, "alpha", ["127.0.10.1", "127.0.10.2"])
    out = json.loads(cli("blacklists", "add", "local", str(listed), "--json").stdout)
    assert out["source"]["name"] == "local" and out["source"]["entries"] == 0
    cli("blacklists", "add", "remote", f"{list_server}/drop.txt?token=s3cret-token")
    assert "bad source name" in cli("blacklists", "add", "Bad Name", str(listed), code=2).output
    assert "no such file" in cli("blacklists", "add", "x", str(tmp_path / "none"), code=2).output
    assert "credentials" in cli("blacklists", "add", "y", "http://u:p@127.0.0.1/x", code=2).output
    ref = json.loads(cli("blacklists", "refresh", "--json").stdout)
    assert ref["status"] == "ok" and ref["result"]["listed"] == 1
    text = cli("blacklists", "refresh").stdout
    assert "refreshed 2 sources (0 changed" in text
    cli("blacklists", "policy", "alpha", "remove")
    assert "no workspace 'nope'" in cli("blacklists", "policy", "nope", "skip", code=2).output
    listing = json.loads(cli("blacklists", "list", "--json").stdout)
    by_name = {x["name"]: x for x in listing["sources"]}
    assert by_name["local"]["entries"] == 1 and by_name["local"]["flagged"] == 1
    assert "s3cret-token" not in json.dumps(listing)  # a URL's query may hold a token
    assert listing["policies"] == [{"workspace": "alpha", "policy": "remove", "default": False}]
    table = cli("blacklists", "list").stdout
    assert "local" in table and "remove" in table and "s3cret" not in table
    cli("blacklists", "remove", "local")
    assert "no blacklist source" in cli("blacklists", "remove", "local", code=2).output
