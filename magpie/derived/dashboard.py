"""Stored history of the dashboard's charts: job ``dashboard_snapshot`` and its reads.

Every pass (default every 60 s, ``MAGPIE_MAINTENANCE_CADENCES`` overrides it; leader-locked like every
maintenance job, so one pass per cadence however many beats run) takes one chart sample
(:func:`magpie.observability.samples.take_sample`: cumulative check counters and the schedule's totals) and stores
it in ``dashboard_snapshots``, then deletes snapshots older than
``MAGPIE_DASHBOARD_SNAPSHOT_RETENTION_DAYS``. The charts thus have history whether or not a ``magpie web``
runs; the dashboard reads these rows first (:meth:`magpie.web.service.Dashboard.chart_points`) and its
in-Redis ring only while none is stored.
"""

from __future__ import annotations

import json
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.maintenance.base import Job, JobContext, batched_delete, table_exists

_PURGE = """
    DELETE FROM dashboard_snapshots WHERE id = ANY(ARRAY(
        SELECT id FROM dashboard_snapshots WHERE taken_at < :cutoff LIMIT :batch))
"""
_GAUGES = ("due_now", "leased", "scheduled", "dead", "oldest_lateness_s")


class DashboardSnapshotJob(Job):
    """Store one chart sample per pass; drop samples past their retention."""

    name = "dashboard_snapshot"
    every = 60.0
    description = "store one dashboard chart sample in PostgreSQL; drop samples past their retention"

    def run(self, ctx: JobContext) -> dict:
        from magpie.observability.samples import take_sample

        with ctx.engine.connect() as conn:
            if not table_exists(conn, "dashboard_snapshots"):
                return {"stored": 0, "deleted": 0, "complete": True, "skipped": "no dashboard_snapshots table"}
        sample = take_sample(ctx.redis, ctx.settings.redis_prefix, ctx.queue())
        with ctx.engine.begin() as conn:
            ctx.fence(conn)
            conn.execute(sa.text("INSERT INTO dashboard_snapshots (sample) VALUES (CAST(:s AS jsonb))"),
                         {"s": json.dumps(sample, separators=(",", ":"))})
        ctx.tick()
        cutoff = ctx.now - timedelta(days=int(ctx.settings.dashboard_snapshot_retention_days))
        deleted, complete = batched_delete(ctx, _PURGE, {"cutoff": cutoff})
        return {"stored": 1, "deleted": deleted, "cutoff": cutoff.isoformat(), "complete": complete}


JOB = DashboardSnapshotJob()


def read_snapshots(engine: Engine, limit: int) -> list[dict]:
    """The newest ``limit`` stored samples, oldest first (empty without the table).

    Raises ``sqlalchemy.exc.DBAPIError`` when PostgreSQL cannot be read."""
    with engine.connect() as conn:
        if not table_exists(conn, "dashboard_snapshots"):
            return []
        rows = conn.execute(sa.text("SELECT sample FROM dashboard_snapshots ORDER BY taken_at DESC, id DESC "
                                    "LIMIT :n"), {"n": int(limit)}).scalars().all()
    out = [r for r in rows if isinstance(r, dict) and "t_ms" in r]
    out.reverse()
    return out


def history_points(samples: list[dict]) -> list[dict]:
    """One chart point per stored sample (oldest first), in the shape of :func:`magpie.observability.samples.series`:
    the first has the schedule's gauges and no rates (there is no sample before it to subtract)."""
    from magpie.observability.samples import series

    if not samples:
        return []
    first = {"t_ms": samples[0]["t_ms"], "checks_per_s": None, "lateness_mean_s": None,
             "lateness_p50_s": None, "lateness_p99_s": None}
    for k in _GAUGES:
        first[k] = samples[0].get(k)
    return [first, *series(samples)]


__all__ = ["DashboardSnapshotJob", "JOB", "history_points", "read_snapshots"]
