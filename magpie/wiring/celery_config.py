"""Celery settings built from :class:`magpie.config.Settings` (queues, routes and beat schedule of docs/design.md).

``celeryconfig.py`` at the top of the repository re-exports :func:`build` so that ``celery -A magpie``
and ``app.config_from_object("celeryconfig")`` see the same values.
"""

from __future__ import annotations

from datetime import timedelta

from kombu import Exchange, Queue

from magpie.alerts import beat as alerts_beat
from magpie.coordination import ticks
from magpie.sources import beat as sources_beat
from magpie.wiring import jobs

QUEUES = ("promote", "checks", "stats", "alerts", "delivery", "email", "maintenance")
"""Every queue magpie's tasks are routed to (the Procfile's ``promote``, ``checks`` and ``jobs`` workers)."""

AMQP_EXCHANGE = "magpie"
"""RabbitMQ: the topic exchange every magpie queue is bound to by its own name (topic, not direct, so
Celery's native delayed delivery can route ``countdown``/``eta`` messages back to the queue)."""

AMQP_DELIVERY_LIMIT = 10
"""RabbitMQ: ``x-delivery-limit`` of magpie's quorum queues, the deliveries of one message before RabbitMQ
drops it. Messages are acked on receipt, so a message comes back only when a worker's connection died
while it held it unacked (prefetched); ten such deaths in a row mark a crash loop, and a dropped message
costs a lease expiry, never a route (the schedule in Redis is the source of truth). Fixed when a queue is
first declared: a queue declared with another value must be deleted (or the limit set by a policy)."""

AMQP_HEARTBEAT_S = 60
"""RabbitMQ: AMQP heartbeat in seconds; a dead TCP peer is noticed within two of them."""


def queues(settings) -> list[Queue]:
    """The kombu queues of :data:`QUEUES` for ``settings``' broker.

    Redis: plain queues (a list per queue name). RabbitMQ: durable quorum queues (``x-queue-type:
    quorum``, replicated, consumer acks on a closed channel redeliver at once) on the topic exchange
    :data:`AMQP_EXCHANGE`, with ``x-delivery-limit`` :data:`AMQP_DELIVERY_LIMIT`.

    Args:
        settings: :class:`magpie.config.Settings`.
    Returns:
        one :class:`kombu.Queue` per name of :data:`QUEUES`, in that order.
    """
    if not settings.broker_is_amqp:
        return [Queue(name, routing_key=name) for name in QUEUES]
    exchange = Exchange(AMQP_EXCHANGE, type="topic", durable=True)
    args = {"x-queue-type": "quorum", "x-delivery-limit": AMQP_DELIVERY_LIMIT}
    return [Queue(name, exchange, routing_key=name, durable=True, queue_arguments=dict(args)) for name in QUEUES]


def broker_options(settings) -> dict:
    """The broker-specific Celery settings of ``settings``' broker (merged into :func:`build`'s dict).

    Redis: ``global_keyprefix`` when ``MAGPIE_BROKER_KEY_PREFIX`` is set. RabbitMQ: publisher confirms
    (a publish returns once the quorum queue's majority stored the message, else raises), heartbeats of
    :data:`AMQP_HEARTBEAT_S` s, quorum queues for any queue created on the fly, per-consumer QoS (global
    QoS is not supported by quorum queues; Celery detects them and switches it off, which
    ``worker_detect_quorum_queues`` keeps on) and native delayed delivery on quorum queues.
    """
    if not settings.broker_is_amqp:
        return {"broker_transport_options": (
            {"global_keyprefix": settings.broker_key_prefix}
            if settings.broker_key_prefix and settings.broker_url.startswith("redis") else {}
        )}
    return {
        "broker_transport_options": {"confirm_publish": True},
        "broker_heartbeat": AMQP_HEARTBEAT_S,
        "task_default_exchange": AMQP_EXCHANGE,
        "task_default_exchange_type": "topic",
        "task_default_queue_type": "quorum",
        "task_create_missing_queue_type": "quorum",
        "worker_detect_quorum_queues": True,
        "broker_native_delayed_delivery_queue_type": "quorum",
    }


def _extra_beat(settings) -> dict:
    """Beat entries of the background jobs, in Celery's ``beat_schedule`` format: the maintenance jobs of
    :data:`magpie.wiring.jobs.JOBS`, the alert and email jobs, and the due-source fetch."""
    return {**jobs.beat_entries(settings), **alerts_beat.beat_entries(settings),
            **sources_beat.beat_entries(settings)}


def build(settings=None) -> dict:
    """Return Celery's settings as a dict of lower-case Celery setting names.

    Beat entries carry ``expires`` so a backlog of one-second triggers is dropped rather than replayed
    (the schedule in Redis, not the broker, is the source of truth). The queues and broker options
    depend on the broker: :func:`queues`, :func:`broker_options` (Redis or RabbitMQ).
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
