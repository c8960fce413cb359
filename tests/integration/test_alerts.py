"""Alert rules and evaluation against real PostgreSQL, with time driven by explicit ``now`` arguments.

Measurements are written straight into ``route_health`` / ``check_history`` (what ingestion would have
recorded); evaluation must only read them.
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from magpie.alerts import (
    create_email_channel,
    create_rule,
    edit_rule,
    evaluate_all,
    evaluate_workspace,
    get_rule,
    list_rules,
    set_enabled,
)
from magpie.alerts.evaluate import apply_workspace, measure_workspace, run_evaluation
from magpie.alerts.rules import RuleConflict

T0 = datetime(2025, 3, 1, 12, 0, 30, tzinfo=UTC)


def minute(n: int, seconds: int = 0) -> datetime:
    return T0 + timedelta(minutes=n, seconds=seconds)


# ------------------------------------------------------------------------------------------ seeding


def make_workspace(db, name: str = "acme") -> int:
    with db.begin() as c:
        return c.execute(sa.text("INSERT INTO workspaces (name) VALUES (:n) RETURNING id"), {"n": name}).scalar_one()


def make_routes(db, ws: int, n: int, protocol: str = "http") -> list[int]:
    ids = []
    with db.begin() as c:
        for i in range(n):
            rid = c.execute(
                sa.text("INSERT INTO routes (route_hash, protocol, host, port) VALUES (:h, :p, '10.0.0.1', :port) "
                        "RETURNING id"),
                {"h": uuid.uuid4().hex[:24], "p": protocol, "port": 1000 + i},
            ).scalar_one()
            c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) VALUES (:r, :w)"),
                      {"r": rid, "w": ws})
            ids.append(rid)
    return ids


def set_health(db, route_ids, *, alive: bool, at: datetime) -> None:
    with db.begin() as c:
        for rid in route_ids:
            c.execute(
                sa.text(
                    """
                    INSERT INTO route_health (route_id, last_checked_at, alive, latency_ms)
                    VALUES (:r, :t, :a, 100)
                    ON CONFLICT (route_id) DO UPDATE SET last_checked_at = :t, alive = :a
                    """
                ),
                {"r": rid, "t": at, "a": alive},
            )


def add_history(db, route_ids, *, at: datetime, alive: bool, latency_ms: float | None = 100.0, times: int = 1):
    with db.begin() as c:
        c.execute(
            sa.text("INSERT INTO check_history (route_id, checked_at, alive, latency_ms) "
                    "SELECT r, :t - make_interval(secs => g), :a, :l FROM unnest(CAST(:ids AS bigint[])) r, "
                    "generate_series(0, :k - 1) g"),
            {"ids": list(route_ids), "t": at, "a": alive, "l": latency_ms, "k": times},
        )


def state(db, rule_id: int) -> dict:
    with db.connect() as c:
        return dict(c.execute(sa.text("SELECT * FROM alert_rule_state WHERE rule_id = :r"), {"r": rule_id})
                    .mappings().one())


def count(db, sql: str, **params) -> int:
    with db.connect() as c:
        return c.execute(sa.text(sql), params).scalar_one()


@pytest.fixture
def ws(db):
    return make_workspace(db)


# ------------------------------------------------------------------------------------------ rules API


def test_rule_crud_bumps_revision_and_validates(db, ws):
    r = create_rule(db, "acme", "few usable", "usable_routes", 3)
    assert (r.revision, r.enabled, r.min_samples, r.percentile, r.status) == (1, True, 1, None, "ok")
    lat = create_rule(db, ws, "slow socks", "latency", 800, protocols=["socks5", "SOCKS4"])
    assert lat.percentile == 95 and lat.protocols == ["socks4", "socks5"] and lat.min_samples == 10
    assert lat.describe() == "p95 latency > 800 ms (socks4,socks5)"

    r2 = edit_rule(db, r.id, threshold=5, expected_revision=1)
    assert (r2.threshold, r2.revision) == (5.0, 2)
    assert set_enabled(db, r.id, False).revision == 3 and not get_rule(db, r.id).enabled
    with pytest.raises(RuleConflict):
        edit_rule(db, r.id, threshold=1, expected_revision=2)
    assert get_rule(db, r.id).threshold == 5.0
    edit_rule(db, lat.id, protocols=None, percentile=50)
    assert get_rule(db, lat.id).protocols is None and get_rule(db, lat.id).percentile == 50
    assert [x.name for x in list_rules(db, "acme")] == ["few usable", "slow socks"]

    for bad in (
        dict(kind="success_rate", threshold=150),
        dict(kind="latency", threshold=100, percentile=99),
        dict(kind="usable_routes", threshold=1, percentile=50),
        dict(kind="usable_routes", threshold=1, protocols=["ftp"]),
        dict(kind="nope", threshold=1),
        dict(kind="success_rate", threshold=90, freshness_s=60),
    ):
        with pytest.raises(ValueError):
            create_rule(db, ws, f"bad-{uuid.uuid4().hex[:6]}", **bad)
    with pytest.raises(ValueError):
        create_rule(db, ws, "few usable", "usable_routes", 1)  # duplicate name
    with pytest.raises(LookupError):
        create_rule(db, "no-such-workspace", "x", "usable_routes", 1)


# ------------------------------------------------------------------------------------------ evaluation


def test_incident_opens_after_two_breached_minutes_and_recovers_after_two_healthy(db, ws, settings):
    routes = make_routes(db, ws, 5)
    rule = create_rule(db, ws, "usable", "usable_routes", 3)
    create_email_channel(db, ws, "oncall", "oncall@example.test")
    set_health(db, routes[:1], alive=True, at=minute(0, -10))
    set_health(db, routes[1:], alive=False, at=minute(0, -10))

    rep = evaluate_all(db, settings, now=minute(0))
    assert rep.outcomes["breach"] == 1 and rep.transitions == []
    rep = evaluate_all(db, settings, now=minute(0, 20))  # same minute: not a second breached minute
    assert rep.transitions == [] and state(db, rule.id)["breach_minutes"] == 1
    rep = evaluate_all(db, settings, now=minute(1))
    assert [t.event for t in rep.transitions] == ["incident.opened"]
    inc = rep.transitions[0].incident_id
    assert state(db, rule.id)["status"] == "open" and state(db, rule.id)["open_incident_id"] == inc
    assert count(db, "SELECT count(*) FROM email_outbox WHERE kind = 'alert' AND subject LIKE '%OPEN%'") == 1

    evaluate_all(db, settings, now=minute(2))  # still breached: no second incident
    assert count(db, "SELECT count(*) FROM alert_incidents") == 1

    set_health(db, routes, alive=True, at=minute(3, -5))
    assert evaluate_all(db, settings, now=minute(3)).transitions == []  # one healthy minute
    assert state(db, rule.id)["status"] == "open"
    rep = evaluate_all(db, settings, now=minute(4))
    assert [(t.event, t.incident_id) for t in rep.transitions] == [("incident.recovered", inc)]
    with db.connect() as c:
        st, rec = c.execute(sa.text("SELECT status, recovered_at FROM alert_incidents WHERE id = :i"),
                            {"i": inc}).one()
    assert st == "recovered" and rec == minute(4)
    assert state(db, rule.id)["status"] == "ok"
    assert count(db, "SELECT count(*) FROM email_outbox WHERE subject LIKE '%RECOVERED%'") == 1


def test_unknown_on_missing_data_neither_opens_nor_recovers(db, ws, settings):
    routes = make_routes(db, ws, 4)
    rate = create_rule(db, ws, "success", "success_rate", 90, min_samples=5)
    usable = create_rule(db, ws, "usable", "usable_routes", 2)

    # no history, no health at all: Unknown, minute after minute
    for m in range(4):
        rep = evaluate_all(db, settings, now=minute(m))
        assert rep.outcomes == {"breach": 0, "healthy": 0, "unknown": 2}
    assert count(db, "SELECT count(*) FROM alert_incidents") == 0
    assert "min_samples" in state(db, rate.id)["last_reason"]

    # too few samples (3 < 5) is Unknown as well, even though every check failed
    add_history(db, routes[:3], at=minute(4, -10), alive=False)
    evaluate_all(db, settings, now=minute(4))
    assert state(db, rate.id)["last_outcome"] == "unknown" and state(db, rate.id)["last_samples"] == 3

    # after Unknown minutes a breach starts a new streak
    add_history(db, routes, at=minute(5, -10), alive=False, times=3)
    # stale health data for the usable rule: its routes' checks are older than the freshness window
    set_health(db, routes, alive=False, at=minute(5) - timedelta(seconds=settings.alert_freshness_seconds + 1))
    evaluate_all(db, settings, now=minute(5))
    assert state(db, rate.id)["breach_minutes"] == 1 and state(db, rate.id)["status"] == "ok"
    assert state(db, usable.id)["last_outcome"] == "unknown"

    # open the success-rate incident, then lose all data: it stays open through Unknown minutes
    evaluate_all(db, settings, now=minute(6))
    assert state(db, rate.id)["status"] == "open"
    later = minute(6) + timedelta(seconds=settings.alert_window_seconds + 60)
    for m in range(3):
        evaluate_all(db, settings, now=later + timedelta(minutes=m))
        assert state(db, rate.id)["status"] == "open" and state(db, rate.id)["last_outcome"] == "unknown"
    assert count(db, "SELECT count(*) FROM alert_incidents WHERE status = 'open'") == 1

    # two healthy minutes recover it
    back = later + timedelta(minutes=3)
    add_history(db, routes, at=back - timedelta(seconds=5), alive=True, times=5)
    evaluate_all(db, settings, now=back)
    rep = evaluate_all(db, settings, now=back + timedelta(minutes=1))
    assert [t.event for t in rep.transitions if t.rule_id == rate.id] == ["incident.recovered"]


def test_measurement_error_is_unknown_and_other_queries_still_count(db, ws, settings):
    routes = make_routes(db, ws, 3)
    set_health(db, routes, alive=False, at=minute(0, -5))
    add_history(db, routes, at=minute(0, -5), alive=False, times=5)
    rate = create_rule(db, ws, "success", "success_rate", 90)
    usable = create_rule(db, ws, "usable", "usable_routes", 1)
    fast = settings.model_copy(update={"alert_query_timeout_ms": 100})

    locker = sa.create_engine(db.url)
    try:
        with locker.connect() as c:
            c.execute(sa.text("LOCK TABLE check_history IN ACCESS EXCLUSIVE MODE"))  # history reads now time out
            rep = evaluate_all(db, fast, now=minute(0))
            c.rollback()
    finally:
        locker.dispose()
    assert rep.outcomes == {"breach": 1, "healthy": 0, "unknown": 1}
    assert state(db, rate.id)["last_reason"].startswith("measurement error")
    assert state(db, usable.id)["last_outcome"] == "breach"


def test_latency_percentiles_and_protocol_filters_batched_in_few_queries(db, ws, settings):
    http = make_routes(db, ws, 2, "http")
    socks = make_routes(db, ws, 2, "socks5")
    add_history(db, http, at=minute(0, -5), alive=True, latency_ms=100, times=5)
    add_history(db, socks, at=minute(0, -5), alive=True, latency_ms=1000, times=5)
    add_history(db, socks, at=minute(0, -5), alive=False, latency_ms=None, times=5)
    rules = {
        "http p95": create_rule(db, ws, "http p95", "latency", 500, percentile=95, protocols=["http"]),
        "socks p95": create_rule(db, ws, "socks p95", "latency", 500, percentile=95, protocols=["socks5"]),
        "all p50": create_rule(db, ws, "all p50", "latency", 500, percentile=50),
        "socks rate": create_rule(db, ws, "socks rate", "success_rate", 60, protocols=["socks5"]),
        "all rate": create_rule(db, ws, "all rate", "success_rate", 60),
    }
    statements: list[str] = []

    def spy(conn, cursor, statement, *a):
        if "set_config" not in statement:
            statements.append(statement)

    sa.event.listen(db, "before_cursor_execute", spy)
    try:
        snap = measure_workspace(db, ws, settings, now=minute(0))
    finally:
        sa.event.remove(db, "before_cursor_execute", spy)
    assert len(statements) == 2  # the rules, then one history query for five rules
    got = {name: snap.measurements[r.id] for name, r in rules.items()}
    assert (got["http p95"].outcome, got["http p95"].value, got["http p95"].samples) == ("healthy", 100.0, 10)
    assert (got["socks p95"].outcome, got["socks p95"].value) == ("breach", 1000.0)
    assert got["all p50"].outcome == "breach" and got["all p50"].value == pytest.approx(550.0)
    assert (got["socks rate"].outcome, got["socks rate"].value) == ("breach", 50.0)
    assert got["all rate"].outcome == "healthy" and got["all rate"].value == pytest.approx(200 / 3)


def test_data_after_now_and_other_workspaces_are_ignored(db, ws, settings):
    mine = make_routes(db, ws, 2)
    other_ws = make_workspace(db, "other")
    theirs = make_routes(db, other_ws, 2)
    add_history(db, theirs, at=minute(0, -5), alive=False, times=20)
    add_history(db, mine, at=minute(0, 30), alive=False, times=20)  # recorded after "now"
    add_history(db, mine, at=minute(0, -5), alive=True, times=10)
    rule = create_rule(db, ws, "rate", "success_rate", 90)
    snap = measure_workspace(db, ws, settings, now=minute(0))
    assert (snap.measurements[rule.id].value, snap.measurements[rule.id].samples) == (100.0, 20)


def test_rule_edited_during_evaluation_is_not_overwritten(db, ws, settings):
    routes = make_routes(db, ws, 3)
    set_health(db, routes, alive=False, at=minute(0, -5))
    rule = create_rule(db, ws, "usable", "usable_routes", 2)
    evaluate_all(db, settings, now=minute(0))  # one breached minute
    gen = state(db, rule.id)["generation"]

    snap = measure_workspace(db, ws, settings, now=minute(1))  # would be the second breached minute
    edited = edit_rule(db, rule.id, threshold=1, name="usable (relaxed)")  # an operator edits meanwhile
    rep = apply_workspace(db, snap, settings)
    assert (rep.applied, rep.stale, rep.transitions) == (0, 1, [])
    assert state(db, rule.id)["generation"] == gen  # the stale measurement wrote nothing
    assert count(db, "SELECT count(*) FROM alert_incidents") == 0
    now_rule = get_rule(db, rule.id)
    assert (now_rule.threshold, now_rule.name, now_rule.revision) == (1.0, "usable (relaxed)", edited.revision)

    # fresh evaluations apply to the new revision, whose breach streak starts over
    rep = evaluate_all(db, settings, now=minute(1))
    assert (rep.applied, rep.stale, rep.transitions) == (1, 0, [])
    st = state(db, rule.id)
    assert (st["rule_revision"], st["last_outcome"], st["breach_minutes"]) == (edited.revision, "breach", 1)
    assert [t.event for t in evaluate_all(db, settings, now=minute(2)).transitions] == ["incident.opened"]


def test_concurrent_evaluators_apply_a_minute_once(db, ws, settings):
    routes = make_routes(db, ws, 3)
    set_health(db, routes, alive=False, at=minute(0, -5))
    rule = create_rule(db, ws, "usable", "usable_routes", 2)
    evaluate_all(db, settings, now=minute(0))
    a = measure_workspace(db, ws, settings, now=minute(1))
    b = measure_workspace(db, ws, settings, now=minute(1))
    results = []
    threads = [threading.Thread(target=lambda s=s: results.append(apply_workspace(db, s, settings))) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted((r.applied, r.stale) for r in results) == [(0, 1), (1, 0)]
    assert sum(len(r.transitions) for r in results) == 1
    assert count(db, "SELECT count(*) FROM alert_incidents WHERE rule_id = :r", r=rule.id) == 1


def test_disabled_rule_is_not_evaluated(db, ws, settings):
    routes = make_routes(db, ws, 2)
    set_health(db, routes, alive=False, at=minute(0, -5))
    rule = create_rule(db, ws, "usable", "usable_routes", 2)
    set_enabled(db, rule.id, False)
    for m in range(3):
        assert evaluate_all(db, settings, now=minute(m)).rules == 0
    assert state(db, rule.id)["last_outcome"] is None


def test_evaluation_runs_under_its_leader_lock(db, ws, settings, redis_client):
    from magpie.coordination.leader import LeaderLock

    routes = make_routes(db, ws, 2)
    set_health(db, routes, alive=False, at=minute(0, -5))
    create_rule(db, ws, "usable", "usable_routes", 2)
    other = LeaderLock(redis_client, settings.redis_prefix, "alerts", 5000)
    assert other.acquire()
    assert run_evaluation(redis_client, db, settings, now=minute(0)) is None
    other.release()
    rep = run_evaluation(redis_client, db, settings, now=minute(0))
    assert rep is not None and rep.applied == 1
    assert not redis_client.exists(other.key)  # released after the pass


def test_evaluation_adds_no_queue_work(db, ws, settings, redis_client):
    routes = make_routes(db, ws, 2)
    set_health(db, routes, alive=False, at=minute(0, -5))
    create_rule(db, ws, "usable", "usable_routes", 2)
    evaluate_workspace(db, ws, settings, now=minute(0))
    assert list(redis_client.scan_iter(match=settings.redis_prefix + "*")) == []


# ------------------------------------------------------------------------------------------ wiring


def test_beat_entries_and_task_routes(settings):
    from magpie.alerts.beat import beat_entries
    from magpie.wiring.celery_config import build

    entries = beat_entries(settings)
    assert {e["task"] for e in entries.values()} == {
        "magpie.alerts.evaluate", "magpie.delivery.drain", "magpie.email.drain", "magpie.email.housekeeping"}
    assert all(e["options"]["expires"] >= 1 for e in entries.values())
    assert entries["alerts-evaluate"]["schedule"] == timedelta(seconds=60)
    conf = build(settings)
    assert set(entries) <= set(conf["beat_schedule"])
    import magpie.wiring.tasks  # noqa: F401 - registers the tasks
    from magpie.wiring.celery_app import app

    assert {e["task"] for e in entries.values()} <= set(app.tasks)


def test_cli_rules_and_channels(db, ws, settings, monkeypatch):
    from magpie import config
    from magpie.cli import main

    monkeypatch.setenv("MAGPIE_DATABASE_URL", str(db.url.render_as_string(hide_password=False)))
    config.get_settings.cache_clear()
    try:
        run = CliRunner().invoke
        res = run(main, ["alerts", "rules", "create", "-w", "acme", "slow", "--kind", "latency", "--threshold", "700",
                         "--percentile", "50", "--protocol", "socks5"])
        assert res.exit_code == 0, res.output
        rid = get_rule(db, list_rules(db, ws)[0].id).id
        assert run(main, ["alerts", "rules", "edit", str(rid), "--threshold", "900"]).exit_code == 0
        assert run(main, ["alerts", "rules", "disable", str(rid)]).exit_code == 0
        res = run(main, ["alerts", "rules", "list", "--json"])
        assert '"threshold": 900.0' in res.output and '"enabled": false' in res.output
        res = run(main, ["alerts", "rules", "create", "-w", "acme", "bad", "--kind", "success_rate",
                         "--threshold", "120"])
        assert res.exit_code != 0 and "percentage" in res.output
        res = run(main, ["alerts", "channels", "add-webhook", "-w", "acme", "hook", "http://10.1.2.3/hook"])
        assert res.exit_code != 0 and "private" in res.output
        assert run(main, ["alerts", "channels", "add-email", "-w", "acme", "mail", "ops@example.test"]).exit_code == 0
        assert run(main, ["outbox", "status", "--json"]).exit_code == 0
    finally:
        config.get_settings.cache_clear()


def test_transition_state_and_notifications_commit_together(db, ws, settings, monkeypatch):
    import magpie.alerts.evaluate as evaluate

    routes = make_routes(db, ws, 2)
    set_health(db, routes, alive=False, at=minute(0, -5))
    rule = create_rule(db, ws, "usable", "usable_routes", 2)
    create_email_channel(db, ws, "oncall", "oncall@example.test")
    evaluate_all(db, settings, now=minute(0))
    gen = state(db, rule.id)["generation"]

    def broken(*a, **kw):
        raise RuntimeError("outbox insert failed")

    monkeypatch.setattr(evaluate, "enqueue", broken)
    rep = evaluate_all(db, settings, now=minute(1))
    assert rep.errors == 1 and rep.transitions == []
    assert state(db, rule.id)["generation"] == gen and state(db, rule.id)["status"] == "ok"
    assert count(db, "SELECT count(*) FROM alert_incidents") == 0
    monkeypatch.undo()
    rep = evaluate_all(db, settings, now=minute(1))  # the next pass applies the same minute in full
    assert [(t.event, t.emails) for t in rep.transitions] == [("incident.opened", 1)]


def test_celery_tasks_call_into_the_packages(db, ws, settings, redis_client, monkeypatch):
    from magpie.wiring import runtime, tasks

    monkeypatch.setattr(runtime, "settings", lambda: settings)
    monkeypatch.setattr(runtime, "engine", lambda: db)
    monkeypatch.setattr(runtime, "redis_client", lambda: redis_client)
    create_rule(db, ws, "usable", "usable_routes", 1)
    assert tasks.alerts_evaluate()["rules"] == 1
    assert tasks.delivery_drain() == {}
    assert tasks.email_drain() == {}
    assert tasks.email_housekeeping() == {"returned": 0, "failed": 0}
