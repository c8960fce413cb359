"""Rollup jobs: workspace snapshots, hourly counts, source statistics and daily workspace usage.

Each job walks the workspaces in id order, a batch (``MAGPIE_MAINTENANCE_BATCH_SIZE`` workspaces) per
transaction, and *replaces* the rows it computes (``INSERT … ON CONFLICT DO UPDATE``): repeating a pass
rewrites the same numbers, never adds to them. A pass stopped by its limits saves a cursor and the next
pass resumes there.

* ``workspace_snapshots`` (every 10 minutes): per workspace and protocol, routes owned (``total``) and
  those whose newest result is alive (``alive``), stamped with the start of the 10-minute slot (UTC).
* ``hourly_counts`` (every 5 minutes): per workspace and UTC hour, checks, alive checks, distinct routes
  checked and alive, from ``check_history``; the current hour and the ``MAGPIE_ROLLUP_LOOKBACK_HOURS``
  before it are recomputed (late results), older hours are closed. The first pass backfills from the
  oldest history within ``MAGPIE_HOURLY_RETENTION_DAYS``. Routes count under their current workspaces.
* ``source_stats`` (every 15 minutes): per workspace and import source, routes, alive, checked, mean
  latency of alive routes and mean reputation; a source whose routes are all gone is written as zeros
  and left to its retention job.
* ``workspace_usage`` (every 15 minutes): per workspace and UTC day, routes and sources owned (as of the
  pass) and the day's checks (summed from ``hourly_counts``); yesterday's checks are brought up to date
  too.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from magpie.maintenance.base import Job, JobContext

SLOT_SECONDS = 600
"""Width of a snapshot slot (seconds)."""

_WORKSPACES = "SELECT id FROM workspaces WHERE id > :after ORDER BY id LIMIT :batch"


def slot_start(now: datetime, seconds: int = SLOT_SECONDS) -> datetime:
    """Start (aware UTC) of the ``seconds``-wide slot holding ``now``."""
    ts = int(now.timestamp()) // seconds * seconds
    return datetime.fromtimestamp(ts, tz=UTC)


def hour_start(now: datetime) -> datetime:
    """Start (aware UTC) of the hour holding ``now``."""
    return slot_start(now, 3600)


def _walk(ctx: JobContext, after: int, batch_fn) -> tuple[int, int, bool]:
    """Call ``batch_fn(conn, workspace_ids)`` per batch of workspaces after id ``after`` (fenced, one
    transaction each) until none is left or the pass must stop. Returns (rows written, last id, complete)."""
    rows = 0
    while not ctx.should_stop():
        with ctx.engine.begin() as conn:
            ctx.fence(conn)
            ws = list(conn.execute(sa.text(_WORKSPACES), {"after": after, "batch": ctx.batch_size}).scalars())
            if ws:
                rows += batch_fn(conn, ws)
        ctx.tick()
        if not ws:
            return rows, after, True
        after = ws[-1]
        if len(ws) < ctx.batch_size:
            return rows, after, True
    return rows, after, False


_SNAPSHOT = """
    INSERT INTO workspace_snapshots (workspace_id, taken_at, protocol, alive, total)
    SELECT rw.workspace_id, CAST(:slot AS timestamptz), r.protocol, count(*) FILTER (WHERE h.alive), count(*)
    FROM route_workspaces rw JOIN routes r ON r.id = rw.route_id LEFT JOIN route_health h ON h.route_id = r.id
    WHERE rw.workspace_id = ANY(CAST(:ws AS integer[]))
    GROUP BY rw.workspace_id, r.protocol
    ON CONFLICT (workspace_id, taken_at, protocol) DO UPDATE SET alive = EXCLUDED.alive,
        total = EXCLUDED.total
