"""The Redis client factory: which URL names what, one-line refusals that never show a password."""

from __future__ import annotations

import pytest
import redis

from magpie.base import redisconn
from magpie.config import ConfigError, load_settings


def test_cluster_url_lists_startup_nodes_and_credentials():
    nodes, opts = redisconn.cluster_nodes("redis+cluster://app:s%40cret@10.0.0.1:7000,10.0.0.2:7001,h3/")
    assert nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("h3", 6379)]
    assert opts == {"username": "app", "password": "s@cret"}
    assert redisconn.cluster_nodes("rediss+cluster://:pw@h:1/0")[1] == {"password": "pw", "ssl": True}
    assert redisconn.is_cluster_url("REDIS+CLUSTER://h:1") and not redisconn.is_cluster_url("redis://h:1")


@pytest.mark.parametrize("url, words", [
    ("redis+cluster://u:topsecret1@h:1/3", "database 0 only"),
    ("redis+cluster://u:topsecret1@h:1,:2/", "node 2 has no host"),
    ("redis+cluster://u:topsecret1@h:notaport/", "node 1 is not host:port"),
    ("http://u:topsecret1@h:1/", "redis+cluster://"),
])
def test_a_bad_url_is_one_line_without_the_password(url, words):
    problem = redisconn.url_problem(url)
    assert problem and words in problem and "topsecret1" not in problem and "\n" not in problem
    with pytest.raises(ConfigError) as err:
        load_settings(redis_url=url, broker_url="redis://127.0.0.1:6379/1")
    text = str(err.value)
    assert "MAGPIE_REDIS_URL" in text and "topsecret1" not in text and "\n" not in text


def test_plain_urls_stay_plain_clients_and_keep_their_options():
    c = redisconn.connect("redis://127.0.0.1:6379/3", socket_timeout=1.5, decode_responses=True)
    assert isinstance(c, redis.Redis) and not redisconn.is_cluster(c)
    kw = c.connection_pool.connection_kwargs
    assert kw["db"] == 3 and kw["socket_timeout"] == 1.5 and kw["decode_responses"] is True
    assert redisconn.url_problem("unix:///tmp/r.sock") is None
    with pytest.raises(redisconn.RedisUrlError):
        redisconn.connect("memcached://h:1")


def test_a_cluster_needs_its_own_broker(monkeypatch):
    monkeypatch.delenv("MAGPIE_BROKER_URL", raising=False)
    with pytest.raises(ConfigError) as err:
        load_settings(redis_url="redis+cluster://u:topsecret1@127.0.0.1:7000/")
    assert "set MAGPIE_BROKER_URL" in str(err.value) and "topsecret1" not in str(err.value)
    s = load_settings(redis_url="redis+cluster://127.0.0.1:7000/", broker_url="amqp://guest:guest@127.0.0.1//")
    assert s.redis_url.startswith("redis+cluster://")
    monkeypatch.setenv("MAGPIE_BROKER_URL", "redis://127.0.0.1:6379/1")
    assert load_settings(redis_url="redis+cluster://127.0.0.1:7000/").broker_url == "redis://127.0.0.1:6379/1"


def test_stats_keys_are_todays_on_one_server():
    from magpie.queue.streams import dead_key, infra_key, stream_key, tagged_for

    assert (stream_key("m:"), dead_key("m:"), infra_key("m:")) == ("m:stats:results", "m:stats:dead", "m:stats:infra")
    assert stream_key("m:", True) == "m:{default}:stats:results"
    assert not tagged_for(redis.Redis())


def test_an_unreachable_cluster_is_a_connection_error_naming_no_password():
    with pytest.raises(redis.ConnectionError) as err:
        redisconn.connect("redis+cluster://u:topsecret1@127.0.0.1:1/", socket_connect_timeout=0.5)
    assert isinstance(err.value, redisconn.ClusterUnreachable) and "topsecret1" not in str(err.value)
    assert "\n" not in str(err.value)


def test_the_command_packer_packs_what_redis_py_packs_and_refuses_what_it_refuses():
    from redis.connection import Connection
    from redis.exceptions import DataError

    from magpie.base.redisconn import CommandPacker

    ours, theirs = CommandPacker(), Connection()
    for args in [("SET", "k", "v"), ("SET", "k", 1.5), ("INCRBY", "k", -10), ("SET", b"k", b"\xff\x00"),
                 ("SET", "k", "é"), ("CLIENT SETNAME", "x"), ("EVALSHA", "a" * 40, 2, "k1", "k2", 3, "x" * 5000),
                 ("SET", "k", bytearray(b"ab")), ("SET", "k", memoryview(b"ab"))]:
        assert b"".join(ours.pack(*args)) == b"".join(theirs.pack_command(*args)), args
    for bad in (True, None, object()):
        with pytest.raises(DataError):
            ours.pack("SET", "k", bad)


def test_plain_clients_pack_in_one_call_unless_told_otherwise():
    from magpie.base.redisconn import CommandPacker, connect

    fast = connect("redis://127.0.0.1:6379/0")
    assert isinstance(fast.connection_pool.connection_kwargs["command_packer"], CommandPacker)
    latin = connect("redis://127.0.0.1:6379/0", encoding="latin-1")
    assert "command_packer" not in latin.connection_pool.connection_kwargs
