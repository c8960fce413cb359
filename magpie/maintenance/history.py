"""Job ``history_retention``: bound check history and daily counters.

* ``check_history`` partitions (monthly or daily, ``MAGPIE_PARTITION_SPAN``) whose whole range ends before
  ``now - MAGPIE_HISTORY_RETENTION_DAYS`` are dropped (``DROP TABLE``, one partition per batch): whole
  partitions go, no row-by-row delete, so history is kept for between the retention and the retention
  plus one span (a month, or a day).
* Rows older than the cutoff that sit in the DEFAULT partition are deleted in batches.
* ``route_daily`` rows older than ``MAGPIE_DAILY_RETENTION_DAYS`` are deleted in batches.

There are no snapshot or timeline tables in magpie yet: history retention (here), body retention
(:mod:`magpie.maintenance.bodies`) and replay-ledger retirement (:mod:`magpie.stats.ledger`) cover
the time-series data that exists.
"""

from __future__ import annotations

from datetime import timedelta

from magpie.maintenance.base import Job, JobContext, batched_delete
from magpie.maintenance.partitions import DEFAULT, LOCK_TIMEOUT, list_partitions


class HistoryRetentionJob(Job):
    name = "history_retention"
    every = 3600.0
    description = "drop check_history partitions past retention; trim DEFAULT rows and old daily counters"

    def run(self, ctx: JobContext) -> dict:
        s = ctx.settings
        cutoff = ctx.now - timedelta(days=int(s.history_retention_days))
        dropped: list[str] = []
        with ctx.engine.begin() as conn:
            parts = list_partitions(conn)
        for p in parts:
            if p.is_default or p.upper is None or p.upper > cutoff:
                continue
            if ctx.should_stop():
                return {"dropped": dropped, "default_deleted": 0, "daily_deleted": 0, "complete": False}
            with ctx.engine.begin() as conn:
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {p.name}")
            ctx.tick()
            dropped.append(p.name)

        default_deleted, complete = 0, True
        if any(p.is_default for p in parts):
            default_deleted, complete = batched_delete(
                ctx,
                f"""DELETE FROM {DEFAULT} WHERE ctid = ANY(ARRAY(
                        SELECT ctid FROM {DEFAULT} WHERE checked_at < :cutoff LIMIT :batch))""",
                {"cutoff": cutoff},
            )
        daily_deleted = 0
        if complete:
            keep_day = (ctx.now - timedelta(days=int(s.daily_retention_days))).date()
            daily_deleted, complete = batched_delete(
                ctx,
                """DELETE FROM route_daily WHERE ctid = ANY(ARRAY(
                        SELECT ctid FROM route_daily WHERE day < :day LIMIT :batch))""",
                {"day": keep_day},
            )
        return {
            "cutoff": cutoff.isoformat(),
            "dropped": dropped,
            "default_deleted": default_deleted,
            "daily_deleted": daily_deleted,
            "complete": complete,
        }


JOB = HistoryRetentionJob()
