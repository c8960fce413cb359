"""Job ``body_retention``: blank judge response bodies older than ``MAGPIE_BODY_RETENTION_DAYS``.

The body is the bulkiest column of ``check_history`` and the least useful once a check is old; the
row itself stays (until ``history_retention`` drops its partition) with ``body`` set to NULL. Each batch
takes the oldest rows that still carry a body through the partial index
``ix_check_history_body_checked_at`` (a blanked row leaves the index, so batches never rescan work done).
"""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from magpie.maintenance.base import Job, JobContext

_BLANK = """
    UPDATE check_history h SET body = NULL
    FROM (SELECT id, checked_at FROM check_history
          WHERE body IS NOT NULL AND checked_at < :cutoff
          ORDER BY checked_at LIMIT :batch) s
    WHERE h.id = s.id AND h.checked_at = s.checked_at AND h.body IS NOT NULL
"""


class BodyRetentionJob(Job):
    name = "body_retention"
    every = 900.0
    description = "blank check_history response bodies past MAGPIE_BODY_RETENTION_DAYS"

    def run(self, ctx: JobContext) -> dict:
        cutoff = ctx.now - timedelta(days=int(ctx.settings.body_retention_days))
        blanked = 0
        while not ctx.should_stop():
            with ctx.engine.begin() as conn:
                n = conn.execute(sa.text(_BLANK), {"cutoff": cutoff, "batch": ctx.batch_size}).rowcount
            ctx.tick()
            blanked += n
            if n < ctx.batch_size:
                return {"cutoff": cutoff.isoformat(), "blanked": blanked, "complete": True}
        return {"cutoff": cutoff.isoformat(), "blanked": blanked, "complete": False}


JOB = BodyRetentionJob()