"""


class SnapshotJob(Job):
    name = "workspace_snapshots"
    every = float(SLOT_SECONDS)
    description = "10-minute snapshots of alive and total routes per workspace and protocol"

    def run(self, ctx: JobContext) -> dict:
        slot = slot_start(ctx.now)
        st = ctx.state
        after = int(st.get("after") or 0) if st.get("slot") == slot.isoformat() else 0

        def batch(conn, ws):
            return conn.execute(sa.text(_SNAPSHOT), {"slot": slot, "ws": ws}).rowcount

        rows, last, complete = _walk(ctx, after, batch)
        ctx.save_state({"slot": slot.isoformat(), "after": 0 if complete else last})
        return {"slot": slot.isoformat(), "rows": rows, "complete": complete}


_HOURLY = """
    INSERT INTO hourly_counts (workspace_id, hour, checks, alive, routes_checked, routes_alive, updated_at)
    SELECT rw.workspace_id, CAST(:lo AS timestamptz), count(*), count(*) FILTER (WHERE c.alive),
           count(DISTINCT c.route_id), count(DISTINCT c.route_id) FILTER (WHERE c.alive), now()
    FROM check_history c JOIN route_workspaces rw ON rw.route_id = c.route_id
    WHERE c.checked_at >= :lo AND c.checked_at < :hi AND rw.workspace_id = ANY(CAST(:ws AS integer[]))
    GROUP BY rw.workspace_id
    ON CONFLICT (workspace_id, hour) DO UPDATE SET checks = EXCLUDED.checks, alive = EXCLUDED.alive,
        routes_checked = EXCLUDED.routes_checked, routes_alive = EXCLUDED.routes_alive, updated_at = now()
    WHERE (hourly_counts.checks, hourly_counts.alive, hourly_counts.routes_checked,
           hourly_counts.routes_alive)
          IS DISTINCT FROM (EXCLUDED.checks, EXCLUDED.alive, EXCLUDED.routes_checked, EXCLUDED.routes_alive)
"""
_HOUR_HAS_ROWS = "SELECT EXISTS (SELECT 1 FROM check_history WHERE checked_at >= :lo AND checked_at < :hi)"
_OLDEST = "SELECT min(checked_at) FROM check_history WHERE checked_at >= :since"


class HourlyCountsJob(Job):
    name = "hourly_counts"
    every = 300.0
    description = "hourly checks and routes checked per workspace, from check_history (idempotent)"

    def run(self, ctx: JobContext) -> dict:
        s = ctx.settings
        now_hour = hour_start(ctx.now)
        first_open = now_hour - timedelta(hours=int(s.rollup_lookback_hours))
        st = ctx.state
        closed = datetime.fromisoformat(st["closed_through"]) if st.get("closed_through") else None
        if st.get("cursor_hour"):
            hour, after = datetime.fromisoformat(st["cursor_hour"]), int(st.get("cursor_after") or 0)
        elif closed is not None:
            hour, after = min(closed + timedelta(hours=1), first_open), 0
        else:
            since = ctx.now - timedelta(days=int(s.hourly_retention_days))
            with ctx.engine.connect() as conn:
                oldest = conn.execute(sa.text(_OLDEST), {"since": since}).scalar_one()
            hour, after = (min(hour_start(oldest), first_open) if oldest else first_open), 0
        hours = rows = 0
        while hour <= now_hour:
            hi = hour + timedelta(hours=1)
            if after == 0 and hour < first_open:
                with ctx.engine.connect() as conn:
                    if not conn.execute(sa.text(_HOUR_HAS_ROWS), {"lo": hour, "hi": hi}).scalar_one():
                        hour = hi
                        continue

            def batch(conn, ws, lo=hour, hi=hi):
                return conn.execute(sa.text(_HOURLY), {"lo": lo, "hi": hi, "ws": ws}).rowcount

            n, last, complete = _walk(ctx, after, batch)
            rows += n
            if not complete:
                state = {"cursor_hour": hour.isoformat(), "cursor_after": last}
                if closed is not None:
                    state["closed_through"] = closed.isoformat()
                ctx.save_state(state)
                return {"hours": hours, "rows": rows, "resume_hour": hour.isoformat(), "complete": False}
            hours += 1
            hour, after = hi, 0
        new_closed = first_open - timedelta(hours=1)
        if closed is not None and closed > new_closed:
            new_closed = closed
        ctx.save_state({"closed_through": new_closed.isoformat()})
        return {"hours": hours, "rows": rows, "closed_through": new_closed.isoformat(), "complete": True}


_SOURCES = """
    INSERT INTO source_stats (workspace_id, source, routes, alive, checked, latency_avg_ms, score_avg,
                              refreshed_at)
    SELECT s.workspace_id, s.source, count(*), count(*) FILTER (WHERE h.alive), count(h.last_checked_at),
           avg(h.latency_ms) FILTER (WHERE h.alive), avg(rr.score), CAST(:now AS timestamptz)
    FROM route_sources s
    JOIN route_workspaces rw ON rw.route_id = s.route_id AND rw.workspace_id = s.workspace_id
    LEFT JOIN route_health h ON h.route_id = s.route_id
    LEFT JOIN route_reputation rr ON rr.route_id = s.route_id
    WHERE s.workspace_id = ANY(CAST(:ws AS integer[]))
    GROUP BY s.workspace_id, s.source
    ON CONFLICT (workspace_id, source) DO UPDATE SET routes = EXCLUDED.routes, alive = EXCLUDED.alive,
        checked = EXCLUDED.checked, latency_avg_ms = EXCLUDED.latency_avg_ms, score_avg = EXCLUDED.score_avg,
        refreshed_at = EXCLUDED.refreshed_at
