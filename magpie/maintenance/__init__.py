"""Maintenance: leader-coordinated jobs that keep a long-running deployment bounded (``maintenance`` queue).

One module per job of the core tables (``partitions``, ``rollup``, ``history``, ``bodies``, ``orphans``,
``tokens``, ``outbox``, ``rebuild``, ``interval``; the other packages keep their own jobs), each a
:class:`~magpie.maintenance.base.Job` with its own cadence, run in batches with per-pass limits by
:func:`~magpie.maintenance.runner.run_job` under its Redis leader lock, every pass recorded in
``maintenance_runs``. The deployment's job list is :data:`magpie.wiring.jobs.JOBS`. None of it runs on
the check path.
"""

from magpie.maintenance.base import Job, JobContext
from magpie.maintenance.runner import job_status, read_job_status, run_all, run_job

__all__ = ["Job", "JobContext", "job_status", "read_job_status", "run_all", "run_job"]
