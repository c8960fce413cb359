"""Leader locks against real Redis: exclusivity, hand-over, expiry while the holder stalls."""

from helpers import elapse, wait_until

from magpie.coordination.leader import LeaderLock


def test_two_contenders_one_leader_then_hand_over(redis_client, redis_prefix):
    a = LeaderLock(redis_client, redis_prefix, "job", ttl_ms=1000)
    b = LeaderLock(redis_client, redis_prefix, "job", ttl_ms=1000)
    assert a.acquire() and not b.acquire()
    assert a.is_held() and not b.is_held()
    assert not b.release()  # compare-and-delete: b cannot release a's lock
    assert a.is_held()
    assert a.release() and b.acquire()


def test_stalled_holder_loses_lock_and_its_renewal_fails(redis_client, redis_prefix):
    a = LeaderLock(redis_client, redis_prefix, "job", ttl_ms=200)
    b = LeaderLock(redis_client, redis_prefix, "job", ttl_ms=5000)
    assert a.acquire()
    # a is paused past its TTL (an injected stall): its lock expires
    wait_until(lambda: not redis_client.exists(a.key), timeout=5, what="a's lock expired")
    assert b.acquire()
    assert not a.renew() and a.lost.is_set()  # compare-and-extend refuses the stale token
    assert b.is_held()


def test_hold_renews_in_background_and_releases(redis_client, redis_prefix):
    a = LeaderLock(redis_client, redis_prefix, "job", ttl_ms=300)
    other = LeaderLock(redis_client, redis_prefix, "job", ttl_ms=300)
    with a.hold() as lost:
        assert lost is not None
        elapse(0.8)  # the behaviour: longer than the TTL, so only renewal keeps it
        assert a.is_held() and not lost.is_set()
        with other.hold() as none:
            assert none is None
    assert not a.is_held() and other.acquire()


def test_lost_lock_fires_cancellation_during_hold(redis_client, redis_prefix):
    a = LeaderLock(redis_client, redis_prefix, "job", ttl_ms=300)
    with a.hold() as lost:
        redis_client.delete(a.key)  # lock lost (expired, or Redis lost data)
        assert lost.wait(1.0)


def test_contention_resumes_after_redis_restart(tmp_path):
    """A private redis-server on a free loopback port goes away and comes back (empty): the holder's
    renewal fails and cancels its work; nobody acquires during the quiet period after the start, and
    afterwards the lock can be acquired again."""
    import pytest
    import redis

    from private_redis import PrivateRedis

    srv = PrivateRedis(tmp_path)
    try:
        client = srv.start()
        a = LeaderLock(client, "t:", "job", ttl_ms=300)
        srv.wait_until_acquirable(a)
        with a.hold() as lost:
            assert lost is not None
            srv.kill()
            assert lost.wait(3.0)  # renewal failed: the job is told to stop
            b = LeaderLock(client, "t:", "job", ttl_ms=1000)
            with pytest.raises(redis.ConnectionError):
                b.acquire()  # Redis is down: nobody leads, and the caller is told why
            client2 = srv.start()
            assert not b.acquire() and b.refusal == "restarting"  # back (empty): the quiet period first
            srv.wait_until_acquirable(b)
            assert b.acquire()  # then contention simply resumes
            assert not a.is_held() and client2.exists(b.key)
    finally:
        srv.stop()
