"""The Prometheus exporter: a collector that reads magpie's state at scrape time.

The write side is elsewhere: check workers and the stats producer only add to Redis counters
(:mod:`magpie.counters`). The exporter (:class:`MagpieCollector`) composes the read functions each owner
exposes, and adds nothing of its own to what they return:

* counters: :func:`magpie.counters.read_counters`;
* the route schedule: :meth:`magpie.queue.RouteQueue.status`;
* the results stream: :func:`magpie.stats.status.pending_summary` and
  :func:`magpie.stats.upkeep.replay_floor`;
* leader locks: :func:`magpie.leader.locks_held` over the maintenance jobs' locks
  (:data:`magpie.maintenance.registry.JOBS`) and :data:`magpie.leader.STANDING_LOCKS`;
* maintenance passes: :func:`magpie.maintenance.runner.read_job_status`.

``magpie metrics --port N`` serves it as a standalone process; a Celery worker started with
``MAGPIE_METRICS_PORT`` serves the same collector from its main process (see the worker hook in
:mod:`magpie.worker`). Every exporter shows the same, deployment-wide figures: scrape one.
"""

from __future__ import annotations

import logging
import threading

import redis as redis_lib
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from magpie.counters import read_counters
from magpie.leader import STANDING_LOCKS, locks_held
from magpie.maintenance.registry import JOBS
from magpie.maintenance.runner import read_job_status
from magpie.queue import QueueKeys, RouteQueue
from magpie.stats.status import pending_summary
from magpie.stats.upkeep import replay_floor

log = logging.getLogger(__name__)


def _scrape_redis(settings) -> redis_lib.Redis:
    """A client that fails fast (2-second socket timeouts, no retries): a scrape must not hang."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis_lib.Redis.from_url(
        settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0, retry=Retry(NoBackoff(), 0)
    )


def _scrape_engine(settings):
    """An engine with a 2-second connect timeout and a 5-second statement timeout, one connection."""
    import sqlalchemy as sa

    return sa.create_engine(
        settings.database_url,
        pool_pre_ping=True,
        pool_size=1,
        max_overflow=1,
        connect_args={"connect_timeout": 2, "options": "-c statement_timeout=5000"},
    )


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
        """The Redis client (built on first use unless one was given)."""
        if self._redis is None:
            with self._lock:
                if self._redis is None:
                    self._redis = _scrape_redis(self.settings)
        return self._redis

    @property
    def engine(self):
        """The SQLAlchemy engine (built on first use unless one was given)."""
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    self._engine = _scrape_engine(self.settings)
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
        r = self.redis
        prefix = self.settings.redis_prefix
        yield self._leaders(r, prefix)
        yield from _counter_families(read_counters(r, prefix))
        yield from _stream_families(r, prefix)
        s = self.settings
        # Built directly, not by RouteQueue.from_settings: a scrape only reads (no layout check, no write).
        queue = RouteQueue(r, QueueKeys(prefix, s.queue_shards), interval_ms=int(s.check_interval * 1000))
        yield from _queue_families(queue.status())

    @staticmethod
    def _leaders(r: redis_lib.Redis, prefix: str) -> GaugeMetricFamily:
        leader = GaugeMetricFamily(
            "magpie_leader_job_active", "1 while some process holds the job's leader lock", labels=["job"]
        )
        locks = {name: job.lock for name, job in JOBS.items()} | {name: name for name in STANDING_LOCKS}
        for name, held in zip(locks, locks_held(r, prefix, list(locks.values()))):
            leader.add_metric([name], 1.0 if held else 0.0)
        return leader

    # -- PostgreSQL ------------------------------------------------------------------------------------
    def _pg_metrics(self):
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


def _counter_families(c: dict):
    """Families of the producer-side counters (:func:`magpie.counters.read_counters`)."""
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


def _stream_families(r: redis_lib.Redis, prefix: str):
    """Families of the results stream (backlog, pending, consumers, dead letters, replay floor)."""
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
        "Entries in the statistics dead-letter stream (magpie stats redrive moves them back)",
        value=summary["dead"],
    )
    inf = summary.get("infra")
    yield GaugeMetricFamily(
        "magpie_statistics_ingest_backing_off",
        "1 while ingestion waits for the database to accept writes again (nothing is read meanwhile)",
        value=0 if inf is None else 1,
    )
    yield GaugeMetricFamily(
        "magpie_statistics_ingest_infra_failures",
        "Infrastructure failures of the database in a row seen by ingestion (0 once a write succeeds)",
        value=0 if inf is None else inf["failures"],
    )
    floor = replay_floor(r, prefix)
    if floor is not None:
        yield GaugeMetricFamily(
            "magpie_statistics_replay_floor_timestamp_seconds",
            "Time of the oldest stream entry that may still be delivered again (replay ledger floor)",
            value=floor.timestamp,
        )


def _queue_families(st: dict):
    """Families of the route schedule (:meth:`magpie.queue.RouteQueue.status`), per shard and in total."""
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
    yield GaugeMetricFamily("magpie_queue_dead_letters", "Dead-lettered routes", value=st["totals"]["dead"])
    yield GaugeMetricFamily(
        "magpie_queue_paused", "1 while claiming is paused", value=1 if st["paused"] else 0
    )


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


__all__ = ["MagpieCollector", "build_registry", "serve"]