"""
_SOURCES_GONE = """
    UPDATE source_stats SET routes = 0, alive = 0, checked = 0, latency_avg_ms = NULL, score_avg = NULL
    WHERE workspace_id = ANY(CAST(:ws AS integer[])) AND refreshed_at < :now AND routes > 0
"""


class SourceStatsJob(Job):
    name = "source_stats"
    every = 900.0
    description = "per-source statistics of each workspace (routes, alive, latency, reputation)"

    def run(self, ctx: JobContext) -> dict:
        after = int(ctx.state.get("after") or 0)

        def batch(conn, ws):
            n = conn.execute(sa.text(_SOURCES), {"now": ctx.now, "ws": ws}).rowcount
            return n + conn.execute(sa.text(_SOURCES_GONE), {"now": ctx.now, "ws": ws}).rowcount

        rows, last, complete = _walk(ctx, after, batch)
        ctx.save_state({"after": 0 if complete else last})
        return {"rows": rows, "complete": complete}


_USAGE = """
    INSERT INTO workspace_usage (workspace_id, day, routes, sources, checks, alive_checks, updated_at)
    SELECT w.id, CAST(:day AS date),
           (SELECT count(*) FROM route_workspaces rw WHERE rw.workspace_id = w.id),
           (SELECT count(DISTINCT s.source) FROM route_sources s JOIN route_workspaces rw
                ON rw.route_id = s.route_id AND rw.workspace_id = s.workspace_id WHERE s.workspace_id = w.id),
           COALESCE(hc.checks, 0), COALESCE(hc.alive, 0), now()
    FROM workspaces w
    LEFT JOIN (SELECT workspace_id, sum(checks) AS checks, sum(alive) AS alive FROM hourly_counts
               WHERE hour >= :lo AND hour < :hi GROUP BY workspace_id) hc ON hc.workspace_id = w.id
    WHERE w.id = ANY(CAST(:ws AS integer[]))
    ON CONFLICT (workspace_id, day) DO UPDATE SET routes = EXCLUDED.routes, sources = EXCLUDED.sources,
        checks = EXCLUDED.checks, alive_checks = EXCLUDED.alive_checks, updated_at = now()
    WHERE (workspace_usage.routes, workspace_usage.sources, workspace_usage.checks,
           workspace_usage.alive_checks)
          IS DISTINCT FROM (EXCLUDED.routes, EXCLUDED.sources, EXCLUDED.checks, EXCLUDED.alive_checks)
"""
_USAGE_CHECKS = """
    UPDATE workspace_usage u SET checks = hc.checks, alive_checks = hc.alive, updated_at = now()
    FROM (SELECT workspace_id, sum(checks) AS checks, sum(alive) AS alive FROM hourly_counts
          WHERE hour >= :lo AND hour < :hi GROUP BY workspace_id) hc
    WHERE u.workspace_id = hc.workspace_id AND u.day = CAST(:day AS date)
      AND u.workspace_id = ANY(CAST(:ws AS integer[]))
      AND (u.checks, u.alive_checks) IS DISTINCT FROM (hc.checks::int, hc.alive::int)
"""


class WorkspaceUsageJob(Job):
    name = "workspace_usage"
    every = 900.0
    description = "daily usage per workspace: routes and sources owned, checks run (from hourly_counts)"

    def run(self, ctx: JobContext) -> dict:
        day_lo = slot_start(ctx.now, 86400)
        today = day_lo.date()
        after = int(ctx.state.get("after") or 0) if ctx.state.get("day") == today.isoformat() else 0
        y_lo = day_lo - timedelta(days=1)

        def batch(conn, ws):
            n = conn.execute(sa.text(_USAGE), {"day": today, "lo": day_lo, "hi": day_lo + timedelta(days=1),
                                               "ws": ws}).rowcount
            return n + conn.execute(sa.text(_USAGE_CHECKS), {"day": y_lo.date(), "lo": y_lo, "hi": day_lo,
                                                             "ws": ws}).rowcount

        rows, last, complete = _walk(ctx, after, batch)
        ctx.save_state({"day": today.isoformat(), "after": 0 if complete else last})
        return {"day": today.isoformat(), "rows": rows, "complete": complete}


SNAPSHOTS = SnapshotJob()
HOURLY = HourlyCountsJob()
SOURCES = SourceStatsJob()
USAGE = WorkspaceUsageJob()
JOBS = (SNAPSHOTS, HOURLY, SOURCES, USAGE)
"""The rollup jobs in the order they run (usage reads the hourly counts)."""
