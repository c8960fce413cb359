"""Job ``daily_rollup``: compact ``check_history`` into per-route, per-UTC-day counts (``route_daily``).

For each day, for each batch of routes (``MAGPIE_MAINTENANCE_BATCH_SIZE`` route ids), one transaction
recomputes ``checks``, ``alive``, ``latency_sum_ms`` and ``latency_count`` from that day's history and
*replaces* the stored row (``INSERT … ON CONFLICT DO UPDATE``): recomputing is idempotent, so a pass that
is interrupted or repeated never double counts.

Days recomputed by a pass: today (partial) and the ``MAGPIE_ROLLUP_LOOKBACK_DAYS`` days before it
(results ingested late still land there). Older days are closed once compacted (``closed_through`` in
the job state) and never recomputed, so history retention cannot erase their counters. The first pass
starts from the oldest day in history (backfill). A pass stopped by its limits saves a cursor
(``cursor_day``, ``cursor_after`` route id) and the next pass resumes there.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import sqlalchemy as sa

from magpie.maintenance.base import Job, JobContext

_UPSERT = """
    INSERT INTO route_daily (route_id, day, checks, alive, latency_sum_ms, latency_count, updated_at)
    SELECT route_id, CAST(:day AS date), count(*), count(*) FILTER (WHERE alive),
           COALESCE(sum(latency_ms::float8), 0), count(latency_ms), now()
    FROM check_history
    WHERE checked_at >= :lo AND checked_at < :hi AND route_id > :after AND route_id <= :upto
    GROUP BY route_id
    ON CONFLICT (route_id, day) DO UPDATE SET
        checks = EXCLUDED.checks, alive = EXCLUDED.alive, latency_sum_ms = EXCLUDED.latency_sum_ms,
        latency_count = EXCLUDED.latency_count, updated_at = now()
    WHERE (route_daily.checks, route_daily.alive, route_daily.latency_sum_ms, route_daily.latency_count)
          IS DISTINCT FROM (EXCLUDED.checks, EXCLUDED.alive, EXCLUDED.latency_sum_ms, EXCLUDED.latency_count)
"""
_UPTO = "SELECT max(id) FROM (SELECT id FROM routes WHERE id > :after ORDER BY id LIMIT :n) s"
_DAY_HAS_ROWS = "SELECT EXISTS (SELECT 1 FROM check_history WHERE checked_at >= :lo AND checked_at < :hi)"


def _bounds(day: date) -> tuple[datetime, datetime]:
    lo = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return lo, lo + timedelta(days=1)


def compact_day(conn: sa.Connection, day: date, after: int, upto: int) -> int:
    """Recompute ``route_daily`` of ``day`` (UTC) for route ids in ``(after, upto]``; returns rows written."""
    lo, hi = _bounds(day)
    return conn.execute(
        sa.text(_UPSERT), {"day": day, "lo": lo, "hi": hi, "after": int(after), "upto": int(upto)}
    ).rowcount


class DailyRollupJob(Job):
    name = "daily_rollup"
    every = 900.0
    description = "compact check_history into route_daily per-route per-day counters (idempotent)"

    def run(self, ctx: JobContext) -> dict:
        today = ctx.now.astimezone(UTC).date()
        first_open = today - timedelta(days=int(ctx.settings.rollup_lookback_days))
        st = ctx.state
        closed = date.fromisoformat(st["closed_through"]) if st.get("closed_through") else None
        if st.get("cursor_day"):
            day, after = date.fromisoformat(st["cursor_day"]), int(st.get("cursor_after") or 0)
        else:
            after = 0
            if closed is not None:
                day = min(closed + timedelta(days=1), first_open)
            else:
                with ctx.engine.connect() as conn:
                    oldest = conn.execute(sa.text("SELECT min(checked_at) FROM check_history")).scalar_one()
                day = min(oldest.astimezone(UTC).date(), first_open) if oldest else first_open
        days = rows = 0
        while day <= today:
            if after == 0:
                lo, hi = _bounds(day)
                with ctx.engine.connect() as conn:
                    if not conn.execute(sa.text(_DAY_HAS_ROWS), {"lo": lo, "hi": hi}).scalar_one():
                        day += timedelta(days=1)
                        continue
            while True:
                if ctx.should_stop():
                    ctx.save_state({**_closed(closed), "cursor_day": day.isoformat(), "cursor_after": after})
                    return {"days": days, "rows": rows, "resume_day": day.isoformat(), "complete": False}
                with ctx.engine.begin() as conn:
                    upto = conn.execute(sa.text(_UPTO), {"after": after, "n": ctx.batch_size}).scalar_one()
                    if upto is None:
                        break
                    rows += compact_day(conn, day, after, upto)
                ctx.tick()
                after = upto
            days += 1
            day += timedelta(days=1)
            after = 0
        new_closed = first_open - timedelta(days=1)
        if closed is not None and closed > new_closed:
            new_closed = closed
        ctx.save_state({"closed_through": new_closed.isoformat()})
        return {"days": days, "rows": rows, "closed_through": new_closed.isoformat(), "complete": True}


def _closed(closed: date | None) -> dict:
    return {"closed_through": closed.isoformat()} if closed else {}


JOB = DailyRollupJob()
