"""Producer-side counters: what check workers count (checks, results dropped), kept in one Redis hash.

Producers never touch a Prometheus registry. They add to ``<prefix>metrics:counters`` in a single
pipelined round trip per check batch (:func:`record_check_batch`, :func:`count_stats_drops`); counters in
Redis survive worker restarts and are shared by every process, so there is no multiprocess registry to
manage. The metrics exporter (:mod:`magpie.observability.metrics`) reads them back with :func:`read_counters`.

This module imports nothing of magpie: it sits below everything that counts.

Hash fields of ``<prefix>metrics:counters``: ``checks:<outcome>``, ``stale``,
``lateness:b:<upper bound in s>`` (one per fixed bucket, not cumulative, ``+Inf`` last),
``lateness:sum_ms``, ``lateness:count``, ``stats_dropped:<policy>``, and the check latency that
ingestion observes as it stores results (:func:`record_check_latency`): ``latency:b:<bound>``,
``latency:sum_ms``, ``latency:count`` (alive checks only: a dead check has no latency); and the
claim-to-start histograms (:func:`record_start_timings`): ``c2s:...`` (claimed -> started) and one per
stage, ``stage:<stage>:...`` for each of :data:`START_STAGES`.
"""

from __future__ import annotations

import bisect
import functools
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

LATENCY_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
"""Upper bounds in seconds of the check-latency histogram buckets (``+Inf`` is implied)."""

START_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                                     120.0, 300.0)
"""Upper bounds in seconds of the claim-to-start histograms' buckets (``+Inf`` is implied)."""

START_STAGES: tuple[str, ...] = ("dispatch", "transit", "admit", "wait")
"""The stages of a lease's way from claim to start: ``dispatch`` (claimed -> its message sent), ``transit``
(sent -> received by a check process), ``admit`` (received -> on the pool's event loop), ``wait``
(admitted -> started in a free slot)."""

CHECK_OUTCOMES: tuple[str, ...] = ("alive", "dead", "lease_lost", "aborted", "malformed", "retried")
"""Every outcome :func:`check_outcomes` counts (the exporter shows each, zero until counted)."""


def counters_key(prefix: str) -> str:
    """Key of the Redis hash holding the producer-side counters: ``f"{prefix}metrics:counters"``."""
    return f"{prefix}metrics:counters"


@functools.lru_cache(maxsize=64)
def _bucket_names(head: str, bounds: tuple[float, ...]) -> tuple[str, ...]:
    """Field names of histogram ``head``'s buckets: one per bound, then ``+Inf``."""
    return tuple(f"{head}:b:{b!r}" for b in bounds) + (f"{head}:b:+Inf",)


def _bucket_field(seconds: float, bounds: Sequence[float] = LATENESS_BUCKETS, head: str = "lateness") -> str:
    return _bucket_names(head, tuple(bounds))[bisect.bisect_left(bounds, seconds)]


def _bucket_counts(values: Iterable[float], bounds: tuple[float, ...], head: str, per: float = 1.0
                   ) -> dict[str, int]:
    """Values per bucket field of histogram ``head`` (each value divided by ``per``, e.g. 1000.0 for ms
    against bounds in seconds); empty buckets left out."""
    counts = [0] * (len(bounds) + 1)
    find = bisect.bisect_left
    for v in values:
        counts[find(bounds, v / per)] += 1
    return {name: c for name, c in zip(_bucket_names(head, bounds), counts) if c}


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
            (start time minus ``previous_score`` on the Redis clock); negative values count in the lowest bucket.
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
        for f, c in _bucket_counts(lateness_ms, LATENESS_BUCKETS, "lateness", 1000.0).items():
            pipe.hincrby(key, f, c)
        pipe.hincrbyfloat(key, "lateness:sum_ms", float(sum(lateness_ms)))
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


def _add_histogram(pipe, key: str, head: str, seconds: Sequence[float], bounds: Sequence[float]) -> None:
    for f, c in _bucket_counts(seconds, tuple(bounds), head).items():
        pipe.hincrby(key, f, c)
    pipe.hincrbyfloat(key, f"{head}:sum_ms", sum(seconds) * 1000.0)
    pipe.hincrby(key, f"{head}:count", len(seconds))


def record_start_timings(redis: redis_lib.Redis, prefix: str, samples: Sequence) -> bool:
    """Add started leases' claim-to-start figures and their lateness, in one pipelined round trip.

    Args:
        samples: :class:`magpie.pipeline.checkpool.StartTiming`-shaped objects (``claimed``, ``dispatched``,
            ``received``, ``admitted``, ``started``, ``due``: Unix ms, 0 where unknown). A lease without
            a claim stamp counts in the lateness only; a stage with an unknown end counts nothing.
            Negative spans (clock skew across hosts) count as 0.
    Returns:
        True when recorded; False when Redis refused (logged, never raised).
    """
    if not samples:
        return True
    key = counters_key(prefix)
    pipe = redis.pipeline(transaction=False)
    c2s: list[float] = []
    stages: dict[str, list[float]] = {name: [] for name in START_STAGES}
    lateness: list[float] = []
    for t in samples:
        if t.due:
            lateness.append(t.started - t.due)
        if t.claimed:
            c2s.append(max(0.0, (t.started - t.claimed) / 1000.0))
            if t.dispatched:
                stages["dispatch"].append(max(0.0, (t.dispatched - t.claimed) / 1000.0))
                stages["transit"].append(max(0.0, (t.received - t.dispatched) / 1000.0))
        stages["admit"].append(max(0.0, (t.admitted - t.received) / 1000.0))
        stages["wait"].append(max(0.0, (t.started - t.admitted) / 1000.0))
    if c2s:
        _add_histogram(pipe, key, "c2s", c2s, START_BUCKETS)
    for name, vals in stages.items():
        if vals:
            _add_histogram(pipe, key, f"stage:{name}", vals, START_BUCKETS)
    if lateness:
        _add_histogram(pipe, key, "lateness", [ms / 1000.0 for ms in lateness], LATENESS_BUCKETS)
    try:
        pipe.execute()
        return True
    except redis_lib.RedisError as exc:
        log.warning("could not record lease start timings: %s", exc)
        return False


