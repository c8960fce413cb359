"""The Prometheus exporter: a collector that reads magpie's state at scrape time.

The write side is elsewhere: check workers only add to Redis counters
(:mod:`magpie.base.counters`). The exporter (:class:`MagpieCollector`) composes the read functions each owner
exposes, and adds nothing of its own to what they return:

* counters: :func:`magpie.base.counters.read_counters`;
* the route schedule: :meth:`magpie.queue.RouteQueue.status`;
* the results stream: :func:`magpie.stats.status.pending_summary` and
  :func:`magpie.stats.upkeep.replay_floor`;
* leader locks: :func:`magpie.coordination.leader.locks_held` over the maintenance jobs' locks (the
  jobs the exporter is given: :data:`magpie.wiring.jobs.JOBS`) and
  :data:`magpie.coordination.leader.STANDING_LOCKS`;
* maintenance passes: :func:`magpie.maintenance.runner.read_job_status`, one series per given job
  (zero for a job that never ran, so staleness alerts see it) and its cadence;
* what the product measures: alive routes by protocol, anonymity and workspace (one bounded
  ``GROUP BY`` on ``route_health``) and the latency of stored checks (a histogram that ingestion fills,
  :func:`magpie.base.counters.record_check_latency`);
* deliveries: webhook deliveries and outbox emails per status. This and the alive routes are whole-table
  aggregates, reused for ``MAGPIE_METRICS_ROUTE_CACHE`` seconds.

Known label sets (check outcomes, overflow policies, registered jobs) are exported at zero before
anything is counted. The maintenance job's label is ``maintenance_job``, not ``job``, which Prometheus
reserves for the scrape target.

``magpie metrics --port N`` serves it as a standalone process; a Celery worker started with
``MAGPIE_METRICS_PORT`` serves the same collector from its main process (see the worker hook in
:mod:`magpie.wiring.worker`). Every exporter shows the same, deployment-wide figures (the counters too: they
live in Redis); with several scraped, aggregate with ``max by`` the metric's own labels before summing, as
``deploy/prometheus/rules.yml`` does. No family carries an ``instance`` or ``job`` label: Prometheus sets
both on the scrape target. The same server answers ``/livez`` and ``/readyz`` (:mod:`magpie.observability.probes`).
"""

from __future__ import annotations

import logging
import threading
import time
import typing
from collections.abc import Iterable

import redis as redis_lib
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from magpie.base import redisconn
from magpie.base.counters import CHECK_OUTCOMES, read_counters
from magpie.coordination.leader import STANDING_LOCKS, locks_held
from magpie.maintenance.base import Job
from magpie.maintenance.beat import cadences
from magpie.maintenance.interval import interval_families
from magpie.maintenance.runner import read_job_status
from magpie.stats.status import pending_summary
from magpie.stats.upkeep import replay_floor

log = logging.getLogger(__name__)


