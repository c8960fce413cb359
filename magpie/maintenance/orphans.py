"""Job ``orphan_routes``: routes no workspace owns leave the Redis schedule and PostgreSQL.

Per batch, one transaction: lock up to ``MAGPIE_MAINTENANCE_BATCH_SIZE`` orphan routes
(``FOR UPDATE SKIP LOCKED``, so an import holding one is skipped), remove each from the schedule with
:meth:`magpie.queue.RouteQueue.remove_route`, then delete from ``routes`` those that left Redis,
re-checking in the same statement that the route is still an orphan
(:func:`magpie.db.deletion.delete_routes`: their history goes in the same transaction; health, daily
counters and the rest through ``ON DELETE CASCADE``).

* A route under a live lease is refused by Redis (``active_leases``): it stays in both places and the
  next pass retries it, after its check completed.
* A route already gone from Redis (``gone``) is simply deleted from PostgreSQL, which makes an
  interrupted pass (Redis removal done, PostgreSQL transaction lost) finish on the next pass.
* Redis first, PostgreSQL second: a route is never left scheduled in Redis without its row.

An import that adds a workspace to a route being cleaned up waits on the row lock and then fails on the
foreign key (the route is gone); re-running the import stores it again.
"""

from __future__ import annotations

import sqlalchemy as sa

from magpie.db.deletion import delete_routes
from magpie.maintenance.base import Job, JobContext

_CANDIDATES = """
    SELECT id, route_hash FROM routes r
    WHERE id > :after AND NOT EXISTS (SELECT 1 FROM route_workspaces rw WHERE rw.route_id = r.id)
    ORDER BY id LIMIT :batch
    FOR UPDATE SKIP LOCKED
"""


class OrphanRoutesJob(Job):
    name = "orphan_routes"
    every = 600.0
    description = "remove routes no workspace owns from the Redis schedule and PostgreSQL"

    def run(self, ctx: JobContext) -> dict:
        from magpie.errors import Refusal
        from magpie.queue import QueueError

        queue = ctx.queue()
        after = 0
        deleted = leased = 0
        while not ctx.should_stop():
            with ctx.engine.begin() as conn:
                rows = conn.execute(sa.text(_CANDIDATES), {"after": after, "batch": ctx.batch_size}).all()
                if not rows:
                    return {"deleted": deleted, "skipped_leased": leased, "complete": True}
                after = rows[-1][0]
                ids = []
                for rid, rhash in rows:
                    try:
                        queue.remove_route(rhash.strip())
                    except QueueError as exc:
                        if exc.code is Refusal.ACTIVE_LEASES:
                            leased += 1
                            continue
                        if exc.code is not Refusal.GONE:
                            raise
                    ids.append(rid)
                if ids:
                    deleted += len(delete_routes(conn, ids))
            ctx.tick()
            if len(rows) < ctx.batch_size:
                return {"deleted": deleted, "skipped_leased": leased, "complete": True}
        return {"deleted": deleted, "skipped_leased": leased, "complete": False}


JOB = OrphanRoutesJob()
