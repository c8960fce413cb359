"""Producer-side counters: what check workers and the stats producer count, kept in one Redis hash.

Producers never touch a Prometheus registry. They add to ``<prefix>metrics:counters`` in a single
pipelined round trip per check batch (:func:`record_check_batch`, :func:`count_stats_drops`); counters in
Redis survive worker restarts and are shared by every process, so there is no multiprocess registry to
manage. The metrics exporter (:mod:`magpie.metrics`) reads them back with :func:`read_counters`.

This module imports nothing of magpie: it sits below everything that counts.

Hash fields of ``<prefix>metrics:counters``: ``checks:<outcome>``, ``stale``,
``lateness:b:<upper bound in s>`` (one per fixed bucket, not cumulative, ``+Inf`` last),
``lateness:sum_ms``, ``lateness:count``, ``stats_dropped:<policy>``.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable, Mapping, Sequence

import redis as redis_lib

log = logging.getLogger(__name__)

LATENESS_BUCKETS: tuple[float, ...] = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)
"""Upper bounds in seconds of the check-lateness histogram buckets (``+Inf`` is implied)."""


def counters_key(prefix: str) -> str:
    """Key of the Redis hash holding the producer-side counters: ``f"{prefix}metrics:counters"``."""
    return f"{prefix}metrics:counters"


def _bucket_field(seconds: float) -> str:
    i = bisect.bisect_left(LATENESS_BUCKETS, seconds)
    return "lateness:b:" + (repr(LATENESS_BUCKETS[i]) if i < len(LATENESS_BUCKETS) else "+Inf")


def record_check_batch(
    redis: redis_lib.Redis,
    prefix: str,
    outcomes: Mapping[str, int],
    stale: int,
    lateness_ms: Sequence[float],
) -> bool:
    """Add one check batch's figures to the Redis counters in one pipelined round trip.

    Args:
        redis: client on the schedule's Redis.
        prefix: key prefix (``MAGPIE_REDIS_PREFIX``).
        outcomes: checks per outcome label, e.g. ``{"alive": 12, "dead": 3, "lease_lost": 1}``
            (see :func:`check_outcomes`); zero counts are skipped.
        stale: completions rejected as stale (the lease had moved on) in this batch.
        lateness_ms: per check, its start time minus its due time in **milliseconds**
            (see :func:`lease_lateness_ms`); negative values count in the lowest bucket.
    Returns:
        True when recorded; False when Redis refused (logged, never raised: metrics must not fail a check).
    """
    pipe = redis.pipeline(transaction=False)
    key = counters_key(prefix)
    n = 0
    for outcome, count in outcomes.items():
        if count:
            pipe.hincrby(key, f"checks:{outcome}", int(count))
            n += 1
    if stale:
        pipe.hincrby(key, "stale", int(stale))
        n += 1
    if lateness_ms:
        buckets: dict[str, int] = {}
        total = 0.0
        for ms in lateness_ms:
            f = _bucket_field(ms / 1000.0)
            buckets[f] = buckets.get(f, 0) + 1
            total += ms
        for f, c in buckets.items():
            pipe.hincrby(key, f, c)
        pipe.hincrbyfloat(key, "lateness:sum_ms", total)
        pipe.hincrby(key, "lateness:count", len(lateness_ms))
        n += 1
    if not n:
        return True
    try:
        pipe.execute()
        return True
    except redis_lib.RedisError as exc:
        log.warning("could not record check metrics: %s", exc)
        return False


def count_stats_drops(redis: redis_lib.Redis, prefix: str, policy: str, dropped: int) -> None:
    """Count ``dropped`` results lost to the stream bound under ``policy``
    (``magpie_statistics_dropped_total{policy}``).

    Never raises (a failure is logged)."""
    try:
        redis.hincrby(counters_key(prefix), f"stats_dropped:{policy}", int(dropped))
    except redis_lib.RedisError as exc:
        log.warning("could not count %d dropped results: %s", dropped, exc)


def lease_lateness_ms(leases: Iterable, now_ms: float | None = None) -> list[float]:
    """Lateness of each claimed route: start time minus due time, in ms.

    Args:
        leases: :class:`magpie.queue.Lease` objects or their ``to_dict()`` dicts; the due time is the
            lease's ``previous_score`` (for a re-claimed expired lease, the old lease's expiry).
        now_ms: start time in Unix ms on this process's clock (default: now); each lease's
            ``server_offset_ms`` moves it onto the Redis clock the scores use.
    """
    now = time.time() * 1000 if now_ms is None else now_ms
    out = []
    for le in leases:
        get = le.get if isinstance(le, dict) else lambda k, d=None, _le=le: getattr(_le, k, d)
        try:
            due = float(get("previous_score"))
        except (TypeError, ValueError):
            continue
        out.append(now + float(get("server_offset_ms", 0.0) or 0.0) - due)
    return out


def check_outcomes(report, entries: Iterable[Mapping[str, str]] = ()) -> dict[str, int]:
    """Outcome counts of one check batch for :func:`record_check_batch`.

    Args:
        report: :class:`magpie.checkpool.BatchReport` (``lease_lost``, ``aborted``, ``malformed``,
            ``retried``).
        entries: the published result entries (``alive`` ``"1"``/``"0"``) of that batch.
    Returns:
        ``{"alive", "dead", "lease_lost", "aborted", "malformed", "retried"}`` -> int.
    """
    alive = dead = 0
    for e in entries:
        if e.get("alive") == "1":
            alive += 1
        else:
            dead += 1
    return {
        "alive": alive,
        "dead": dead,
        "lease_lost": int(getattr(report, "lease_lost", 0)),
        "aborted": int(getattr(report, "aborted", 0)),
        "malformed": int(getattr(report, "malformed", 0)),
        "retried": int(getattr(report, "retried", 0)),
    }


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def read_counters(redis: redis_lib.Redis, prefix: str) -> dict:
    """Decode the counters hash.

    Returns:
        ``{"checks": {outcome: int}, "stale": int, "dropped": {policy: int}, "lateness": {"buckets":
        [(upper bound s or inf, cumulative count)], "sum_s": float, "count": int}}``.
    Raises:
        redis.RedisError: Redis unavailable.
    """
    raw = {_s(k): _s(v) for k, v in redis.hgetall(counters_key(prefix)).items()}
    checks: dict[str, int] = {}
    dropped: dict[str, int] = {}
    per_bucket: dict[str, int] = {}
    for k, v in raw.items():
        if k.startswith("checks:"):
            checks[k[7:]] = int(v)
        elif k.startswith("stats_dropped:"):
            dropped[k[14:]] = int(v)
        elif k.startswith("lateness:b:"):
            per_bucket[k[11:]] = int(v)
    cum = 0
    buckets: list[tuple[float, int]] = []
    for b in LATENESS_BUCKETS:
        cum += per_bucket.get(repr(b), 0)
        buckets.append((b, cum))
    cum += per_bucket.get("+Inf", 0)
    buckets.append((float("inf"), cum))
    return {
        "checks": checks,
        "stale": int(raw.get("stale", 0)),
        "dropped": dropped,
        "lateness": {
            "buckets": buckets,
            "sum_s": float(raw.get("lateness:sum_ms", 0.0)) / 1000.0,
            "count": int(raw.get("lateness:count", 0)),
        },
    }



__all__ = [
    "LATENESS_BUCKETS",
    "check_outcomes",
    "count_stats_drops",
    "counters_key",
    "lease_lateness_ms",
    "read_counters",
    "record_check_batch",
]
