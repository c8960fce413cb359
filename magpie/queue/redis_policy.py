"""Refuse to run on a Redis that may evict schedule keys.

The schedule lives in Redis keys without a TTL; under memory pressure any ``maxmemory-policy`` other than
``noeviction`` lets Redis delete them (an ``allkeys-*`` policy any key, a ``volatile-*`` one keys with a
TTL such as leader locks), which silently drops routes from the schedule or ends a leader's lock early.
With ``noeviction`` Redis refuses writes instead, which magpie reports as errors and retries.

Workers and beat call :func:`verify_redis_policy_at_start` next to the encryption key check: a policy that
could evict is a :class:`~magpie.errors.MagpieError` (one line, exit status 2); a Redis that refuses
``CONFIG GET`` (managed services often rename or disable it) or cannot be reached yet is "unknown" and
only logged as a warning.
"""

from __future__ import annotations

import logging

from magpie.base import redisconn
from magpie.errors import MagpieError

log = logging.getLogger(__name__)

SAFE_POLICY = "noeviction"
"""The only ``maxmemory-policy`` under which Redis never deletes a key on its own."""


class EvictionPolicyError(MagpieError):
    """The schedule's Redis has a ``maxmemory-policy`` that can evict keys; the message names it."""


def eviction_policy(client) -> str | None:
    """The ``maxmemory-policy`` of the Redis behind ``client`` (redis-py client), or ``None`` if unknown.

    ``None`` when the server refuses ``CONFIG GET`` (renamed or disabled command, ACL) or answers without
    the parameter. Raises :class:`redis.ConnectionError` / :class:`redis.TimeoutError` when unreachable.
    """
    import redis

    if redisconn.is_cluster(client):  # every primary holds schedule keys: the worst policy among them
        found = [eviction_policy(n.redis_connection) for n in client.get_primaries()]
        unsafe = [p for p in found if p is not None and p != SAFE_POLICY]
        return unsafe[0] if unsafe else (SAFE_POLICY if SAFE_POLICY in found else None)
    try:
        reply = client.config_get("maxmemory-policy")
    except redis.ResponseError:
        return None
    value = reply.get("maxmemory-policy") if isinstance(reply, dict) else None
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return value.strip().lower() if value else None


def check_policy(policy: str | None) -> None:
    """Raise :class:`EvictionPolicyError` unless ``policy`` is ``noeviction`` or unknown (``None``).

    The message is one line naming the policy, the setting and the fix.
    """
    if policy is None or policy == SAFE_POLICY:
        return
    raise EvictionPolicyError(
        f"Redis at MAGPIE_REDIS_URL has maxmemory-policy {policy}, which can evict schedule keys; "
        f"set maxmemory-policy {SAFE_POLICY} (CONFIG SET maxmemory-policy {SAFE_POLICY}, and in redis.conf)")


def verify_redis_policy_at_start(settings=None, *, timeout_s: float = 5.0) -> str | None:
    """Check the schedule Redis's eviction policy at process start.

    Args:
        settings: :class:`magpie.config.Settings` (default: the process's).
        timeout_s: connect and reply timeout in seconds.
    Returns:
        The policy, or ``None`` when it could not be read (a warning is logged; the process starts).
    Raises:
        EvictionPolicyError: a policy other than ``noeviction``.
    """
    import redis

    from magpie.config import get_settings

    s = settings or get_settings()
    client = redisconn.connect(s.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        try:
            policy = eviction_policy(client)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("could not read Redis maxmemory-policy (MAGPIE_REDIS_URL unreachable: %s); "
                        "make sure it is %s", type(exc).__name__, SAFE_POLICY)
            return None
    finally:
        client.close()
    if policy is None:
        log.warning("Redis refused CONFIG GET maxmemory-policy; make sure it is %s, or schedule keys may be "
                    "evicted under memory pressure", SAFE_POLICY)
        return None
    check_policy(policy)
    return policy


def is_write_refusal(exc: BaseException) -> bool:
    """True for Redis refusing a write at ``maxmemory`` (``OOM command not allowed ...``)."""
    import redis

    return isinstance(exc, redis.OutOfMemoryError) or (
        isinstance(exc, redis.ResponseError) and "OOM" in str(exc).split(" ", 1)[0])


def memory_state(client) -> str:
    """One line naming Redis's memory state, e.g. ``used_memory 1.2M over maxmemory 1M (policy
    noeviction)``; ``memory state unknown`` when ``INFO memory`` fails too."""
    try:
        mem = client.info("memory")
    except Exception:  # noqa: BLE001 - the state line is best effort
        return "memory state unknown"
    return (f"used_memory {mem.get('used_memory_human', '?')} "
            f"over maxmemory {mem.get('maxmemory_human', '?')} "
            f"(policy {mem.get('maxmemory_policy', '?')})")


def refusal_line(client, exc: BaseException) -> str:
    """One line for a failed Redis write: ``Redis refuses writes: <memory state>`` when it was refused at
    ``maxmemory``, else ``Redis error: <first line>``."""
    if is_write_refusal(exc):
        return f"Redis refuses writes: {memory_state(client)}"
    first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
    return f"Redis error: {first}"
