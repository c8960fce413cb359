"""Beat entries of the maintenance jobs (the job list comes from :mod:`magpie.wiring.jobs`)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from magpie.config import ConfigError, parse_cadences
from magpie.maintenance.base import Job

TASK = "magpie.maintenance.run"
"""The Celery task running one pass of a job: ``magpie.maintenance.run(job_name)`` (``maintenance`` queue)."""


def cadences(settings, jobs: Iterable[Job]) -> dict[str, float]:
    """Effective cadence in seconds per job of ``jobs``: the job's default, overridden by
    ``MAGPIE_MAINTENANCE_CADENCES``.

    Raises :class:`magpie.config.ConfigError` naming the variable for a name not among ``jobs``."""
    by_name = {j.name: j for j in jobs}
    overrides = parse_cadences(settings.maintenance_cadences)
    unknown = sorted(set(overrides) - set(by_name))
    if unknown:
        raise ConfigError(
            f"invalid magpie configuration: MAGPIE_MAINTENANCE_CADENCES: unknown job(s) {unknown}; "
            f"known: {', '.join(by_name)}"
        )
    return {name: float(overrides.get(name, job.every)) for name, job in by_name.items()}


def beat_entries(settings, jobs: Iterable[Job]) -> dict:
    """One beat entry per job of ``jobs`` with a non-zero cadence, in Celery ``beat_schedule`` format.

    Entry ``maintenance-<job>``: task :data:`TASK` with ``args=[job]`` every cadence seconds; ``expires``
    is one cadence, so triggers that piled up while no maintenance worker ran are dropped, not replayed.
    """
    out = {}
    for name, every in cadences(settings, jobs).items():
        if every <= 0:
            continue
        out[f"maintenance-{name}"] = {
            "task": TASK,
            "schedule": timedelta(seconds=every),
            "args": [name],
            "options": {"expires": max(1.0, every)},
        }
    return out
