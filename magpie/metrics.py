"""Prometheus metrics: counters check tasks keep in Redis, and a collector that reads state at scrape time.

Two halves:

* **Producers** (check tasks, the stats producer) never touch a Prometheus registry. They add to one Redis
  hash, ``<prefix>metrics:counters``, in a single pipelined round trip per check batch
  (:func:`record_check_batch`, :func:`count_stats_drops`). Counters in Redis survive worker restarts and
  are shared by every process, so there is no multiprocess registry to manage.
* **The exporter** (:class:`MagpieCollector`) reads everything at scrape time: those counters, the route
  schedule (:meth:`magpie.queue.RouteQueue.status`), the results stream, the leader locks and the
  ``maintenance_runs`` table. ``magpie metrics --port N`` serves it as a standalone process; a Celery
  worker started with ``MAGPIE_METRICS_PORT`` serves the same collector from its main process (see
  the worker hook in :mod:`magpie.worker`). Every exporter shows the same, deployment-wide figures: scrape one.

Hash fields of ``<prefix>metrics:counters``: ``checks:<outcome>``, ``stale``,
``lateness:b:<upper bound in s>`` (one per fixed bucket, not cumulative, ``+Inf`` last),
``lateness:sum_ms``, ``lateness:count``, ``stats_dropped:<policy>``.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import redis as redis_lib
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

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

OTHER_LEADER_JOBS: tuple[str, ...] = ("respread", "alerts", "outbox-housekeeping")
"""Leader-lock names outside the maintenance registry reported by ``magpie_leader_job_active``."""


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
        report: :class:`magpie.cycle.BatchReport` (``lease_lost``, ``aborted``, ``malformed``, ``retried``).
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


# ------------------------------------------------------------------------------------------- collector


class MagpieCollector:
    """Prometheus collector reading magpie's state at scrape time (register it on a
    :class:`prometheus_client.CollectorRegistry`).

    Args:
        settings: :class:`magpie.config.Settings` (prefix, shards, URLs).
        redis: client to use (default: one from ``MAGPIE_REDIS_URL`` with 2-second socket timeouts and no
            retries, so a scrape fails fast).
        engine: engine to use (default: one on ``MAGPIE_DATABASE_URL`` with a 2-second connect timeout
            and a 5-second statement timeout).

    A source that cannot be read leaves its metrics out of that scrape and reports
    ``magpie_exporter_source_up{source="redis"|"postgres"} 0``; a scrape never fails as a whole.
    """

    def __init__(self, settings, *, redis: redis_lib.Redis | None = None, engine=None):
        self.settings = settings
        self._redis = redis
        self._engine = engine
        self._lock = threading.Lock()

    @property
    def redis(self) -> redis_lib.Redis:
        if self._redis is None:
            with self._lock:
                if self._redis is None:
                    from redis.backoff import NoBackoff
                    from redis.retry import Retry

                    self._redis = redis_lib.Redis.from_url(
                        self.settings.redis_url,
                        socket_timeout=2.0,
                        socket_connect_timeout=2.0,
                        retry=Retry(NoBackoff(), 0),
                    )
        return self._redis

    @property
    def engine(self):
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    import sqlalchemy as sa

                    self._engine = sa.create_engine(
                        self.settings.database_url,
                        pool_pre_ping=True,
                        pool_size=1,
                        max_overflow=1,
                        connect_args={"connect_timeout": 2, "options": "-c statement_timeout=5000"},
                    )
        return self._engine

    def describe(self):  # no up-front description: metrics are read at scrape time
        return []

    def collect(self):
        up = GaugeMetricFamily(
            "magpie_exporter_source_up",
            "1 when the exporter could read the source this scrape",
            labels=["source"],
        )
        for source, reader in (("redis", self._redis_metrics), ("postgres", self._pg_metrics)):
            try:
                families = list(reader())
            except Exception as exc:  # noqa: BLE001 - one source down must not fail the scrape
                log.warning("metrics: cannot read %s: %s", source, exc)
                up.add_metric([source], 0)
                continue
            up.add_metric([source], 1)
            yield from families
        yield up

    # -- Redis -----------------------------------------------------------------------------------------
    def _redis_metrics(self):
        from magpie.queue import QueueKeys, RouteQueue
        from magpie.stats.stream import pending_summary
        from magpie.stats.upkeep import replay_floor

        s = self.settings
        r = self.redis
        prefix = s.redis_prefix

        leader = GaugeMetricFamily(
            "magpie_leader_job_active", "1 while some process holds the job's leader lock", labels=["job"]
        )
        names = list(_maintenance_job_names()) + [n for n in OTHER_LEADER_JOBS]
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.exists(f"{prefix}leader:{name}")
        for name, held in zip(names, pipe.execute()):
            leader.add_metric([name], 1.0 if held else 0.0)
        yield leader

        c = read_counters(r, prefix)
        checks = CounterMetricFamily("magpie_checks", "Checks by outcome", labels=["outcome"])
        for outcome, n in sorted(c["checks"].items()):
            checks.add_metric([outcome], n)
        yield checks
        yield CounterMetricFamily(
            "magpie_stale_completions_rejected",
            "Check completions rejected because the lease had moved on",
            value=c["stale"],
        )
        lat = c["lateness"]
        hist = HistogramMetricFamily("magpie_check_lateness_seconds", "Check start time minus its due time")
        hist.add_metric(
            [],
            buckets=[("+Inf" if b == float("inf") else repr(b), n) for b, n in lat["buckets"]],
            sum_value=lat["sum_s"],
        )
        yield hist
        dropped = CounterMetricFamily(
            "magpie_statistics_dropped", "Check results lost to the results stream bound", labels=["policy"]
        )
        for policy, n in sorted(c["dropped"].items()):
            dropped.add_metric([policy], n)
        yield dropped

        summary = pending_summary(r, prefix)
        yield GaugeMetricFamily(
            "magpie_statistics_stream_length", "Entries in the results stream", value=summary["length"]
        )
        backlog = summary["lag"] if summary["lag"] is not None else summary["length"]
        yield GaugeMetricFamily(
            "magpie_statistics_backlog", "Results not yet delivered to a stats consumer", value=backlog
        )
        yield GaugeMetricFamily(
            "magpie_statistics_pending",
            "Results delivered to a consumer and not yet acknowledged",
            value=summary["pending"],
        )
        yield GaugeMetricFamily(
            "magpie_statistics_consumers", "Consumers in the stats consumer group", value=summary["consumers"]
        )
        yield GaugeMetricFamily(
            "magpie_statistics_dead_letters",
            "Entries in the statistics dead-letter stream",
            value=summary["dead"],
        )
        floor = replay_floor(r, prefix)
        if floor is not None:
            yield GaugeMetricFamily(
                "magpie_statistics_replay_floor_timestamp_seconds",
                "Time of the oldest stream entry that may still be delivered again (replay ledger floor)",
                value=floor.timestamp,
            )

        q = RouteQueue(r, QueueKeys(prefix, s.queue_shards), interval_ms=int(s.check_interval * 1000))
        st = q.status()
        fams = {
            "scheduled": GaugeMetricFamily("magpie_queue_depth", "Routes in the shard", labels=["shard"]),
            "leased": GaugeMetricFamily("magpie_queue_leased", "Routes under a live lease", labels=["shard"]),
            "expired_leases": GaugeMetricFamily(
                "magpie_queue_expired_leases", "Leases past expiry, not yet reclaimed", labels=["shard"]
            ),
            "due_now": GaugeMetricFamily("magpie_queue_due_now", "Claimable routes", labels=["shard"]),
            "oldest_lateness_s": GaugeMetricFamily(
                "magpie_queue_oldest_lateness_seconds",
                "Now minus the oldest claimable score",
                labels=["shard"],
            ),
        }
        for sh in st["shards"]:
            label = sh["shard"].rsplit(":", 1)[-1]
            for field, fam in fams.items():
                fam.add_metric([label], sh[field])
        yield from fams.values()
        yield GaugeMetricFamily(
            "magpie_queue_dead_letters", "Dead-lettered routes", value=st["totals"]["dead"]
        )
        yield GaugeMetricFamily(
            "magpie_queue_paused", "1 while claiming is paused", value=1 if st["paused"] else 0
        )

    # -- PostgreSQL ------------------------------------------------------------------------------------
    def _pg_metrics(self):
        from magpie.maintenance.runner import read_job_status

        rows = read_job_status(self.engine)
        last_ok = GaugeMetricFamily(
            "magpie_maintenance_last_success_timestamp_seconds",
            "End of the job's last successful pass",
            labels=["job"],
        )
        last_start = GaugeMetricFamily(
            "magpie_maintenance_last_start_timestamp_seconds", "Start of the job's last pass", labels=["job"]
        )
        failures = CounterMetricFamily("magpie_maintenance_failures", "Failed passes", labels=["job"])
        runs = CounterMetricFamily("magpie_maintenance_runs", "Passes started", labels=["job"])
        for row in rows:
            job = row["job"]
            if row["last_success_at"] is not None:
                last_ok.add_metric([job], row["last_success_at"].timestamp())
            if row["last_started_at"] is not None:
                last_start.add_metric([job], row["last_started_at"].timestamp())
            failures.add_metric([job], row["failures_total"])
            runs.add_metric([job], row["runs_total"])
        return [last_ok, last_start, failures, runs]


def _maintenance_job_names() -> list[str]:
    from magpie.maintenance.registry import JOBS

    return list(JOBS)


def build_registry(settings, *, redis: redis_lib.Redis | None = None, engine=None) -> CollectorRegistry:
    """A fresh registry holding one :class:`MagpieCollector` (no process or platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MagpieCollector(settings, redis=redis, engine=engine))
    return registry


def serve(settings, host: str = "127.0.0.1", port: int = 9464, *, registry: CollectorRegistry | None = None):
    """Serve ``/metrics`` (Prometheus text format) from a background thread.

    Args:
        host: bind address; port: TCP port (``0`` picks a free one: read it from ``server.server_port``).
        registry: default :func:`build_registry` ``(settings)``.
    Returns:
        ``(server, thread)``; stop with ``server.shutdown(); server.server_close()``.
    Raises:
        OSError: the address is in use or cannot be bound.
    """
    registry = registry or build_registry(settings)
    return start_http_server(port, addr=host, registry=registry)


__all__ = [
    "LATENESS_BUCKETS",
    "MagpieCollector",
    "build_registry",
    "check_outcomes",
    "count_stats_drops",
    "counters_key",
    "lease_lateness_ms",
    "read_counters",
    "record_check_batch",
    "serve",
]