def count_stats_drops(redis: redis_lib.Redis, prefix: str, policy: str, dropped: int) -> None:
    """Count ``dropped`` results lost to the stream bound under ``policy``
    (``magpie_statistics_dropped_total{policy}``).

    Never raises (a failure is logged)."""
    try:
        redis.hincrby(counters_key(prefix), f"stats_dropped:{policy}", int(dropped))
    except redis_lib.RedisError as exc:
        log.warning("could not count %d dropped results: %s", dropped, exc)


def record_check_latency(redis: redis_lib.Redis, prefix: str, latencies_ms: Iterable[float | None]) -> bool:
    """Add stored check results' latencies to the check-latency histogram, in one pipelined round trip.

    Called by ingestion once a batch of results is committed to PostgreSQL (never on the check path).

    Args:
        redis: client on the schedule's Redis.
        prefix: key prefix.
        latencies_ms: per stored result, its latency in **milliseconds**; ``None`` (a dead check: no
            latency measured) is skipped.
    Returns:
        True when recorded (or nothing to record); False when Redis refused (logged, never raised).
    """
    fields: dict[str, int] = {}
    total = 0.0
    for ms in latencies_ms:
        if ms is None:
            continue
        f = _bucket_field(max(0.0, float(ms)) / 1000.0, LATENCY_BUCKETS, "latency")
        fields[f] = fields.get(f, 0) + 1
        total += float(ms)
    if not fields:
        return True
    key = counters_key(prefix)
    pipe = redis.pipeline(transaction=False)
    for f, n in fields.items():
        pipe.hincrby(key, f, n)
    pipe.hincrbyfloat(key, "latency:sum_ms", total)
    pipe.hincrby(key, "latency:count", sum(fields.values()))
    try:
        pipe.execute()
        return True
    except redis_lib.RedisError as exc:
        log.warning("could not record check latency: %s", exc)
        return False


def check_outcomes(report, entries: Iterable[Mapping[str, str]] = ()) -> dict[str, int]:
    """Outcome counts of one check batch for :func:`record_check_batch`.

    Args:
        report: :class:`magpie.pipeline.checkpool.BatchReport` (``lease_lost``, ``aborted``, ``malformed``,
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


def _histogram(raw: Mapping[str, str], head: str, bounds: Sequence[float]) -> dict:
    """Cumulative buckets, sum (s) and count of the histogram whose fields start with ``head``."""
    cum = 0
    buckets: list[tuple[float, int]] = []
    for b in (*bounds, float("inf")):
        cum += int(raw.get(f"{head}:b:" + ("+Inf" if b == float("inf") else repr(b)), 0))
        buckets.append((b, cum))
    return {
        "buckets": buckets,
        "sum_s": float(raw.get(f"{head}:sum_ms", 0.0)) / 1000.0,
        "count": int(raw.get(f"{head}:count", 0)),
    }


def read_counters(redis: redis_lib.Redis, prefix: str) -> dict:
    """Decode the counters hash.

    Returns:
        ``{"checks": {outcome: int}, "stale": int, "dropped": {policy: int}, "lateness": H,
        "latency": H, "claim_to_start": H, "start_stages": {stage: H}, "limited": {(limiter kind,
        event): int}}`` (rate-limit events, :mod:`magpie.coordination.ratelimit`; latency: alive checks as stored
        by ingestion; stages: :data:`START_STAGES`), where ``H`` is ``{"buckets":
        [(upper bound s or inf, cumulative count)], "sum_s": float, "count": int}``; only outcomes and
        policies counted at least once appear.
    Raises:
        redis.RedisError: Redis unavailable.
    """
    raw = {_s(k): _s(v) for k, v in redis.hgetall(counters_key(prefix)).items()}
    checks: dict[str, int] = {}
    dropped: dict[str, int] = {}
    limited: dict[tuple[str, str], int] = {}
    for k, v in raw.items():
        if k.startswith("checks:"):
            checks[k[7:]] = int(v)
        elif k.startswith("limited:"):
            kind, _, event = k[8:].partition(":")
            limited[(kind, event)] = int(v)
        elif k.startswith("stats_dropped:"):
            dropped[k[14:]] = int(v)
    return {
        "checks": checks,
        "stale": int(raw.get("stale", 0)),
        "dropped": dropped,
        "limited": limited,
        "lateness": _histogram(raw, "lateness", LATENESS_BUCKETS),
        "latency": _histogram(raw, "latency", LATENCY_BUCKETS),
        "claim_to_start": _histogram(raw, "c2s", START_BUCKETS),
        "start_stages": {name: _histogram(raw, f"stage:{name}", START_BUCKETS) for name in START_STAGES},
    }


__all__ = [
    "CHECK_OUTCOMES",
    "LATENCY_BUCKETS",
    "LATENESS_BUCKETS",
    "START_BUCKETS",
    "START_STAGES",
    "check_outcomes",
    "count_stats_drops",
    "counters_key",
    "read_counters",
    "record_check_batch",
    "record_check_latency",
    "record_start_timings",
]
