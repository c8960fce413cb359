"""Job ``outbox_cleanup``: delete terminal ``email_outbox`` rows past retention.

Terminal rows are ``sent`` and ``failed`` (the outbox's final statuses); they are deleted once older than
``MAGPIE_OUTBOX_RETENTION_SECONDS``, measured from ``sent_at`` or, for failed rows, ``updated_at``. This
job is the only place outbox rows are deleted: the outbox's own housekeeping
(:func:`magpie.outbox.housekeeping`) only ends expired claims.

The table is created by another revision (``0003``): when it does not exist, or lacks the columns used
here, the pass is skipped and says so.
"""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from magpie.maintenance.base import Job, JobContext, batched_delete, table_exists

TERMINAL = ("sent", "failed")
_NEEDED = {"id", "status", "sent_at", "updated_at"}
_DELETE = """
    DELETE FROM email_outbox WHERE id IN (
        SELECT id FROM email_outbox
        WHERE status = ANY(CAST(:statuses AS text[])) AND COALESCE(sent_at, updated_at) < :cutoff
        LIMIT :batch FOR UPDATE SKIP LOCKED)
"""


class OutboxCleanupJob(Job):
    name = "outbox_cleanup"
    every = 3600.0
    description = "delete sent/failed email_outbox rows past retention (skipped while the table is missing)"

    def run(self, ctx: JobContext) -> dict:
        with ctx.engine.connect() as conn:
            if not table_exists(conn, "email_outbox"):
                return {"skipped": "table email_outbox does not exist", "deleted": 0, "complete": True}
            cols = set(
                conn.execute(
                    sa.text(
                        "SELECT column_name FROM information_schema.columns "
                        "WHERE table_schema = 'public' AND table_name = 'email_outbox'"
                    )
                ).scalars()
            )
        if not _NEEDED <= cols:
            return {"skipped": f"email_outbox lacks {sorted(_NEEDED - cols)}", "deleted": 0, "complete": True}
        keep_s = float(ctx.settings.outbox_retention_seconds)
        cutoff = ctx.now - timedelta(seconds=keep_s)
        deleted, complete = batched_delete(ctx, _DELETE, {"statuses": list(TERMINAL), "cutoff": cutoff})
        return {"cutoff": cutoff.isoformat(), "deleted": deleted, "complete": complete}


JOB = OutboxCleanupJob()
