"""Celery settings built from :class:`magpie.config.Settings` (queues, routes and beat schedule of docs/design.md).

``celeryconfig.py`` at the top of the repository re-exports :func:`build` so that ``celery -A magpie``
and ``app.config_from_object("celeryconfig")`` see the same values.
"""

from __future__ import annotations

from datetime import timedelta

from kombu import Queue

from magpie import ticks

QUEUES = ("promote", "checks", "stats", "alerts", "delivery", "email", "maintenance")


BEAT_PROVIDERS = ("magpie.maintenance.beat", "magpie.alerts.beat", "magpie.sources.beat")


def _extra_beat(settings) -> dict:
    """Beat entries contributed by background-job packages: each provider module exposes
    ``beat_entries(settings) -> dict`` in Celery's ``beat_schedule`` format."""
    import importlib

    out: dict = {}
    for name in BEAT_PROVIDERS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # provider package not present
            raise
        out.update(mod.beat_entries(settings))
    return out


def build(settings=None) -> dict:
    """Return Celery's settings as a dict of lower-case Celery setting names.

    Beat entries carry ``expires`` so a backlog of one-second triggers is dropped rather than replayed
    (the schedule in Redis, not the broker, is the source of truth).
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
        "task_queues": [Queue(name, routing_key=name) for name in QUEUES],
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
        # Housekeeping triggers send no task events unless they did work (magpie.ticks): Flower shows work.
        "task_annotations": {**ticks.annotations(),
                             "magpie.check_routes": {"soft_time_limit": s.lease_seconds,
                                                     "time_limit": s.lease_seconds + 30}},
        # Check messages are acked on receipt: a lost message costs a lease expiry, never a route.
        "task_acks_late": False,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": (
            {"global_keyprefix": s.broker_key_prefix} if s.broker_key_prefix and s.broker_url.startswith("redis")
            else {}
        ),
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
