"""Retention of the rollup tables: one job per table, deleting in batches rows older than its setting.

* ``snapshot_retention``: ``workspace_snapshots`` older than ``MAGPIE_SNAPSHOT_RETENTION_DAYS``.
* ``hourly_retention``: ``hourly_counts`` older than ``MAGPIE_HOURLY_RETENTION_DAYS``.
* ``usage_retention``: ``workspace_usage`` days older than ``MAGPIE_USAGE_RETENTION_DAYS``.
* ``source_stats_retention``: ``source_stats`` rows no refresh wrote for
  ``MAGPIE_SOURCE_STATS_RETENTION_DAYS`` (a source whose routes are all gone).

Each batch is one fenced transaction deleting at most ``MAGPIE_MAINTENANCE_BATCH_SIZE`` rows
(:func:`magpie.maintenance.base.batched_delete`); deleting what is already gone is a no-op, so a repeated
or interrupted pass is harmless.
"""

from __future__ import annotations

from datetime import timedelta

from magpie.maintenance.base import Job, JobContext, batched_delete


class _Retention(Job):
    every = 3600.0
    table = ""
    column = ""
    setting = ""

    def run(self, ctx: JobContext) -> dict:
        cutoff = ctx.now - timedelta(days=int(getattr(ctx.settings, self.setting)))
        if self.column == "day":
            cutoff = cutoff.date()
        sql = (f"DELETE FROM {self.table} WHERE ctid = ANY(ARRAY("
               f"SELECT ctid FROM {self.table} WHERE {self.column} < :cutoff LIMIT :batch))")
        deleted, complete = batched_delete(ctx, sql, {"cutoff": cutoff})
        return {"cutoff": str(cutoff), "deleted": deleted, "complete": complete}


def _job(name: str, table: str, column: str, setting: str, what: str) -> Job:
    cls = type(f"{table.title().replace('_', '')}Retention", (_Retention,),
               {"name": name, "table": table, "column": column, "setting": setting,
                "description": f"delete {what} older than MAGPIE_{setting.upper()} days"})
    return cls()


SNAPSHOTS = _job("snapshot_retention", "workspace_snapshots", "taken_at", "snapshot_retention_days",
                 "workspace snapshots")
HOURLY = _job("hourly_retention", "hourly_counts", "hour", "hourly_retention_days", "hourly counts")
USAGE = _job("usage_retention", "workspace_usage", "day", "usage_retention_days", "daily workspace usage")
SOURCES = _job("source_stats_retention", "source_stats", "refreshed_at", "source_stats_retention_days",
               "source statistics not refreshed")
JOBS = (SNAPSHOTS, HOURLY, USAGE, SOURCES)
"""The retention jobs of the rollup tables."""
