"""The broker's side of Celery's settings: magpie's queues and the options of a Redis or RabbitMQ broker.

:func:`magpie.wiring.celery_config.build` puts them into Celery's settings; the health check's broker
probe connects with the same transport options.
"""

from __future__ import annotations

from kombu import Exchange, Queue

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


__all__ = ["AMQP_DELIVERY_LIMIT", "AMQP_EXCHANGE", "AMQP_HEARTBEAT_S", "QUEUES", "broker_options", "queues"]