def _scrape_redis(settings) -> redis_lib.Redis:
    """A client that fails fast (2-second socket timeouts, no retries): a scrape must not hang."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redisconn.connect(
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
        jobs: the maintenance jobs whose passes and leader locks it reports (:data:`magpie.wiring.jobs.JOBS`).
        redis: client to use (default: one from ``MAGPIE_REDIS_URL`` with 2-second socket timeouts and no
            retries, so a scrape fails fast).
        engine: engine to use (default: one on ``MAGPIE_DATABASE_URL`` with a 2-second connect timeout
            and a 5-second statement timeout).

    A source that cannot be read leaves its metrics out of that scrape and reports
    ``magpie_exporter_source_up{source="redis"|"postgres"} 0``; a scrape never fails as a whole.
    """

    def __init__(self, settings, *, jobs: Iterable[Job] = (), redis: redis_lib.Redis | None = None,
                 engine=None):
        self.settings = settings
        self.jobs = tuple(jobs)
        self._redis = redis
        self._engine = engine
        self._lock = threading.Lock()
        self._routes_cache: tuple[float, list] | None = None  # (monotonic time, families)

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
        yield self._leaders(r, prefix, self.jobs)
        yield from _counter_families(read_counters(r, prefix))
        from magpie.queue.partitions import settings_stream_pairs

        yield from _stream_families(r, prefix, settings_stream_pairs(self.settings))
        s = self.settings
        if (s.schedule_url or "").startswith("postgresql"):
            from magpie.queue.provider import create_provider

            queue = create_provider(s.schedule_url, s, redis_client=r)
        else:
            # Built directly, not by RouteQueue.from_settings: a scrape only reads (no layout check, no write).
            from magpie.queue.partitioned import reader

            queue = reader(r, s)
        yield from _queue_families(queue.status())
        yield from interval_families(queue)
        from magpie.judges.metrics import cache_families

        yield from cache_families(r, prefix)
        from magpie.apitokens.ratelimit import families as api_families

        yield from api_families(r, prefix)

    @staticmethod
    def _leaders(r: redis_lib.Redis, prefix: str, jobs: tuple[Job, ...]) -> GaugeMetricFamily:
        leader = GaugeMetricFamily(
            "magpie_leader_job_active", "1 while some process holds the leader lock", labels=["lock"]
        )
        locks = {job.name: job.lock for job in jobs} | {name: name for name in STANDING_LOCKS}
        for name, held in zip(locks, locks_held(r, prefix, list(locks.values()))):
            leader.add_metric([name], 1.0 if held else 0.0)
        return leader

    # -- PostgreSQL ------------------------------------------------------------------------------------
    def _pg_metrics(self):
        from magpie.judges.metrics import judge_families

        yield from _maintenance_families(self.settings, self.jobs, read_job_status(self.engine))
        with self.engine.connect() as conn:
            yield from judge_families(conn)
        yield from self._route_families()
        created = _deployment_created(self.engine)
        if created is not None:
            yield GaugeMetricFamily(
                "magpie_deployment_created_timestamp_seconds",
                "When the deployment's key fingerprint was first recorded (its first start)",
                value=created,
            )

    def _route_families(self) -> list:
        """Alive-route and delivery families (whole-table aggregates), from the cache while it is younger
        than ``MAGPIE_METRICS_ROUTE_CACHE`` seconds."""
        ttl = self.settings.metrics_route_cache
        cached = self._routes_cache
        if cached is not None and time.monotonic() - cached[0] < ttl:
            return cached[1]
        fams = _route_families(self.engine, self.settings.metrics_route_series)
        fams.append(_delivery_family(self.engine))
        self._routes_cache = (time.monotonic(), fams)
        return fams


_ALIVE_ROUTES = """
    SELECT r.protocol, COALESCE(h.anonymity, 'unknown'), w.name, count(*)
    FROM route_health h
    JOIN routes r ON r.id = h.route_id
    JOIN route_workspaces rw ON rw.route_id = h.route_id
    JOIN workspaces w ON w.id = rw.workspace_id
    WHERE h.alive
    GROUP BY 1, 2, 3
    ORDER BY 4 DESC, 3, 1, 2
    LIMIT %(n)s
"""


