"""Beat entries of the maintenance jobs (read by :func:`magpie.wiring.celery_config.build`, ``BEAT_PROVIDERS``)."""

from __future__ import annotations

from datetime import timedelta

TASK = "magpie.maintenance.run"
"""The Celery task running one pass of a job: ``magpie.maintenance.run(job_name)`` (``maintenance`` queue)."""


def cadences(settings) -> dict[str, float]:
    """Effective cadence in seconds per job: the job's default, overridden by ``MAGPIE_MAINTENANCE_CADENCES``.

    Raises :class:`magpie.config.ConfigError` naming the variable for an unknown job name."""
    from magpie.config import ConfigError, parse_cadences
    from magpie.wiring.jobs import JOBS

    overrides = parse_cadences(settings.maintenance_cadences)
    unknown = sorted(set(overrides) - set(JOBS))
    if unknown:
        raise ConfigError(
            f"invalid magpie configuration: MAGPIE_MAINTENANCE_CADENCES: unknown job(s) {unknown}; "
            f"known: {', '.join(JOBS)}"
        )
    return {name: float(overrides.get(name, job.every)) for name, job in JOBS.items()}


def beat_entries(settings) -> dict:
    """One beat entry per job with a non-zero cadence, in Celery ``beat_schedule`` format.

    Entry ``maintenance-<job>``: task :data:`TASK` with ``args=[job]`` every cadence seconds; ``expires``
    is one cadence, so triggers that piled up while no maintenance worker ran are dropped, not replayed.
    """
    out = {}
    for name, every in cadences(settings).items():
        if every <= 0:
            continue
        out[f"maintenance-{name}"] = {
            "task": TASK,
            "schedule": timedelta(seconds=every),
            "args": [name],
            "options": {"expires": max(1.0, every)},
        }
    return out
