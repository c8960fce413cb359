"""The maintenance jobs of derived data and of the instance registry, in the order they run.

``reputation`` first (source statistics read its scores), then the rollups (``workspace_usage`` reads
``hourly_counts``), their retention jobs, and ``instance_sweep``.
"""

from __future__ import annotations

from magpie.derived import reputation, retention, rollups
from magpie.maintenance.base import Job, JobContext


class InstanceSweepJob(Job):
    """Drop expired instance ids from the Redis index (:mod:`magpie.coordination.instances`) and report live counts."""

    name = "instance_sweep"
    every = 60.0
    description = "drop expired instance heartbeats from the index; count live instances per role"

    def run(self, ctx: JobContext) -> dict:
        from magpie.coordination.instances import InstanceRegistry

        dropped, live = InstanceRegistry(ctx.redis, ctx.settings.redis_prefix).sweep()
        ctx.tick()
        return {"dropped": dropped, "live": live, "complete": True}


INSTANCE_SWEEP = InstanceSweepJob()

JOBS: tuple[Job, ...] = (reputation.JOB, *rollups.JOBS, *retention.JOBS, INSTANCE_SWEEP)
"""Every job of this package (registered in :data:`magpie.wiring.jobs.JOBS`)."""

__all__ = ["INSTANCE_SWEEP", "JOBS", "InstanceSweepJob"]
