"""The dashboard's stored chart history: job ``dashboard_snapshot`` (beat entry, leader lock, retention)
and the dashboard reading it, against real Redis and PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import sqlalchemy as sa
from fastapi.testclient import TestClient

from magpie.wiring.jobs import run_job

TOKEN = "dashboard-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _client(settings, db, redis_client):
    from magpie.web.app import create_app
    from magpie.web.service import Dashboard

    s = settings.model_copy(update={"web_token": TOKEN})
    app = create_app(s, dashboard=Dashboard(s, redis=redis_client, engine=db), sample=False)
    return TestClient(app, base_url="http://127.0.0.1")


def test_two_passes_of_the_job_make_two_points_without_a_dashboard_running(settings, db, redis_client):
    from magpie.base.counters import record_check_batch

    with _client(settings, db, redis_client) as c:
        assert c.get("/api/series", headers=AUTH).json()["points"] == []
    first = run_job("dashboard_snapshot", settings, engine=db, redis=redis_client)
    assert first["status"] == "ok" and first["result"]["stored"] == 1, first
    record_check_batch(redis_client, settings.redis_prefix, {"alive": 30, "dead": 10}, 0, [])
    assert run_job("dashboard_snapshot", settings, engine=db, redis=redis_client)["status"] == "ok"
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM dashboard_snapshots")).scalar_one() == 2
    with _client(settings, db, redis_client) as c:  # no sampler: the points come from PostgreSQL
        points = c.get("/api/series", headers=AUTH).json()["points"]
        assert len(points) == 2
        assert points[0]["checks_per_s"] is None and points[0]["scheduled"] == 0
        assert points[1]["checks_per_s"] is not None and points[1]["checks_per_s"] > 0
        assert len(c.get("/api/series", headers=AUTH, params={"limit": 1}).json()["points"]) == 1
        page = c.get("/", headers=AUTH)
        assert page.status_code == 200 and "(2 samples shown)" in page.text


def test_snapshots_past_their_retention_are_deleted(settings, db, redis_client):
    old = datetime.now(timezone.utc) - timedelta(days=settings.dashboard_snapshot_retention_days + 1)
    with db.begin() as conn:
        conn.execute(sa.text("INSERT INTO dashboard_snapshots (taken_at, sample) VALUES (:t, '{\"t_ms\": 1}')"),
                     {"t": old})
    got = run_job("dashboard_snapshot", settings, engine=db, redis=redis_client)
    assert got["result"]["deleted"] == 1 and got["result"]["stored"] == 1
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM dashboard_snapshots")).scalar_one() == 1


def test_the_job_has_a_beat_entry_on_the_maintenance_queue_and_its_own_leader_lock(settings, db, redis_client):
    from magpie.coordination.leader import LeaderLock
    from magpie.maintenance.beat import TASK
    from magpie.wiring.jobs import beat_entries

    entry = beat_entries(settings)["maintenance-dashboard_snapshot"]
    assert entry["task"] == TASK and entry["args"] == ["dashboard_snapshot"]
    assert entry["schedule"].total_seconds() == 60
    other = LeaderLock(redis_client, settings.redis_prefix, "dashboard_snapshot")
    assert other.acquire()  # another process leads: this pass does nothing
    try:
        assert run_job("dashboard_snapshot", settings, engine=db, redis=redis_client)["status"] == "skipped"
    finally:
        other.release()
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM dashboard_snapshots")).scalar_one() == 0
