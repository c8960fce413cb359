"""Celery settings built from :class:`magpie.config.Settings` (queues, routes and beat schedule of docs/design.md).

``celeryconfig.py`` at the top of the repository re-exports :func:`build` so that ``celery -A magpie``
and ``app.config_from_object("celeryconfig")`` see the same values. The queues and the broker's options
are :mod:`magpie.base.broker`'s.
"""

from __future__ import annotations

from datetime import timedelta

from magpie.alerts import beat as alerts_beat
from magpie.base.broker import broker_options, queues
from magpie.coordination import ticks
from magpie.sources import beat as sources_beat
from magpie.wiring import jobs


def _extra_beat(settings) -> dict:
    """Beat entries of the background jobs, in Celery's ``beat_schedule`` format: the maintenance jobs of
    :data:`magpie.wiring.jobs.JOBS`, the alert and email jobs, and the due-source fetch."""
    return {**jobs.beat_entries(settings), **alerts_beat.beat_entries(settings),
            **sources_beat.beat_entries(settings)}


def build(settings=None) -> dict:
    """Return Celery's settings as a dict of lower-case Celery setting names.

    Beat entries carry ``expires`` so a backlog of one-second triggers is dropped rather than replayed
    (the schedule in Redis, not the broker, is the source of truth). The queues and broker options
    depend on the broker: :func:`magpie.base.broker.queues`, :func:`magpie.base.broker.broker_options`
    (Redis or RabbitMQ).
    """
    from magpie.config import get_settings

    s = settings or get_settings()
    promote_every = timedelta(seconds=s.promote_interval)
    stats_every = timedelta(seconds=s.stats_interval)
    return {
        "broker_url": s.broker_url,
        "result_backend": s.result_backend,
        "task_ignore_result": s.result_backend is None,
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_serializer": "json",
        "timezone": "UTC",
        "enable_utc": True,
        "task_default_queue": "checks",
        "task_queues": queues(s),
        "task_routes": {
            "magpie.promote": {"queue": "promote", "routing_key": "promote"},
            "magpie.check_routes": {"queue": "checks", "routing_key": "checks"},
            "magpie.ingest_stats": {"queue": "stats", "routing_key": "stats"},
            # families of background jobs, by task-name prefix
            "magpie.stats.*": {"queue": "stats", "routing_key": "stats"},
            "magpie.maintenance.*": {"queue": "maintenance", "routing_key": "maintenance"},
            "magpie.alerts.*": {"queue": "alerts", "routing_key": "alerts"},
            "magpie.delivery.*": {"queue": "delivery", "routing_key": "delivery"},
            "magpie.email.*": {"queue": "email", "routing_key": "email"},
        },
        # A check task only admits its leases into the process's check pool; the limits are the last guard.
        # Housekeeping triggers send no task events unless they did work (magpie.coordination.ticks): Flower shows work.
        "task_annotations": {**ticks.annotations(),
                             "magpie.check_routes": {"soft_time_limit": s.lease_seconds,
                                                     "time_limit": s.lease_seconds + 30}},
        # Check messages are acked on receipt: a lost message costs a lease expiry, never a route.
        "task_acks_late": False,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "broker_connection_retry_on_startup": True,
        **broker_options(s),
        "beat_schedule": {
            **_extra_beat(s),
            "promote": {
                "task": "magpie.promote",
                "schedule": promote_every,
                "options": {"expires": max(1.0, 2 * s.promote_interval)},
            },
            "ingest-stats": {
                "task": "magpie.ingest_stats",
                "schedule": stats_every,
                "options": {"expires": max(1.0, 2 * s.stats_interval)},
            },
        },
    }