def _route_families(engine, most: int) -> list:
    """``magpie_routes_alive{protocol, anonymity, workspace}`` (at most ``most`` label sets, largest
    first) and ``magpie_routes_alive_series_dropped`` (1 when more label sets existed)."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(_ALIVE_ROUTES, {"n": most + 1}).all()
    alive = GaugeMetricFamily(
        "magpie_routes_alive",
        "Routes whose latest stored check was alive (a route in two workspaces counts in both)",
        labels=["protocol", "anonymity", "workspace"],
    )
    for protocol, anonymity, workspace, n in rows[:most]:
        alive.add_metric([protocol, anonymity, workspace], n)
    dropped = GaugeMetricFamily(
        "magpie_routes_alive_series_dropped",
        "1 when magpie_routes_alive left label sets out (MAGPIE_METRICS_ROUTE_SERIES)",
        value=1 if len(rows) > most else 0,
    )
    return [alive, dropped]


def _delivery_family(engine) -> GaugeMetricFamily:
    """``magpie_deliveries{channel="webhook"|"email", status}``: rows of the delivery tables per status."""
    from magpie.alerts.delivery import DELIVERIES
    from magpie.outbox.service import OUTBOX

    fam = GaugeMetricFamily(
        "magpie_deliveries", "Webhook deliveries and outbox emails by status", labels=["channel", "status"]
    )
    for channel, table in (("webhook", DELIVERIES), ("email", OUTBOX)):
        for status, n in table.counts(engine).items():
            fam.add_metric([channel, status], n)
    return fam


def _deployment_created(engine) -> float | None:
    """Unix time the key fingerprint was first recorded, or None when none is recorded yet."""
    import sqlalchemy as sa

    with engine.connect() as conn:
        at = conn.execute(sa.text("SELECT min(created_at) FROM deployment_keys")).scalar()
    return None if at is None else at.timestamp()


def _maintenance_families(settings, jobs: tuple[Job, ...], rows: list[dict]) -> list:
    """Maintenance families: every job of ``jobs`` (zeros for one that never ran) and any recorded one."""
    label = ["maintenance_job"]
    last_ok = GaugeMetricFamily(
        "magpie_maintenance_last_success_timestamp_seconds",
        "End of the job's last successful pass (0: never succeeded)",
        labels=label,
    )
    last_start = GaugeMetricFamily(
        "magpie_maintenance_last_start_timestamp_seconds",
        "Start of the job's last pass (0: never ran)",
        labels=label,
    )
    failures = CounterMetricFamily("magpie_maintenance_failures", "Failed passes", labels=label)
    runs = CounterMetricFamily("magpie_maintenance_runs", "Passes started", labels=label)
    cadence = GaugeMetricFamily(
        "magpie_maintenance_cadence_seconds", "The job's effective beat cadence (0: not scheduled)",
        labels=label,
    )
    every = cadences(settings, jobs)
    by_job = {job.name: {} for job in jobs} | {row["job"]: row for row in rows}
    for job, row in by_job.items():
        ok, started = row.get("last_success_at"), row.get("last_started_at")
        last_ok.add_metric([job], ok.timestamp() if ok is not None else 0.0)
        last_start.add_metric([job], started.timestamp() if started is not None else 0.0)
        failures.add_metric([job], row.get("failures_total", 0))
        runs.add_metric([job], row.get("runs_total", 0))
        if job in every:
            cadence.add_metric([job], every[job])
    return [last_ok, last_start, failures, runs, cadence]


def _overflow_policies() -> tuple[str, ...]:
    """The stream bound's overflow policies (``MAGPIE_STATS_OVERFLOW``'s values)."""
    from magpie.config import Settings

    return typing.get_args(Settings.model_fields["stats_overflow"].annotation)


def _histogram_family(name: str, doc: str, h: dict) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc)
    fam.add_metric(
        [],
        buckets=[("+Inf" if b == float("inf") else repr(b), n) for b, n in h["buckets"]],
        sum_value=h["sum_s"],
    )
    return fam


def _counter_families(c: dict):
    """Families of the producer-side counters (:func:`magpie.base.counters.read_counters`)."""
    checks = CounterMetricFamily("magpie_checks", "Checks by outcome", labels=["outcome"])
    for outcome, n in sorted(({o: 0 for o in CHECK_OUTCOMES} | c["checks"]).items()):
        checks.add_metric([outcome], n)
    yield checks
    yield CounterMetricFamily(
        "magpie_stale_completions_rejected",
        "Check completions rejected because the lease had moved on",
        value=c["stale"],
    )
    yield _histogram_family(
        "magpie_check_lateness_seconds", "Check start time minus its due time", c["lateness"]
    )
    yield _histogram_family(
        "magpie_check_latency_seconds", "Latency of alive checks, observed as ingestion stores them",
        c["latency"],
    )
    yield _histogram_family(
        "magpie_lease_claim_to_start_seconds", "Time from a route's claim to its check's start", c["claim_to_start"]
    )
    stages = HistogramMetricFamily(
        "magpie_lease_start_stage_seconds",
        "Claim-to-start by stage: dispatch (claim to message sent), transit (sent to received), "
        "admit (received to the pool's loop), wait (admitted to a free slot)",
        labels=["stage"],
    )
    for stage, h in c["start_stages"].items():
        stages.add_metric(
            [stage], buckets=[("+Inf" if b == float("inf") else repr(b), n) for b, n in h["buckets"]],
            sum_value=h["sum_s"],
        )
    yield stages
    dropped = CounterMetricFamily(
        "magpie_statistics_dropped", "Check results lost to the results stream bound", labels=["policy"]
    )
    for policy, n in sorted(({p: 0 for p in _overflow_policies()} | c["dropped"]).items()):
        dropped.add_metric([policy], n)
    yield dropped
    from magpie.coordination.ratelimit import EVENTS

    limited = CounterMetricFamily(
        "magpie_rate_limited",
        "Rate-limit events: judge waited / handed_back, workspace deferred, rotator refused, unavailable (Redis "
        "could not be asked; not limited)", labels=["limiter", "event"])
    known = {(k, e): 0 for k, events in EVENTS.items() for e in events}
    for (kind, event), n in sorted((known | c.get("limited", {})).items()):
        limited.add_metric([kind, event], n)
    yield limited


def _stream_families(r: redis_lib.Redis, prefix: str, pairs: list[tuple[str, str]] | None = None):
    """Families of the results stream (backlog, pending, consumers, dead letters, replay floor), summed over
    every partition's stream of ``pairs`` when given."""
    summary = pending_summary(r, prefix, pairs)
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
    floor = replay_floor(r, prefix, pairs)
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


