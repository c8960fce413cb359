"""Derived data against real PostgreSQL and Redis: ingestion marks reputation dirty, the reputation job,
rollups (snapshots, hourly counts, source statistics, usage) and their retention jobs, each under its
leader lock, bounded, recorded and idempotent."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.derived.reputation import History, Params, score
from magpie.coordination.leader import LeaderLock
from magpie.wiring.jobs import run_job
from magpie.maintenance.runner import read_job_status
from magpie.base.routes import Route

KEY = "test-key-0123456789abcdef"
NOW = datetime(2026, 3, 10, 12, 34, 56, tzinfo=UTC)


@pytest.fixture
def s(settings, pg_url):
    return settings


def _routes(db, n=3, ws="derived", host="10.9.0.1", protocol="http", port0=8000):
    return upsert_routes(db, get_keyring(KEY), ws, [Route(protocol, host, port0 + i) for i in range(n)]).routes


def _check(db, rid, at, alive, latency=None, anonymity=None):
    with db.begin() as c:
        c.execute(sa.text("INSERT INTO check_history (route_id, checked_at, alive, latency_ms, anonymity) "
                          "VALUES (:r, :t, :a, :l, :n)"), {"r": rid, "t": at, "a": alive, "l": latency, "n": anonymity})


def _health(db, rid, alive, cf, last_alive, checks=1, anonymity=None, latency=None):
    with db.begin() as c:
        c.execute(sa.text("""
            INSERT INTO route_health (route_id, last_checked_at, alive, consecutive_failures, last_alive_at,
                                      checks_total, alive_total, anonymity, latency_ms)
            VALUES (:r, :t, :a, :cf, :la, :n, :n, :an, :l)
            ON CONFLICT (route_id) DO UPDATE SET alive = EXCLUDED.alive, consecutive_failures = EXCLUDED.consecutive_failures,
                last_alive_at = EXCLUDED.last_alive_at, checks_total = EXCLUDED.checks_total,
                anonymity = EXCLUDED.anonymity, latency_ms = EXCLUDED.latency_ms"""),
                  {"r": rid, "t": NOW - timedelta(minutes=1), "a": alive, "cf": cf, "la": last_alive, "n": checks,
                   "an": anonymity, "l": latency})


def _mark(db, ids):
    with db.begin() as c:
        c.execute(sa.text("INSERT INTO reputation_dirty (route_id) SELECT unnest(CAST(:ids AS bigint[])) "
                          "ON CONFLICT DO NOTHING"), {"ids": list(ids)})


def _table(db, sql):
    with db.connect() as c:
        return [tuple(r) for r in c.execute(sa.text(sql))]


def _row(db, job):
    return next(r for r in read_job_status(db) if r["job"] == job)


# --------------------------------------------------------------------------------------- reputation


def test_ingestion_marks_written_routes_dirty_in_its_transaction(s, db):
    from magpie.stats import encode_result
    from magpie.stats.entry import parse_entry
    from magpie.stats.store import apply_results

    a, b, c = _routes(db)
    t0 = int(NOW.timestamp() * 1000)
    fields = [encode_result(route_id=r.route_id, route_hash=r.route_hash, alive=True, checked_at_ms=t0 + i,
                            latency_ms=10.0, status=200, attempts=1, error=None, body=None, anonymity="elite",
                            judge="http://127.0.0.1:8899/") for i, r in enumerate((a, b))]
    committed, _, dead = apply_results(db, [parse_entry(f"{t0 + i}-0", f) for i, f in enumerate(fields)])
    assert committed == 2 and not dead
    assert _table(db, "SELECT route_id FROM reputation_dirty ORDER BY 1") == sorted([(a.route_id,), (b.route_id,)])
    assert c.route_id not in [r[0] for r in _table(db, "SELECT route_id FROM reputation_dirty")]


def _hand_made(db):
    """Three routes with known histories; returns {route_id: expected Reputation}."""
    good, mid, bad = _routes(db, 3, ws="rep")
    p = Params()
    exp = {}
    # good: 10 alive checks, 200 ms, elite, alive a minute ago
    for i in range(10):
        _check(db, good.route_id, NOW - timedelta(hours=i + 1), True, 200.0, "elite")
    _health(db, good.route_id, True, 0, NOW - timedelta(hours=1), 10, "elite", 200.0)
    exp[good.route_id] = score(History(10, 10, 200.0, 3600.0, "elite", 0), p)
    # mid: 6 of 10 alive at 2750 ms, anonymous, last alive 6 h ago, 2 failures since
    for i in range(10):
        _check(db, mid.route_id, NOW - timedelta(hours=i + 1), i >= 4, 2750.0 if i >= 4 else None,
               "anonymous" if i >= 4 else None)
    _health(db, mid.route_id, False, 2, NOW - timedelta(hours=5), 10)
    exp[mid.route_id] = score(History(10, 6, 2750.0, 5 * 3600.0, "anonymous", 2), p)
    # bad: 10 failures, alive once 3 days ago (outside nothing: the window is 7 days)
    _check(db, bad.route_id, NOW - timedelta(days=3), True, 4000.0, "transparent")
    for i in range(10):
        _check(db, bad.route_id, NOW - timedelta(hours=i + 1), False)
    _health(db, bad.route_id, False, 10, NOW - timedelta(days=3), 11)
    exp[bad.route_id] = score(History(11, 1, 4000.0, 3 * 86400.0, "transparent", 10), p)
    _mark(db, exp)
    return exp


def test_reputation_job_scores_dirty_routes_with_the_documented_labels(s, db):
    exp = _hand_made(db)
    assert sorted(r.label for r in exp.values()) == ["good", "neutral", "poor"]
    res = run_job("reputation", s, engine=db, now=NOW)
    assert res["status"] == "ok" and res["result"]["scored"] == 3 and res["result"]["complete"]
    got = {r[0]: (r[1], r[2]) for r in _table(db, "SELECT route_id, score, label FROM route_reputation")}
    assert got == {rid: (pytest.approx(rep.score, abs=0.05), rep.label) for rid, rep in exp.items()}
    assert _table(db, "SELECT count(*) FROM reputation_dirty") == [(0,)]
    # a second pass finds nothing dirty and nothing stale: same rows
    before = _table(db, "SELECT * FROM route_reputation ORDER BY route_id")
    again = run_job("reputation", s, engine=db, now=NOW)
    assert again["status"] == "ok" and again["result"]["scored"] == 0
    assert _table(db, "SELECT * FROM route_reputation ORDER BY route_id") == before


def test_reputation_job_is_bounded_and_resumes(s, db):
    exp = _hand_made(db)
    first = run_job("reputation", s, engine=db, now=NOW, batch_size=1, max_batches=2)
    assert first["result"] == {"scored": 2, "stale_marked": 0, "complete": False}
    assert _table(db, "SELECT count(*) FROM reputation_dirty") == [(1,)]
    rest = run_job("reputation", s, engine=db, now=NOW, batch_size=1)
    assert rest["result"]["complete"] and rest["result"]["scored"] == 1
    assert len(_table(db, "SELECT route_id FROM route_reputation")) == len(exp)


def test_reputation_scores_a_bounded_share_per_pass_round_robin(s, db):
    """MAGPIE_REPUTATION_PER_PASS caps each pass; the next pass resumes after the last route scored, so a
    route dirtied again meanwhile does not starve the others."""
    exp = _hand_made(db)
    ids = sorted(exp)
    capped = s.model_copy(update={"reputation_per_pass": 2})
    first = run_job("reputation", capped, engine=db, now=NOW)
    assert first["result"] == {"scored": 2, "stale_marked": 0, "complete": False}
    with db.begin() as c:  # the first route scored is dirtied again by a new result
        c.execute(sa.text("INSERT INTO reputation_dirty (route_id) VALUES (:r)"), {"r": ids[0]})
    second = run_job("reputation", capped, engine=db, now=NOW)
    assert second["result"]["scored"] == 2  # the third route first, then the wrap-around to the first
    assert _table(db, "SELECT count(*) FROM reputation_dirty") == [(0,)]
    assert len(_table(db, "SELECT route_id FROM route_reputation")) == len(exp)


def test_stale_scores_are_recomputed_so_recency_decays(s, db):
    exp = _hand_made(db)
    run_job("reputation", s, engine=db, now=NOW)
    later = NOW + timedelta(seconds=s.reputation_max_age + 60)
    res = run_job("reputation", s, engine=db, now=later)
    assert res["result"]["stale_marked"] == 3 and res["result"]["scored"] == 3
    good = max(exp, key=lambda rid: exp[rid].score)
    [(rec,)] = _table(db, f"SELECT recency FROM route_reputation WHERE route_id = {good}")
    assert rec < 0.01  # a day and more since it was last alive


def test_routes_cli_shows_and_filters_by_reputation(s, db, monkeypatch):
    import json

    from click.testing import CliRunner

    from magpie.cli import main
    from magpie.config import get_settings

    exp = _hand_made(db)
    run_job("reputation", s, engine=db, now=NOW)
    for k, v in {"MAGPIE_DATABASE_URL": s.database_url, "MAGPIE_REDIS_URL": s.redis_url,
                 "MAGPIE_REDIS_PREFIX": s.redis_prefix, "PROXY_ENCRYPTION_KEY": KEY, "COLUMNS": "200"}.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    try:
        out = CliRunner().invoke(main, ["routes", "--json", "-w", "rep"])
        rows = json.loads(out.output)
        assert {r["route_id"]: r["reputation"] for r in rows} == {rid: rep.label for rid, rep in exp.items()}
        good = CliRunner().invoke(main, ["routes", "--json", "--reputation", "good"])
        assert [r["reputation"] for r in json.loads(good.output)] == ["good"]
        high = CliRunner().invoke(main, ["routes", "--json", "--min-score", "40"])
        assert sorted(r["reputation"] for r in json.loads(high.output)) == ["good", "neutral"]
        table = CliRunner().invoke(main, ["routes", "-w", "rep"])
        assert table.exit_code == 0 and "reputation" in table.output and "neutral" in table.output
        bad = CliRunner().invoke(main, ["routes", "--min-score", "101"])
        assert bad.exit_code == 2
        # keyset pages: one route a page, each page after the last id of the one before, then the end
        seen, after = [], 0
        for _ in range(len(exp) + 1):
            page = CliRunner().invoke(main, ["routes", "--json", "-w", "rep", "--limit", "1",
                                                             "--after", str(after)])
            rows = json.loads(page.stdout)
            if not rows:
                break
            assert len(rows) == 1 and rows[0]["route_id"] > after
            after = rows[0]["route_id"]
            seen.append(after)
        assert sorted(seen) == sorted(exp) and seen == sorted(seen)
        hint = CliRunner().invoke(main, ["routes", "-w", "rep", "--limit", "1"])
        assert f"more routes: magpie routes --after {min(exp)} --limit 1" in hint.stderr
        goods = CliRunner().invoke(main, ["routes", "--json", "--reputation", "good", "--limit", "1"])
        assert [r["reputation"] for r in json.loads(goods.stdout)] == ["good"]  # read past filtered-out pages
    finally:
        get_settings.cache_clear()


# --------------------------------------------------------------------------------------- rollups


def _population(db):
    """Two workspaces: 'ws-a' with 3 http + 1 socks5 routes, 'ws-b' with 2 http; history in two hours."""
    a = _routes(db, 3, ws="ws-a")
    a5 = _routes(db, 1, ws="ws-a", protocol="socks5", host="10.9.1.1")
    b = _routes(db, 2, ws="ws-b", host="10.9.2.1")
    for r, alive in zip(a + a5 + b, (True, False, True, True, False, None)):
        if alive is not None:
            _health(db, r.route_id, alive, 0 if alive else 1, NOW if alive else None)
    hour = NOW.replace(minute=0, second=0, microsecond=0)
    for i, r in enumerate(a):
        _check(db, r.route_id, hour + timedelta(minutes=5 + i), i != 1, 100.0)
        _check(db, r.route_id, hour - timedelta(minutes=30), True, 100.0)
    _check(db, b[0].route_id, hour + timedelta(minutes=1), False)
    return a, a5, b, hour


def test_snapshots_count_alive_and_total_per_workspace_and_protocol(s, db):
    _population(db)
    res = run_job("workspace_snapshots", s, engine=db, now=NOW)
    assert res["status"] == "ok" and res["result"]["complete"]
    slot = datetime(2026, 3, 10, 12, 30, tzinfo=UTC)
    got = _table(db, "SELECT w.name, s.taken_at, s.protocol, s.alive, s.total FROM workspace_snapshots s "
                     "JOIN workspaces w ON w.id = s.workspace_id ORDER BY 1, 3")
    assert got == [("ws-a", slot, "http", 2, 3), ("ws-a", slot, "socks5", 1, 1), ("ws-b", slot, "http", 0, 2)]
    assert run_job("workspace_snapshots", s, engine=db, now=NOW + timedelta(minutes=2))["status"] == "ok"
    assert len(_table(db, "SELECT * FROM workspace_snapshots")) == 3  # same slot: replaced, not added
    run_job("workspace_snapshots", s, engine=db, now=NOW + timedelta(minutes=10))
    assert len(_table(db, "SELECT DISTINCT taken_at FROM workspace_snapshots")) == 2


def test_hourly_counts_backfill_recompute_and_close(s, db):
    a, _, b, hour = _population(db)
    res = run_job("hourly_counts", s, engine=db, now=NOW)
    assert res["status"] == "ok" and res["result"]["complete"]
    got = _table(db, "SELECT w.name, h.hour, h.checks, h.alive, h.routes_checked, h.routes_alive "
                     "FROM hourly_counts h JOIN workspaces w ON w.id = h.workspace_id ORDER BY 2, 1")
    prev = hour - timedelta(hours=1)
    assert got == [("ws-a", prev, 3, 3, 3, 3), ("ws-a", hour, 3, 2, 3, 2), ("ws-b", hour, 1, 0, 1, 0)]
    # a late result lands in the open hour on the next pass; repeating changes nothing
    _check(db, b[1].route_id, hour + timedelta(minutes=2), True)
    run_job("hourly_counts", s, engine=db, now=NOW)
    run_job("hourly_counts", s, engine=db, now=NOW)
    assert ("ws-b", hour, 2, 1, 2, 1) in _table(db, "SELECT w.name, h.hour, h.checks, h.alive, h.routes_checked, "
                                                    "h.routes_alive FROM hourly_counts h JOIN workspaces w "
                                                    "ON w.id = h.workspace_id")


def test_hourly_counts_are_bounded_and_resume_from_their_cursor(s, db):
    _population(db)
    first = run_job("hourly_counts", s, engine=db, now=NOW, batch_size=1, max_batches=1)
    assert first["result"]["complete"] is False and "resume_hour" in first["result"]
    for _ in range(10):
        res = run_job("hourly_counts", s, engine=db, now=NOW, batch_size=1, max_batches=2)
        if res["result"]["complete"]:
            break
    assert res["result"]["complete"]
    assert len(_table(db, "SELECT * FROM hourly_counts")) == 3


def test_source_stats_follow_the_import_source(s, db, redis_client, tmp_path):
    from magpie.importer.service import import_file

    f1 = tmp_path / "fresh.txt"
    f1.write_text("127.0.5.1:80\n127.0.5.2:80\n")
    f2 = tmp_path / "old.txt"
    f2.write_text("127.0.5.2:80\n127.0.5.3:80\n127.0.5.4:80\n")
    import_file(str(f1), "src", s, engine=db)
    import_file(str(f2), "src", s, engine=db)
    ids = dict(_table(db, "SELECT host, id FROM routes"))
    _health(db, ids["127.0.5.2"], True, 0, NOW, latency=100.0)
    _health(db, ids["127.0.5.3"], True, 0, NOW, latency=300.0)
    res = run_job("source_stats", s, engine=db, now=NOW)
    assert res["status"] == "ok"
    got = _table(db, "SELECT source, routes, alive, checked, latency_avg_ms FROM source_stats ORDER BY source")
    assert got == [("fresh.txt", 2, 1, 1, 100.0), ("old.txt", 3, 2, 2, 200.0)]
    # twice: same numbers
    run_job("source_stats", s, engine=db, now=NOW)
    assert _table(db, "SELECT source, routes, alive, checked, latency_avg_ms FROM source_stats ORDER BY source") == got
    # the workspace drops the first list's routes: that source is written as zeros, then retention removes it
    with db.begin() as c:
        c.execute(sa.text("DELETE FROM route_workspaces WHERE route_id IN (:a, :b)"),
                  {"a": ids["127.0.5.1"], "b": ids["127.0.5.2"]})
    run_job("source_stats", s, engine=db, now=NOW + timedelta(minutes=15))
    assert _table(db, "SELECT source, routes FROM source_stats ORDER BY source") == [("fresh.txt", 0), ("old.txt", 2)]
    later = NOW + timedelta(days=s.source_stats_retention_days + 1)
    res = run_job("source_stats_retention", s, engine=db, now=later)
    assert res["result"]["deleted"] == 2  # nothing refreshed them since


def test_workspace_usage_sums_the_hourly_counts(s, db, tmp_path):
    _population(db)
    run_job("hourly_counts", s, engine=db, now=NOW)
    res = run_job("workspace_usage", s, engine=db, now=NOW)
    assert res["status"] == "ok" and res["result"]["complete"]
    got = _table(db, "SELECT w.name, u.day, u.routes, u.sources, u.checks, u.alive_checks FROM workspace_usage u "
                     "JOIN workspaces w ON w.id = u.workspace_id ORDER BY 1")
    assert got == [("ws-a", NOW.date(), 4, 0, 6, 5), ("ws-b", NOW.date(), 2, 0, 1, 0)]
    run_job("workspace_usage", s, engine=db, now=NOW)
    assert _table(db, "SELECT w.name, u.day, u.routes, u.sources, u.checks, u.alive_checks FROM workspace_usage u "
                      "JOIN workspaces w ON w.id = u.workspace_id ORDER BY 1") == got


_ROW = {
    "workspace_snapshots": "INSERT INTO workspace_snapshots VALUES (:w, :t, 'http', 1, 2)",
    "hourly_counts": "INSERT INTO hourly_counts (workspace_id, hour, checks, alive, routes_checked, routes_alive) "
                     "VALUES (:w, :t, 3, 2, 2, 1)",
    "workspace_usage": "INSERT INTO workspace_usage (workspace_id, day, routes, sources, checks, alive_checks) "
                       "VALUES (:w, CAST(:t AS date), 4, 1, 3, 2)",
}


@pytest.mark.parametrize("job, table, setting", [
    ("snapshot_retention", "workspace_snapshots", "snapshot_retention_days"),
    ("hourly_retention", "hourly_counts", "hourly_retention_days"),
    ("usage_retention", "workspace_usage", "usage_retention_days"),
])
def test_retention_deletes_only_rows_past_their_setting_in_batches(s, db, job, table, setting):
    _routes(db, 1, ws="ret")
    [(ws,)] = _table(db, "SELECT id FROM workspaces WHERE name = 'ret'")
    keep = getattr(s, setting)
    with db.begin() as c:
        for days in (0, 1, keep - 1, keep + 1, keep + 2, keep + 30):
            c.execute(sa.text(_ROW[table]), {"w": ws, "t": NOW - timedelta(days=days, hours=1)})
    first = run_job(job, s, engine=db, now=NOW, batch_size=1, max_batches=2)
    assert first["result"]["deleted"] == 2 and first["result"]["complete"] is False
    rest = run_job(job, s, engine=db, now=NOW)
    assert rest["result"]["complete"] and rest["result"]["deleted"] == 1
    assert _table(db, f"SELECT count(*) FROM {table}") == [(3,)]
    assert run_job(job, s, engine=db, now=NOW)["result"]["deleted"] == 0  # idempotent


# ------------------------------------------------------------------------ every job: lock and records

JOBS = [("reputation", "reputation_dirty"), ("workspace_snapshots", "workspace_snapshots"),
        ("hourly_counts", "hourly_counts"), ("source_stats", "source_stats"),
        ("workspace_usage", "workspace_usage"), ("snapshot_retention", "workspace_snapshots"),
        ("hourly_retention", "hourly_counts"), ("usage_retention", "workspace_usage"),
        ("source_stats_retention", "source_stats")]


@pytest.mark.parametrize("job, table", JOBS)
def test_each_job_runs_under_its_lock_and_records_success_and_failure(s, db, redis_client, job, table):
    _population(db)
    _mark(db, [r[0] for r in _table(db, "SELECT route_id FROM route_health")])
    held = LeaderLock(redis_client, s.redis_prefix, job, ttl_ms=10_000)
    assert held.acquire()
    try:
        skipped = run_job(job, s, engine=db, now=NOW)
        assert skipped["status"] == "skipped" and "leader lock" in skipped["reason"]
        assert job not in [r["job"] for r in read_job_status(db)]  # nothing recorded without the lock
    finally:
        held.release()
    ok = run_job(job, s, engine=db, now=NOW)
    assert ok["status"] == "ok", ok
    snapshot = _table(db, f"SELECT * FROM {table} ORDER BY 1, 2")
    assert run_job(job, s, engine=db, now=NOW)["status"] == "ok"
    if job != "reputation":  # reputation drains its dirty marks: the scores are compared in their own test
        assert _table(db, f"SELECT * FROM {table} ORDER BY 1, 2") == snapshot
    with db.begin() as c:
        c.execute(sa.text(f"ALTER TABLE {table} RENAME TO {table}_away"))
    try:
        failed = run_job(job, s, engine=db, now=NOW)
    finally:
        with db.begin() as c:
            c.execute(sa.text(f"ALTER TABLE {table}_away RENAME TO {table}"))
    assert failed["status"] == "error" and table in failed["error"]
    row = _row(db, job)
    assert row["runs_total"] == 3 and row["failures_total"] == 1 and row["last_success_at"] is not None
    assert table in row["last_error"]


def test_stats_commands_show_the_rollups(s, db, monkeypatch):
    import json

    from click.testing import CliRunner

    from magpie.cli import main
    from magpie.config import get_settings

    now = datetime.now(UTC)
    a, _, b, _ = _population(db)
    _check(db, a[0].route_id, now - timedelta(minutes=1), True, 50.0)
    for job in ("workspace_snapshots", "hourly_counts", "source_stats", "workspace_usage"):
        assert run_job(job, s, engine=db)["status"] == "ok"
    for k, v in {"MAGPIE_DATABASE_URL": s.database_url, "MAGPIE_REDIS_URL": s.redis_url,
                 "MAGPIE_REDIS_PREFIX": s.redis_prefix, "PROXY_ENCRYPTION_KEY": KEY, "COLUMNS": "200"}.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    try:
        run = CliRunner().invoke
        tl = json.loads(run(main, ["stats", "timeline", "--json", "-w", "ws-a"]).output)
        assert {(r["protocol"], r["alive"], r["total"]) for r in tl} == {("http", 2, 3), ("socks5", 1, 1)}
        hr = json.loads(run(main, ["stats", "hourly", "--json", "--hours", "2"]).output)
        assert [(r["workspace"], r["checks"]) for r in hr] == [("ws-a", 1)]
        us = json.loads(run(main, ["stats", "usage", "--json"]).output)
        assert {r["workspace"]: r["routes"] for r in us} == {"ws-a": 4, "ws-b": 2}
        assert json.loads(run(main, ["stats", "sources", "--json"]).output) == []  # no import recorded one
        for cmd in ("timeline", "hourly", "sources", "usage"):
            res = run(main, ["stats", cmd])
            assert res.exit_code == 0, res.output
        assert "ws-a" in run(main, ["stats", "timeline"]).output
        assert run(main, ["stats", "status"]).exit_code == 0  # the existing commands stay
    finally:
        get_settings.cache_clear()
