"""The per-token rate limit of the program API: a token bucket in Redis, one atomic script per request.

Each principal (API token id, or ``web`` for ``MAGPIE_WEB_TOKEN``) has a bucket of ``MAGPIE_API_BURST``
requests refilled at ``MAGPIE_API_RATE`` per second, kept in ``<prefix>{api}:rate:<key>`` and changed only
by ``lua/api_rate.lua`` on the Redis server clock, so every ``magpie web`` process shares one bucket per
token. Refused requests are counted per role in ``<prefix>{api}:limited``; the metrics exporter publishes
them as ``magpie_api_rate_limited_total``.
"""

from __future__ import annotations

import redis as redis_lib
from prometheus_client.core import CounterMetricFamily

from magpie.apitokens.models import ROLES
from magpie.stats.scripts import StreamScript

_SCRIPT = StreamScript("api_rate")


def _keys(prefix: str, key: str) -> tuple[str, str]:
    return f"{prefix}{{api}}:rate:{key}", f"{prefix}{{api}}:limited"


def take(client: redis_lib.Redis, prefix: str, key: str, role: str, *, rate: float, burst: int) -> float | None:
    """Take one request from ``key``'s bucket.

    Args:
        client: redis-py client. prefix: ``MAGPIE_REDIS_PREFIX``. key: the principal's key. role: counted
            under this label when refused. rate: requests per second. burst: bucket size.
    Returns:
        None when the request may go on, else the seconds to wait before the next one would be taken.
    Raises:
        redis.RedisError: Redis is unreachable.
    """
    ok, wait_ms = _SCRIPT(client, _keys(prefix, key), [repr(float(rate)), int(burst), role])
    return None if int(ok) == 1 else max(int(wait_ms), 1) / 1000.0


def limited_counts(client: redis_lib.Redis, prefix: str) -> dict[str, int]:
    """Refused requests so far, by role (every role present, 0 when none)."""
    raw = client.hgetall(_keys(prefix, "")[1])
    got = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
    return {role: got.get(role, 0) for role in ROLES} | got


def families(client: redis_lib.Redis, prefix: str):
    """The exporter's family ``magpie_api_rate_limited_total{role}``."""
    fam = CounterMetricFamily("magpie_api_rate_limited", "API requests refused by the per-token rate limit",
                              labels=["role"])
    for role, n in sorted(limited_counts(client, prefix).items()):
        fam.add_metric([role], n)
    yield fam


__all__ = ["families", "limited_counts", "take"]
