"""The maintenance jobs of the deployment, in the order ``magpie maintenance run all`` runs them.

This is the one list: the packages that own a job define it, and the maintenance runner, the beat
entries, the metrics exporter and the CLI receive the list from here. The functions below are the
runner's, with a job given by name.
"""

from __future__ import annotations

from magpie.blacklists import job as blacklists_job
from magpie.derived import dashboard
from magpie.derived import jobs as derived_jobs
from magpie.enrich import job as enrich_job
from magpie.judges import jobs as judges_jobs
from magpie.maintenance import (beat, bodies, history, interval, orphans, outbox, partitions, rebuild, rollup, runner,
                                tokens)
from magpie.maintenance.base import Job
from magpie.stats import ledger

JOBS: dict[str, Job] = {
    j.name: j
    for j in (
        partitions.JOB,
        rollup.JOB,
        history.JOB,
        bodies.JOB,
        ledger.JOB,
        orphans.JOB,
        tokens.JOB,
        outbox.JOB,
        rebuild.JOB,
        interval.JOB,
        *judges_jobs.JOBS,
        blacklists_job.JOB,
        enrich_job.JOB,
        *derived_jobs.JOBS,
        dashboard.JOB,
    )
}
"""Job name -> :class:`Job`. Rollup runs before history retention so counters are taken first."""


def resolve(job: str | Job) -> Job:
    """The :class:`Job` named ``job`` in :data:`JOBS` (a :class:`Job` instance is returned as is).

    Raises ``KeyError`` with the known names for an unknown job."""
    if isinstance(job, Job):
        return job
    try:
        return JOBS[job]
    except KeyError:
        raise KeyError(f"unknown maintenance job {job!r}; known: {', '.join(JOBS)}") from None


def run_job(job: str | Job, settings, **kw) -> dict:
    """One pass of ``job`` (a name of :data:`JOBS` or a :class:`Job`) under its leader lock:
    :func:`magpie.maintenance.runner.run_job`, same keywords and result. Raises ``KeyError`` for an
    unknown name."""
    return runner.run_job(resolve(job), settings, **kw)


def run_all(settings, **kw) -> list[dict]:
    """One pass of every job of :data:`JOBS`, in order (:func:`magpie.maintenance.runner.run_all`)."""
    return runner.run_all(settings, JOBS.values(), **kw)


def job_status(settings, **kw) -> list[dict]:
    """Status of every job of :data:`JOBS` for operators (:func:`magpie.maintenance.runner.job_status`)."""
    return runner.job_status(settings, JOBS.values(), **kw)


def beat_entries(settings) -> dict:
    """The maintenance jobs' Celery beat entries (:func:`magpie.maintenance.beat.beat_entries` of :data:`JOBS`)."""
    return beat.beat_entries(settings, JOBS.values())


__all__ = ["JOBS", "beat_entries", "job_status", "resolve", "run_all", "run_job"]