def build_registry(settings, *, jobs: Iterable[Job] = (), redis: redis_lib.Redis | None = None,
                   engine=None) -> CollectorRegistry:
    """A fresh registry holding one :class:`MagpieCollector` (no process or platform collectors) that
    reports the maintenance jobs ``jobs`` (:data:`magpie.wiring.jobs.JOBS`; none when left out)."""
    from magpie.enrich.caches import CacheCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(MagpieCollector(settings, jobs=jobs, redis=redis, engine=engine))
    registry.register(CacheCollector())
    return registry


def serve(settings, host: str = "127.0.0.1", port: int = 9464, *, jobs: Iterable[Job] = (),
          registry: CollectorRegistry | None = None, readiness=None):
    """Serve ``/metrics`` (Prometheus text format), ``/livez`` and ``/readyz`` from a background thread.

    Args:
        host: bind address; port: TCP port (``0`` picks a free one: read it from ``server.server_port``).
        jobs: the maintenance jobs the default registry reports (:data:`magpie.wiring.jobs.JOBS`).
        registry: default :func:`build_registry` ``(settings, jobs=jobs)``.
        readiness: callable returning the ``/readyz`` answer (default
            :class:`magpie.observability.probes.Readiness` ``(settings)``: Redis, PostgreSQL and broker).
    Returns:
        ``(server, thread)``; stop with ``server.shutdown(); server.server_close()``.
    Raises:
        OSError: the address is in use or cannot be bound.
    """
    from magpie.observability.probes import Readiness, make_app, start_server

    registry = registry or build_registry(settings, jobs=jobs)
    return start_server(make_app(registry, readiness or Readiness(settings)), host, port)


__all__ = ["MagpieCollector", "build_registry", "serve"]
