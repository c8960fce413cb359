"""Throughput and lateness over time: a bounded ring of samples in Redis behind the dashboard's charts.

Every ``MAGPIE_WEB_SAMPLE_INTERVAL`` seconds a ``magpie web`` process reads the producer-side counters
(:func:`magpie.base.counters.read_counters`) and the schedule's totals (:meth:`RouteQueue.status`) and pushes
one JSON sample onto ``<prefix>web:samples``, trimmed to ``MAGPIE_WEB_SAMPLE_KEEP`` entries. Several
dashboard processes share the ring: a short ``SET NX`` guard (``<prefix>web:sampled``) lets one of them
write per interval. The ring only grows while a dashboard runs; Prometheus keeps the long history.

A sample holds cumulative counters; :func:`series` turns consecutive samples into rates and per-interval
lateness quantiles (estimated as the upper bound of the histogram bucket the quantile falls in).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading

import redis as redis_lib

from magpie.base.counters import LATENESS_BUCKETS, read_counters

log = logging.getLogger(__name__)


def ring_key(prefix: str) -> str:
    """The Redis list holding the samples, newest first."""
    return f"{prefix}web:samples"


def take_sample(r: redis_lib.Redis, prefix: str, queue) -> dict:
    """One sample now: ``{"t_ms", "checks", "outcomes", "lat_count", "lat_sum_s", "lat_buckets",
    "scheduled", "leased", "due_now", "dead", "oldest_lateness_s", "paused"}``.

    ``checks`` and the ``lat_*`` fields are cumulative counters; ``lat_buckets`` holds cumulative counts
    per bucket of :data:`magpie.base.counters.LATENESS_BUCKETS` plus ``+Inf``. Raises ``redis.RedisError``.
    """
    st = queue.status()
    c = read_counters(r, prefix)
    outcomes = c["checks"]
    tot = st["totals"]
    return {  # throughput counts finished checks: alive plus dead results
        "t_ms": st["now_ms"], "checks": outcomes.get("alive", 0) + outcomes.get("dead", 0),
        "outcomes": outcomes,
        "lat_count": c["lateness"]["count"], "lat_sum_s": c["lateness"]["sum_s"],
        "lat_buckets": [n for _, n in c["lateness"]["buckets"]],
        "scheduled": tot["scheduled"], "leased": tot["leased"], "due_now": tot["due_now"],
        "dead": tot["dead"],
        "oldest_lateness_s": tot["oldest_lateness_s"], "paused": st["paused"],
    }


def record(r: redis_lib.Redis, prefix: str, queue, *, interval_s: float, keep: int) -> dict | None:
    """Push one sample unless another process sampled less than 0.9 interval ago.

    Returns the sample written, or None when skipped. Raises ``redis.RedisError``.
    """
    if not r.set(f"{prefix}web:sampled", "1", nx=True, px=max(1, int(interval_s * 900))):
        return None
    sample = take_sample(r, prefix, queue)
    pipe = r.pipeline(transaction=False)
    pipe.lpush(ring_key(prefix), json.dumps(sample, separators=(",", ":")))
    pipe.ltrim(ring_key(prefix), 0, keep - 1)
    pipe.execute()
    return sample


def read_samples(r: redis_lib.Redis, prefix: str, limit: int) -> list[dict]:
    """The newest ``limit`` samples, oldest first (malformed entries are skipped)."""
    out = []
    for raw in r.lrange(ring_key(prefix), 0, limit - 1):
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    out.reverse()
    return out


def _quantile(deltas: list[int], q: float) -> float | None:
    """Upper bound (s) of the bucket holding quantile ``q`` of per-bucket cumulative count deltas."""
    total = deltas[-1] if deltas else 0
    if total <= 0:
        return None
    want = q * total
    bounds = list(LATENESS_BUCKETS) + [float("inf")]
    for bound, n in zip(bounds, deltas):
        if n >= want:
            return bound if bound != float("inf") else LATENESS_BUCKETS[-1] * 2
    return None


def series(samples: list[dict]) -> list[dict]:
    """Per-interval points from consecutive samples (oldest first).

    Returns ``[{"t_ms", "checks_per_s", "lateness_mean_s", "lateness_p50_s", "lateness_p99_s",
    "due_now", "leased", "scheduled", "dead", "oldest_lateness_s"}]``, one per pair of samples; the
    rates and quantiles are ``None`` over an interval with no checks, and a counter that went backwards
    (counters reset) gives ``None`` rates for that interval.
    """
    out = []
    for a, b in itertools.pairwise(samples):
        dt = (b["t_ms"] - a["t_ms"]) / 1000.0
        if dt <= 0:
            continue
        dn = b["checks"] - a["checks"]
        dc = b["lat_count"] - a["lat_count"]
        buckets = [y - x for x, y in zip(a.get("lat_buckets", []), b.get("lat_buckets", []))]
        ok = dn >= 0 and dc >= 0 and all(x >= 0 for x in buckets)
        point = {
            "t_ms": b["t_ms"],
            "checks_per_s": round(dn / dt, 3) if ok else None,
            "lateness_mean_s": round((b["lat_sum_s"] - a["lat_sum_s"]) / dc, 3) if ok and dc > 0 else None,
            "lateness_p50_s": _quantile(buckets, 0.5) if ok else None,
            "lateness_p99_s": _quantile(buckets, 0.99) if ok else None,
        }
        for k in ("due_now", "leased", "scheduled", "dead", "oldest_lateness_s"):
            point[k] = b.get(k)
        out.append(point)
    return out


class Sampler:
    """Background thread calling :func:`record` every ``interval_s`` seconds until :meth:`stop`.

    Args:
        r: Redis client; prefix: ``MAGPIE_REDIS_PREFIX``; queue: a :class:`~magpie.queue.RouteQueue`.
        interval_s: seconds between samples. keep: ring length.
    A failing sample (Redis down) is logged and retried at the next interval; the thread never dies of it.
    """

    def __init__(self, r: redis_lib.Redis, prefix: str, queue, *, interval_s: float, keep: int):
        self.r, self.prefix, self.queue = r, prefix, queue
        self.interval_s, self.keep = float(interval_s), int(keep)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="magpie-web-sampler", daemon=True)

    def start(self) -> Sampler:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to stop and wait up to ``timeout`` seconds for it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                record(self.r, self.prefix, self.queue, interval_s=self.interval_s, keep=self.keep)
            except Exception as exc:  # noqa: BLE001 - a chart gap, never a dead sampler
                log.warning("dashboard sample failed: %s", exc)
            self._stop.wait(self.interval_s)


__all__ = ["Sampler", "read_samples", "record", "ring_key", "series", "take_sample"]
