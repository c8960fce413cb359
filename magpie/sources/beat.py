"""Beat entry of the due-source fetch (collected by :func:`magpie.wiring.celery_config.build`)."""

from __future__ import annotations

from datetime import timedelta

TASK = "magpie.maintenance.fetch_sources"
"""Task claiming and fetching due proxy-list sources (``maintenance`` queue, by its name's prefix)."""


def beat_entries(settings) -> dict:
    """``{"fetch-sources": ...}`` every ``MAGPIE_SOURCE_TICK`` seconds (none when it is 0); the trigger
    expires after one period, so a backlog is dropped: the source schedule in Redis holds the work."""
    every = float(settings.source_tick)
    if every <= 0:
        return {}
    return {"fetch-sources": {"task": TASK, "schedule": timedelta(seconds=every),
                              "options": {"expires": max(1.0, every)}}}
