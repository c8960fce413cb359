"""The Celery configuration chosen for the broker: quorum queues and RabbitMQ options for ``amqp://``,
today's plain queues and key prefix for Redis; a key prefix on RabbitMQ is refused in one line."""

from __future__ import annotations

import pytest

from magpie.base.broker import AMQP_DELIVERY_LIMIT, AMQP_EXCHANGE, QUEUES
from magpie.wiring.celery_config import build
from magpie.config import ConfigError, load_settings

AMQP = ("amqp://u:Canary-pw-1@mq.example.net:5672/magpie", "AMQPS://u:p@mq:5671/vh", "pyamqp://127.0.0.1//",
        "amqp://a:b@mq1//;amqp://a:b@mq2//")
REDIS = ("redis://127.0.0.1:6379/1", "rediss://:pw@r:6380/0", "sentinel://s1:26379;sentinel://s2:26379")


@pytest.mark.parametrize("url", AMQP)
def test_an_amqp_broker_gets_durable_quorum_queues_for_every_magpie_queue(url):
    conf = build(load_settings(broker_url=url))
    qs = {q.name: q for q in conf["task_queues"]}
    assert set(qs) == set(QUEUES) and {"promote", "checks", "maintenance"} <= set(qs)
    for name, q in qs.items():
        assert q.durable and not q.auto_delete and not q.exclusive
        assert q.queue_arguments == {"x-queue-type": "quorum", "x-delivery-limit": AMQP_DELIVERY_LIMIT}
        assert q.exchange.name == AMQP_EXCHANGE and q.exchange.type == "topic" and q.routing_key == name
    assert conf["task_default_queue_type"] == conf["task_create_missing_queue_type"] == "quorum"
    assert conf["worker_detect_quorum_queues"] is True
    assert conf["broker_transport_options"] == {"confirm_publish": True}
    assert conf["broker_heartbeat"] > 0 and conf["broker_connection_retry_on_startup"] is True
    assert conf["worker_prefetch_multiplier"] == 1 and conf["task_acks_late"] is False
    # every route names a declared queue (nothing is created on the fly as a classic queue)
    assert {r["queue"] for r in conf["task_routes"].values()} <= set(qs)


@pytest.mark.parametrize("url", REDIS)
def test_a_redis_broker_keeps_plain_queues_and_no_amqp_options(url):
    conf = build(load_settings(broker_url=url))
    assert [q.name for q in conf["task_queues"]] == list(QUEUES)
    for q in conf["task_queues"]:
        assert not q.queue_arguments and q.routing_key == q.name
    for key in ("task_default_queue_type", "broker_heartbeat", "task_default_exchange_type"):
        assert key not in conf
    assert conf["broker_transport_options"] == {}


def test_a_redis_broker_keeps_its_key_prefix():
    conf = build(load_settings(broker_url=REDIS[0], broker_key_prefix="dep-a:broker:"))
    assert conf["broker_transport_options"] == {"global_keyprefix": "dep-a:broker:"}


@pytest.mark.parametrize("url", AMQP[:2])
def test_a_key_prefix_on_an_amqp_broker_is_one_line_pointing_at_vhosts_without_the_password(url):
    with pytest.raises(ConfigError) as err:
        load_settings(broker_url=url, broker_key_prefix="dep-a:")
    msg = str(err.value)
    assert "MAGPIE_BROKER_KEY_PREFIX" in msg and "vhost" in msg and "\n" not in msg
    assert "Canary-pw-1" not in msg


@pytest.mark.parametrize("url,amqp", [*((u, True) for u in AMQP), *((u, False) for u in REDIS), ("memory://", False)])
def test_broker_is_amqp(url, amqp):
    assert load_settings(broker_url=url).broker_is_amqp is amqp


def test_failover_urls_mixing_rabbitmq_and_redis_are_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_settings(broker_url="redis://:Canary-pw-2@r:6379/1;amqp://u:Canary-pw-2@mq//")
    msg = str(err.value)
    assert "MAGPIE_BROKER_URL" in msg and "failover" in msg and "\n" not in msg and "Canary-pw-2" not in msg
