"""Ingestion's shared "the database refuses writes" state, kept in Redis (``<prefix>stats:infra``).

A database that answers ``SELECT 1`` may still refuse every write (read-only, disk full, lock or
statement timeouts, serialization failures). Such a failure is nobody's entry's fault, so it must not
spend the entries' delivery budget. When a batch fails that way the consumer records it here; while the
backoff runs (first :data:`DEFAULT_BACKOFF_S`, doubling up to :data:`DEFAULT_BACKOFF_CAP_S`), no consumer
reads or reclaims anything, so no delivery count moves. The first consumer past the backoff makes a
trial write that touches no row (:func:`magpie.stats.store.write_probe_error`) before it reads anything;
success clears the state (so does any commit), another infrastructure failure extends the backoff.
Concurrent trials that fail in the same round count as one failure. Times are the Redis server's clock.

Hash fields: ``failures`` (in a row), ``since_ms`` (first failure), ``last_ms``, ``retry_at_ms``,
``error`` (one line). The key expires after :data:`STATE_TTL_MS` without a failure, so a deployment
that went away leaves nothing behind.
"""

from __future__ import annotations

import redis as redis_lib

from magpie.stats import scripts
from magpie.base.redisconn import server_time
from magpie.queue.streams import infra_key, tagged_for, text

DEFAULT_BACKOFF_S = 1.0
"""Seconds of the first backoff after an infrastructure failure (``MAGPIE_STATS_INFRA_BACKOFF``)."""

DEFAULT_BACKOFF_CAP_S = 30.0
"""Most seconds between two trial writes (``MAGPIE_STATS_INFRA_BACKOFF_CAP``)."""

STATE_TTL_MS = 86_400_000
"""The state disappears a day after its last failure."""


def check(redis: redis_lib.Redis, prefix: str) -> tuple[int, int]:
    """``(retry_in_ms, failures)``: ms left of the running backoff (0 when ingestion may run) and
    infrastructure failures in a row (0 with no state). One round trip.

    Raises ``redis.RedisError`` when Redis is unreachable."""
    wait, failures = scripts.INFRA(redis, [infra_key(prefix, tagged_for(redis))], ["check"])
    return int(wait), int(failures)


def record_failure(
    redis: redis_lib.Redis,
    prefix: str,
    error: str,
    *,
    backoff_s: float = DEFAULT_BACKOFF_S,
    backoff_cap_s: float = DEFAULT_BACKOFF_CAP_S,
) -> tuple[int, int]:
    """Record one infrastructure failure and start (or lengthen) the backoff.

    Args:
        error: what failed, one line (cut to 300 characters; never a secret: database error texts only).
        backoff_s / backoff_cap_s: seconds of the first backoff / most seconds of any backoff; ``0``
            disables the backoff (every ingestion pass tries again; tests).
    Returns:
        ``(backoff_ms, failures)``: the backoff now running and the failures in a row.
    Raises:
        redis.RedisError: Redis unreachable.
    """
    first_ms = max(0, int(backoff_s * 1000))
    cap_ms = max(first_ms, int(backoff_cap_s * 1000))
    line = (error.strip().splitlines() or [""])[0][:300]
    wait, failures = scripts.INFRA(
        redis, [infra_key(prefix, tagged_for(redis))], ["fail", first_ms, cap_ms, line, STATE_TTL_MS]
    )
    return int(wait), int(failures)


def clear(redis: redis_lib.Redis, prefix: str) -> int:
    """A write succeeded: end the state. Returns the failures in a row it held (0 when there was none).

    Raises ``redis.RedisError`` when Redis is unreachable."""
    _, failures = scripts.INFRA(redis, [infra_key(prefix, tagged_for(redis))], ["clear"])
    return int(failures)


def read_state(redis: redis_lib.Redis, prefix: str) -> dict | None:
    """The state for status output, or ``None`` when ingestion writes fine (one round trip).

    Returns:
        ``{"failures": int, "since_ms": int, "last_ms": int, "retry_in_ms": int, "error": str}``
        (times on the Redis clock, Unix ms).
    Raises:
        redis.RedisError: Redis unavailable.
    """
    tagged = tagged_for(redis)
    if tagged:  # a cluster pipeline refuses TIME
        key = infra_key(prefix, tagged)
        raw, (sec, usec) = redis.hgetall(key), server_time(redis, key)
        return state_from(raw, sec * 1000 + usec // 1000)
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(infra_key(prefix, tagged))
    pipe.time()
    raw, (sec, usec) = pipe.execute()
    return state_from(raw, int(sec) * 1000 + int(usec) // 1000)


def state_from(raw: dict, now_ms: int) -> dict | None:
    """:func:`read_state`'s dict from the raw hash ``raw`` read at ``now_ms`` (Redis clock); ``None``
    when the hash is empty."""
    if not raw:
        return None
    f = {text(k): text(v) for k, v in raw.items()}

    def num(name: str) -> int:
        try:
            return int(float(f.get(name) or 0))
        except ValueError:
            return 0

    return {
        "failures": num("failures"),
        "since_ms": num("since_ms"),
        "last_ms": num("last_ms"),
        "retry_in_ms": max(0, num("retry_at_ms") - now_ms),
        "error": f.get("error", ""),
    }


__all__ = [
    "DEFAULT_BACKOFF_CAP_S",
    "DEFAULT_BACKOFF_S",
    "STATE_TTL_MS",
    "check",
    "clear",
    "read_state",
    "record_failure",
    "state_from",
]
