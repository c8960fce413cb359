"""Settings read from the environment (and an optional ``.env``) with pydantic-settings.

Names keep those of the system magpie replaces where it gives one (``PROXY_QUEUE_SHARDS``,
``PROXY_QUEUE_ENCRYPT_CREDENTIALS``, ``PROXY_ENCRYPTION_KEY``), ``MAGPIE_*`` for the rest. Defaults work
against this machine kind's local services (PostgreSQL, Redis and RabbitMQ on 127.0.0.1).

A bad value raises :class:`ConfigError` at start with the variable's name in the message. Durations have
upper bounds (:data:`DAY`, :data:`MONTH`...) so that a typo such as ``1e300`` is refused, not "forever".

One module on purpose: pydantic-settings reads one flat model, and every setting is documented where it
is declared; the typed slices (:class:`ScheduleSettings`, :class:`CheckSettings`, :class:`StreamSettings`)
are what the code that needs a concern's settings takes.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from magpie.base import redact
from magpie.errors import ConfigError, MagpieError  # noqa: F401 (ConfigError: magpie.config.ConfigError)


BROKER_SCHEMES = ("redis", "rediss", "redis+socket", "sentinel", "amqp", "amqps", "pyamqp", "memory")
"""Broker URL schemes magpie runs on (Celery/kombu transports: Redis and RabbitMQ; memory for tests)."""
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
"""The RabbitMQ schemes among :data:`BROKER_SCHEMES` (quorum queues, see :mod:`magpie.base.broker`)."""

HOUR = 3600.0
DAY = 86400.0
MONTH = 30 * DAY  # upper bounds of durations (seconds): a typo such as 1e300 never means "forever"



def redis_db_problem(url: str) -> str | None:
    """Why a Redis URL's database number is unusable, or None (also None for a non-Redis URL).

    redis-py reads ``redis://host/abc`` as database 0 without a word; magpie refuses it instead, so a
    typo cannot make a deployment share another one's database. Accepted: no path, ``/`` or ``/<n>``,
    and ``?db=<n>`` (n a whole number 0..10000). The returned text never quotes the URL (it may hold a
    password).
    """
    from urllib.parse import parse_qs, urlsplit

    scheme = url.partition("://")[0].lower()
    if scheme not in ("redis", "rediss", "unix"):
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return "is not a valid URL"
    candidates = []
    path = parts.path if scheme != "unix" else ""
    if path not in ("", "/"):
        candidates.append(path.lstrip("/"))
    candidates += parse_qs(parts.query).get("db", [])
    for text in candidates:
        if not (text.isascii() and text.isdigit() and int(text) <= 10000):
            return "the database number must be a whole number (redis://host:6379/0)"
    return None

@dataclass(frozen=True, slots=True)
class ScheduleSettings:
    """What the route schedule needs (see :attr:`Settings.schedule`): Redis URL and key prefix, shard
    count, interval and lease in ms, stall limit, and promote's limits (routes)."""

    redis_url: str
    prefix: str
    shards: int
    interval_ms: int
    lease_ms: int
    max_stalled: int
    max_inflight: int
    promote_budget: int
    pop_batch: int
    routes_per_task: int
    dead_after: int = 0
    dead_factor: int = 1
    priority_share: float = 0.0
    partitions: int = 1
    wait_replicas: int = 0
    wait_timeout_ms: int = 100


@dataclass(frozen=True, slots=True)
class CheckSettings:
    """What the check engine and a check pool need (see :attr:`Settings.checks`). Seconds unless ``_ms``."""

    judge_url: str
    timeout: float
    connect_timeout: float
    attempts: int
    body_cap: int
    allow_private: str
    checks_per_process: int | None
    renew_below_ms: float
    retry_base_ms: int
    retry_cap_ms: int
    complete_interval: float
    heartbeat: float
    judge_ca_bundle: str | None = None


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """What the results stream's producer and consumers need (see :attr:`Settings.stream`)."""

    prefix: str
    maxlen: int
    overflow: str
    block_timeout: float
    batch: int
    max_deliveries: int


class Settings(BaseSettings):
    """All runtime settings. Units are in the field names or descriptions (seconds unless ``_ms``)."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", populate_by_name=True, allow_inf_nan=False)

    database_url: str = Field(
        "postgresql+psycopg2://postgres@127.0.0.1:5432/magpie", alias="MAGPIE_DATABASE_URL"
    )
    """SQLAlchemy URL of the PostgreSQL database (results, routes, jobs); ``postgresql://`` only."""
    redis_url: str = Field("redis://127.0.0.1:6379/0", alias="MAGPIE_REDIS_URL")
    """Redis holding the route schedule, leader locks, counters and the results stream (``redis://``,
    ``rediss://`` or ``unix://``; a Redis Cluster as ``redis+cluster://host:port[,host:port...]/`` or
    ``rediss+cluster://``, which then needs ``MAGPIE_BROKER_URL`` set); run it with
    ``maxmemory-policy noeviction``."""
    redis_wait_replicas: int = Field(0, alias="MAGPIE_REDIS_WAIT_REPLICAS", ge=0, le=16)
    """After each claim and completion of the Redis schedule, ``WAIT`` for this many replicas to confirm
    the write (0: off). Narrows what a failover can lose (docs/operations.md, "Redis Cluster"); costs one
    replica round trip per claim and completion call. A confirmation that falls short is counted, not
    refused. One partition only for now: a partitioned schedule pipelines its claims and completions over
    the partitions and does not wait."""
    redis_wait_timeout_ms: int = Field(100, alias="MAGPIE_REDIS_WAIT_TIMEOUT_MS", ge=1, le=60_000)
    """Most ms one ``WAIT`` (``MAGPIE_REDIS_WAIT_REPLICAS``) blocks the claim or completion that asked."""
    broker_url: str = Field("redis://127.0.0.1:6379/1", alias="MAGPIE_BROKER_URL")
    """Celery broker: ``redis://``, ``rediss://``, ``redis+socket://``, ``sentinel://``, ``amqp://``,
    ``amqps://`` or ``pyamqp://`` (``memory://`` for tests); several failover URLs separated by ``;``.
    On RabbitMQ magpie's queues are durable quorum queues and each deployment uses a vhost of its own
    (the URL's path); docs/operations.md, "Choosing a broker"."""
    result_backend: str | None = Field(None, alias="MAGPIE_RESULT_BACKEND")
    """Celery result backend; unset: none (magpie's tasks report through Redis and PostgreSQL)."""
    broker_key_prefix: str = Field("", alias="MAGPIE_BROKER_KEY_PREFIX")
    """Key prefix for a Redis broker's own keys (kombu ``global_keyprefix``), to share one Redis database.
    Refused with a RabbitMQ broker: deployments sharing a RabbitMQ server each use a vhost of their own
    (``amqp://user:password@host:5672/<vhost>``)."""
    redis_prefix: str = Field("magpie:", alias="MAGPIE_REDIS_PREFIX")
    """Prefix of every Redis key of this deployment (several deployments can share a server)."""

    check_interval: float = Field(300.0, alias="MAGPIE_CHECK_INTERVAL", ge=0.1, le=MONTH)
    """Seconds between two checks of one route (at most 30 days)."""
    lease_seconds: float = Field(300.0, alias="MAGPIE_LEASE_SECONDS", ge=1, le=DAY)
    """Lease length in seconds given by a claim or a renewal (5 minutes by default, at most one day: a
    lease must expire for a lost check's route to come back)."""
    renew_below_seconds: float = Field(120.0, alias="MAGPIE_RENEW_BELOW_SECONDS", ge=0, le=DAY)
    """A check renews its lease between attempts when fewer than this many seconds remain."""
    max_inflight: int = Field(1_000_000, alias="MAGPIE_MAX_INFLIGHT", ge=1)
    """Upper bound on outstanding leases that promote will hand out, over every check worker. Promote also
    never hands out more than the registered check engines have slots (``MAGPIE_CHECKS_PER_PROCESS`` per
    process), so the default does not cap a node; lower it to protect a small Redis or judge."""
    promote_interval: float = Field(1.0, alias="MAGPIE_PROMOTE_INTERVAL", gt=0, le=300)
    """Seconds between two beat-triggered promote passes (at most 5 minutes)."""
    promote_budget: int = Field(20_000, alias="MAGPIE_PROMOTE_BUDGET", ge=1)
    """Most routes one promote pass claims (catch-up after downtime never bursts past it)."""
    routes_per_task: int = Field(250, alias="MAGPIE_ROUTES_PER_TASK", ge=1, le=5000)
    """Leases carried by one check-task message."""
    checks_per_process: int | None = Field(None, alias="MAGPIE_CHECKS_PER_PROCESS", ge=1, le=1_000_000)
    """Checks one check-worker process runs at once on its event loop. Unset: the process's hard open-file
    limit less 5 % (at least 256), at most 20,000 (one check holds one socket). A set value is capped below the
    file-descriptor limit (raised toward the hard limit at start), with a warning saying so. Distinct from
    ``MAGPIE_CHECK_CONCURRENCY``, the number of check processes."""
    check_concurrency: int | None = Field(None, alias="MAGPIE_CHECK_CONCURRENCY", ge=1, le=256)
    """Celery processes of a worker that consumes the ``checks`` queue when ``--concurrency`` is not given
    (the default Procfile gives none). Unset: one per CPU core plus one, so that a process paused by its
    garbage collector or the interpreter lock never leaves a core idle, and more (up to four per core) when
    a low open-file limit keeps the worker under 25,000 checks in flight per core; the worker logs how it
    was sized."""
    check_gc_interval: float = Field(30.0, alias="MAGPIE_CHECK_GC_INTERVAL", ge=0, le=3600)
    """Seconds before the first full run of the cyclic garbage collector in a check process, whose automatic
    collections are off; later runs come as often as they find garbage (the interval doubles after a
    quiet run, up to 16 times this, and halves after a busy one). CPython starts a collection on the net
    growth of tracked objects, and each one walks every check in flight, so at 10,000 checks per process
    the automatic collector cost about a third of the process's CPU while finding almost no cycles. 0:
    CPython's automatic collection (young generation of 50,000)."""
    checker_heartbeat: float = Field(2.0, alias="MAGPIE_CHECKER_HEARTBEAT", gt=0, le=60)
    """Seconds between two capacity heartbeats of a check engine; promote counts an engine's slots for
    three heartbeats after its last one."""
    complete_interval: float = Field(0.1, alias="MAGPIE_COMPLETE_INTERVAL", gt=0, le=10)
    """Seconds between two completion flushes of a check engine (finished leases complete and publish in
    small batches, never waiting for their message's other routes)."""
    pop_batch: int = Field(64, alias="MAGPIE_POP_BATCH", ge=1, le=1000)
    """Routes claimed by one pop script call."""

    max_stalled: int = Field(3, alias="MAGPIE_MAX_STALLED", ge=0)
    """A route re-claimed after lease expiry more than this many times in a row is dead-lettered."""
    retry_base: float = Field(5.0, alias="MAGPIE_RETRY_BASE", gt=0, le=HOUR)
    """Seconds of the first backoff delay after an infrastructure failure (judge unreachable; at most 1 h)."""
    retry_cap: float = Field(300.0, alias="MAGPIE_RETRY_CAP", gt=0, le=DAY)
    """Upper bound in seconds on a backoff delay (at most one day)."""

    queue_shards: int = Field(16, alias="PROXY_QUEUE_SHARDS", ge=1, le=128)
    """Shards (sorted sets) of the schedule; fixed once the schedule exists (a different value is refused as
    ``layout_mismatch``; obliterate or rebuild to change it)."""
    schedule_partitions: int = Field(1, alias="MAGPIE_SCHEDULE_PARTITIONS", ge=1, le=1024)
    """Partitions of the Redis schedule (1..1024), each under its own hash tag (``{p0}``..; 1 keeps the one
    tag ``{default}``) so a schedule can spread over Redis Cluster masters. Fixed once the schedule exists
    (a different value is refused as ``layout_mismatch``); ``magpie queue repartition --to N`` changes it."""
    encrypt_queue_credentials: bool = Field(False, alias="PROXY_QUEUE_ENCRYPT_CREDENTIALS")
    """Seal route credentials in new and changed Redis queue payloads (AES-SIV, key derived from
    ``PROXY_ENCRYPTION_KEY``); readers take sealed and plaintext payloads either way. Payloads already
    stored are converted by ``magpie queue migrate-payloads --encrypt`` (``--decrypt`` goes back)."""
    encryption_key: str = Field(
        "magpie-development-key-change-me", alias="PROXY_ENCRYPTION_KEY", min_length=16
    )
    """Root secret: credential encryption at rest and the keyed route hash derive from it. Keep it stable:
    the database records its fingerprint on first use and every process refuses to start with another key."""
    key_check_wait: float = Field(60.0, alias="MAGPIE_KEY_CHECK_WAIT", ge=0, le=3600)
    """Seconds a starting worker or beat waits for PostgreSQL (reachable and migrated) to check
    ``PROXY_ENCRYPTION_KEY`` against before it gives up (exit status 2)."""

    judge_url: str = Field("http://127.0.0.1:8899/", alias="MAGPIE_JUDGE_URL")
    """The judge every check requests through the proxy (``magpie judge`` serves one)."""
    judge_ca_bundle: str | None = Field(None, alias="MAGPIE_JUDGE_CA_BUNDLE")
    """PEM file of the CA certificates trusted for an https judge, instead of the system trust store (a
    self-hosted judge with a private CA). Certificates and host names are always verified."""
    check_allow_private: str = Field("false", alias="MAGPIE_CHECK_ALLOW_PRIVATE")
    """Non-public destinations checks may reach: ``false`` (none: only public unicast proxies and judges),
    ``true`` (every private range), or CIDRs such as ``127.0.0.0/8,::1`` (the lab and demo run on loopback).
    Checked at import for IP literals and again before every connection (names after resolution)."""
    egress_only: str = Field("", alias="MAGPIE_EGRESS_ONLY")
    """Deny-by-default egress: when set (CIDRs such as ``127.0.0.0/8,::1``), nothing outside these networks
    is ever dialled: proxies, judges, webhooks, blacklist and enrichment fetches, rotator upstreams, and
    every other Python socket of the process (Redis, broker, SMTP). Checked on every resolved address before
    the dial, on top of the ``*_ALLOW_PRIVATE`` rules; inherited by subprocesses. The test suite,
    the demo, the lab and the benchmarks run with loopback. Empty: no allow-list."""
    check_timeout: float = Field(10.0, alias="MAGPIE_CHECK_TIMEOUT", gt=0, le=600)
    """Hard deadline in seconds over one whole attempt (connect, proxy handshake, request, answer; at most
    10 minutes)."""
    connect_timeout_s: float | None = Field(None, alias="MAGPIE_CONNECT_TIMEOUT", gt=0, le=600)
    """Seconds for name resolution and the TCP connect to the proxy in one attempt (default: half of
    ``MAGPIE_CHECK_TIMEOUT``; never more than it); the proxy handshake counts against the check timeout."""
    check_attempts: int = Field(2, alias="MAGPIE_CHECK_ATTEMPTS", ge=1, le=10)
    """Attempts per check before the route counts as dead in that cycle."""
    body_cap: int = Field(2048, alias="MAGPIE_BODY_CAP", ge=0)
    """Bytes of the judge's response body kept per check."""

    stats_stream_maxlen: int = Field(1_000_000, alias="MAGPIE_STATS_STREAM_MAXLEN", ge=1000)
    """Bound of the results stream (entries); see ``MAGPIE_STATS_OVERFLOW``."""
    stats_batch: int = Field(2000, alias="MAGPIE_STATS_BATCH", ge=1)
    """Results one ingestion pass reads from the stream and stores in one transaction (the round trips
    and statements of a batch are shared by its results: at thousands of results per second, 2,000 cost
    less per result than 500)."""
    stats_interval: float = Field(1.0, alias="MAGPIE_STATS_INTERVAL", gt=0)
    """Seconds between beat-triggered statistics ingestion passes."""

    # -- alerts, webhook delivery and the email outbox ------------------------------------------------
    alert_eval_interval: float = Field(60.0, alias="MAGPIE_ALERT_EVAL_INTERVAL", gt=0)
    """Seconds between beat-triggered alert evaluations (one per minute; streaks count minutes)."""
    alert_window_seconds: int = Field(900, alias="MAGPIE_ALERT_WINDOW_SECONDS", ge=60)
    """Check-history window in seconds read by success-rate and latency rules (15 minutes)."""
    alert_freshness_seconds: int = Field(600, alias="MAGPIE_ALERT_FRESHNESS_SECONDS", ge=1)
    """A route counts as usable only if alive and checked within this many seconds (rule may override)."""
    alert_open_minutes: int = Field(2, alias="MAGPIE_ALERT_OPEN_MINUTES", ge=1)
    """Consecutive breached evaluation minutes that open an incident."""
    alert_recover_minutes: int = Field(2, alias="MAGPIE_ALERT_RECOVER_MINUTES", ge=1)
    """Consecutive healthy evaluation minutes that recover an open incident."""
    alert_query_timeout_ms: int = Field(10_000, alias="MAGPIE_ALERT_QUERY_TIMEOUT_MS", ge=100)
    """PostgreSQL statement timeout of one measurement query; a timeout makes the rules Unknown."""

    delivery_workers: int = Field(10, alias="MAGPIE_DELIVERY_WORKERS", ge=1, le=200)
    """Parallel webhook senders per delivery task / ``magpie alerts deliver`` process."""
    delivery_interval: float = Field(5.0, alias="MAGPIE_DELIVERY_INTERVAL", gt=0)
    """Seconds between beat-triggered webhook delivery drains."""
    delivery_drain_seconds: float = Field(4.0, alias="MAGPIE_DELIVERY_DRAIN_SECONDS", gt=0)
    """A drain stops claiming new webhook deliveries after this many seconds (keep it below the interval so
    beat-triggered drains rarely overlap)."""
    delivery_claim_seconds: float = Field(60.0, alias="MAGPIE_DELIVERY_CLAIM_SECONDS", gt=0, le=DAY)
    """Lifetime in seconds of a delivery claim; an expired claim is re-claimed by another worker."""
    webhook_timeout: float = Field(10.0, alias="MAGPIE_WEBHOOK_TIMEOUT", gt=0, le=600)
    """Connect and read timeout in seconds of one webhook POST."""
    webhook_max_attempts: int = Field(4, alias="MAGPIE_WEBHOOK_MAX_ATTEMPTS", ge=1, le=100)
    """Attempts per webhook delivery before it is marked failed."""
    webhook_backoff_base: float = Field(10.0, alias="MAGPIE_WEBHOOK_BACKOFF_BASE", gt=0, le=DAY)
    """Seconds before the first webhook retry (exponential, factor 2, equal jitter: never immediate)."""
    webhook_backoff_cap: float = Field(600.0, alias="MAGPIE_WEBHOOK_BACKOFF_CAP", gt=0, le=DAY)
    """Upper bound in seconds on a webhook retry delay."""
    webhook_allow_private: str = Field("false", alias="MAGPIE_WEBHOOK_ALLOW_PRIVATE")
    """Non-public addresses webhook targets may resolve to, as ``MAGPIE_CHECK_ALLOW_PRIVATE`` takes them:
    ``false`` (none, the default), ``true`` (every private range) or CIDRs such as ``10.0.0.0/8,::1``."""

    smtp_host: str = Field("127.0.0.1", alias="MAGPIE_SMTP_HOST")
    """SMTP server for the email outbox."""
    smtp_port: int = Field(25, alias="MAGPIE_SMTP_PORT", ge=1, le=65535)
    """SMTP server port."""
    smtp_user: str | None = Field(None, alias="MAGPIE_SMTP_USER")
    """SMTP login; sent only over TLS or to a loopback server."""
    smtp_password: str | None = Field(None, alias="MAGPIE_SMTP_PASSWORD")
    """SMTP password (with ``MAGPIE_SMTP_USER``)."""
    smtp_tls: str = Field("none", alias="MAGPIE_SMTP_TLS", pattern=r"^(none|starttls|tls)$")
    """``none`` (plain), ``starttls`` (upgrade after EHLO) or ``tls`` (implicit TLS, usually port 465)."""
    smtp_from: str = Field("magpie@localhost", alias="MAGPIE_SMTP_FROM")
    """Sender address of outgoing email."""
    smtp_timeout: float = Field(30.0, alias="MAGPIE_SMTP_TIMEOUT", gt=0, le=600)
    """Seconds; socket timeout of one SMTP session."""
    smtp_ca_file: str | None = Field(None, alias="MAGPIE_SMTP_CA_FILE")
    """PEM bundle trusted for the SMTP server's certificate (default: the system store)."""
    email_workers: int = Field(4, alias="MAGPIE_EMAIL_WORKERS", ge=1, le=200)
    """Parallel SMTP senders per email task / ``magpie outbox work`` process."""
    email_interval: float = Field(5.0, alias="MAGPIE_EMAIL_INTERVAL", gt=0)
    """Seconds between beat-triggered outbox drains."""
    email_drain_seconds: float = Field(4.0, alias="MAGPIE_EMAIL_DRAIN_SECONDS", gt=0)
    """An outbox drain stops claiming new rows after this many seconds (keep it below the interval)."""
    email_claim_seconds: float = Field(120.0, alias="MAGPIE_EMAIL_CLAIM_SECONDS", gt=0, le=DAY)
    """Lifetime in seconds of an outbox claim; housekeeping returns expired claims to pending."""
    email_max_attempts: int = Field(8, alias="MAGPIE_EMAIL_MAX_ATTEMPTS", ge=1, le=100)
    """Attempts per outbox email before it is marked failed."""
    email_backoff_base: float = Field(30.0, alias="MAGPIE_EMAIL_BACKOFF_BASE", gt=0, le=DAY)
    """Seconds before the first email retry (exponential, factor 2, equal jitter: never immediate)."""
    email_backoff_cap: float = Field(3600.0, alias="MAGPIE_EMAIL_BACKOFF_CAP", gt=0, le=DAY)
    """Upper bound in seconds on an email retry delay."""
    outbox_retention_seconds: int = Field(7 * 86400, alias="MAGPIE_OUTBOX_RETENTION_SECONDS", ge=0)
    """Sent outbox rows older than this (by ``sent_at``) are deleted by housekeeping."""
    outbox_housekeeping_interval: float = Field(60.0, alias="MAGPIE_OUTBOX_HOUSEKEEPING_INTERVAL", gt=0)
    """Seconds between beat-triggered outbox housekeeping passes."""
    invitation_ttl_seconds: int = Field(7 * 86400, alias="MAGPIE_INVITATION_TTL_SECONDS", ge=60)
    """Validity of a workspace invitation in seconds."""

    # -- maintenance, statistics upkeep and metrics --------------------------------------------------
    stats_max_deliveries: int = Field(5, alias="MAGPIE_STATS_MAX_DELIVERIES", ge=1, le=1000)
    """A stream entry delivered this many times without being acknowledged goes to the dead-letter stream
    on its next delivery instead of being applied again. Deliveries that met an infrastructure failure of
    the database (unreachable, read-only, disk full, timeouts, serialization failures) do not count."""
    stats_infra_backoff: float = Field(1.0, alias="MAGPIE_STATS_INFRA_BACKOFF", ge=0, le=300)
    """Seconds ingestion waits after the database failed a batch for infrastructure reasons before one
    trial batch; doubles after each further failure up to ``MAGPIE_STATS_INFRA_BACKOFF_CAP``. Nothing is
    read (so no delivery is spent) while it runs; a commit ends it."""
    stats_infra_backoff_cap: float = Field(30.0, alias="MAGPIE_STATS_INFRA_BACKOFF_CAP", ge=0, le=3600)
    """Most seconds between two trial batches while the database keeps refusing writes."""
    stats_overflow: Literal["block", "drop_new", "evict_oldest"] = Field(
        "evict_oldest", alias="MAGPIE_STATS_OVERFLOW"
    )
    """What a check does when the results stream holds ``MAGPIE_STATS_STREAM_MAXLEN`` unconsumed entries:
    ``evict_oldest`` (drop the oldest unconsumed entries), ``drop_new`` (drop the new results) or ``block``
    (wait up to ``MAGPIE_STATS_BLOCK_TIMEOUT`` for room, then drop the new results). Every drop is counted."""
    stats_block_timeout: float = Field(2.0, alias="MAGPIE_STATS_BLOCK_TIMEOUT", ge=0, le=300)
    """Seconds a ``block`` producer waits for room in the results stream before dropping."""
    stats_consumer_idle: float = Field(3600.0, alias="MAGPIE_STATS_CONSUMER_IDLE", gt=0)
    """Seconds idle after which a stream consumer with no pending entries is deleted from the group."""
    stats_ledger_min_age: float = Field(3600.0, alias="MAGPIE_STATS_LEDGER_MIN_AGE", ge=0)
    """Seconds a replay-ledger row is kept at least, even once it is below the replay floor (guards a
    consumer stalled mid-batch while another one reclaimed and acknowledged its entries)."""

    maintenance_batch_size: int = Field(5000, alias="MAGPIE_MAINTENANCE_BATCH_SIZE", ge=1, le=1_000_000)
    """Rows (routes for per-route jobs) one maintenance batch handles; every batch is its own transaction."""
    maintenance_max_batches: int = Field(200, alias="MAGPIE_MAINTENANCE_MAX_BATCHES", ge=1)
    """Most batches one pass of a maintenance job runs; the next pass continues where it stopped."""
    maintenance_max_run_seconds: float = Field(120.0, alias="MAGPIE_MAINTENANCE_MAX_RUN_SECONDS", gt=0)
    """Seconds after which a maintenance pass stops at its next batch boundary."""
    maintenance_lock_ttl: float = Field(60.0, alias="MAGPIE_MAINTENANCE_LOCK_TTL", ge=1, le=DAY)
    """Seconds of a maintenance job's leader-lock lease (renewed every third of it while the job runs)."""
    maintenance_cadences: str = Field("", alias="MAGPIE_MAINTENANCE_CADENCES")
    """Per-job cadence overrides in seconds, ``job=seconds`` separated by commas
    (``history_retention=1800,orphans=300``); ``0`` takes a job off the beat schedule."""
    partition_months_ahead: int = Field(3, alias="MAGPIE_PARTITION_MONTHS_AHEAD", ge=1, le=36)
    """Monthly ``check_history`` partitions are created this many months beyond the current one."""
    partition_span: Literal["month", "day"] = Field("month", alias="MAGPIE_PARTITION_SPAN")
    """Time range of one ``check_history`` partition: ``month``, or ``day`` for large deployments (about
    275 M rows a day at a million routes on a five-minute interval), so that retention drops a day at a
    time and history holds the retention plus one day, not plus one month."""
    partition_days_ahead: int = Field(7, alias="MAGPIE_PARTITION_DAYS_AHEAD", ge=1, le=366)
    """Daily ``check_history`` partitions (``MAGPIE_PARTITION_SPAN=day``) are created this many days
    beyond the current one."""
    history_retention_days: int = Field(90, alias="MAGPIE_HISTORY_RETENTION_DAYS", ge=1)
    """Days of check history kept; a partition is dropped once its whole month (or day) is older."""
    body_retention_days: int = Field(7, alias="MAGPIE_BODY_RETENTION_DAYS", ge=0)
    """Days a check's judge response body is kept before it is blanked (set to NULL)."""
    daily_retention_days: int = Field(400, alias="MAGPIE_DAILY_RETENTION_DAYS", ge=1)
    """Days of ``route_daily`` counters kept."""
    rollup_lookback_days: int = Field(2, alias="MAGPIE_ROLLUP_LOOKBACK_DAYS", ge=0, le=60)
    """Closed days recomputed by every daily-counter pass (late results still land in them)."""
    token_retention_days: int = Field(7, alias="MAGPIE_TOKEN_RETENTION_DAYS", ge=0)
    """Days expired, used or revoked password-reset tokens and unaccepted invitations are kept."""
    schedule_auto_rebuild: bool = Field(True, alias="MAGPIE_SCHEDULE_AUTO_REBUILD")
    """Rebuild the Redis schedule from PostgreSQL when its bootstrap marker is gone (Redis lost data)."""

    metrics_port: int | None = Field(None, alias="MAGPIE_METRICS_PORT", ge=1, le=65535)
    """When set, each Celery worker's main process serves ``/metrics`` on this port."""
    metrics_host: str = Field("127.0.0.1", alias="MAGPIE_METRICS_HOST")
    """Address the metrics endpoint binds to."""
    flower_address: str = Field("127.0.0.1", alias="MAGPIE_FLOWER_ADDRESS")
    """Address Flower binds to (read by ``flowerconfig.py``); ``0.0.0.0`` only inside a container whose
    port is published on the host's loopback."""
    flower_port: int = Field(5555, alias="MAGPIE_FLOWER_PORT", ge=1, le=65535)
    """Port Flower listens on (read by ``flowerconfig.py``)."""
    flower_basic_auth: str | None = Field(None, alias="MAGPIE_FLOWER_BASIC_AUTH")
    """``user:password`` Flower requires (HTTP basic auth); Flower refuses to start without it (or
    ``--basic-auth``/``--auth``) unless ``MAGPIE_FLOWER_ALLOW_NO_AUTH`` is set. Checked by Flower only."""
    flower_allow_no_auth: bool = Field(False, alias="MAGPIE_FLOWER_ALLOW_NO_AUTH")
    """Let Flower start without authentication, on a loopback address only (local development)."""
    health_timeout: float = Field(2.0, alias="MAGPIE_HEALTH_TIMEOUT", gt=0, le=60)
    """Seconds each readiness probe (Redis, PostgreSQL, broker) may take."""

    # --- settings: schedule backend (PostgreSQL provider) ---
    schedule_url: str | None = Field(None, alias="MAGPIE_SCHEDULE_URL")
    """Where the route schedule lives: ``redis://``, ``rediss://``, ``unix://`` (the Redis schedule, the
    default: ``MAGPIE_REDIS_URL``) or ``postgresql://`` / ``postgresql+psycopg2://`` (the PostgreSQL
    schedule, one table; run ``magpie db upgrade`` on that database first)."""

    @field_validator("schedule_url")
    @classmethod
    def _schedule_scheme(cls, v: str | None) -> str | None:
        from magpie.base.schedule_urls import SCHEMES, scheme_of

        if v is not None and not v.strip():
            return None
        if v is not None and scheme_of(v) not in SCHEMES:
            raise ValueError("accepted schemes: " + ", ".join(f"{s}://" for s in SCHEMES))
        problem = redis_db_problem(v) if v is not None else None
        if problem:
            raise ValueError(problem)
        return v

    # --- settings: operator web dashboard ---
    web_host: str = Field("127.0.0.1", alias="MAGPIE_WEB_HOST")
    """Address ``magpie web`` binds to; any other than loopback needs ``MAGPIE_WEB_TOKEN`` (reads then
    need it too)."""
    web_port: int = Field(8080, alias="MAGPIE_WEB_PORT", ge=1, le=65535)
    """TCP port ``magpie web`` listens on."""
    web_token: str | None = Field(None, alias="MAGPIE_WEB_TOKEN", min_length=16)
    """Bearer token (16+ characters) for the dashboard's operator actions; unset refuses every action."""
    web_allowed_hosts: str | None = Field(None, alias="MAGPIE_WEB_ALLOWED_HOSTS")
    """Comma-separated ``Host`` header names the dashboard answers (``*.example.com`` matches subdomains,
    ``*`` any); others get 400. Default: the bound address and ``localhost`` (any name on a wildcard bind
    such as ``0.0.0.0``, where every read needs the token)."""
    web_session_ttl: float = Field(8 * HOUR, alias="MAGPIE_WEB_SESSION_TTL", ge=60, le=30 * DAY)
    """Seconds a dashboard sign-in lasts (the session cookie's and its Redis record's lifetime)."""
    web_cookie_secure: bool = Field(True, alias="MAGPIE_WEB_COOKIE_SECURE")
    """Mark the session cookie ``Secure`` (browsers then send it over HTTPS and to localhost only); false
    only for a plain-HTTP trial on another address."""
    web_sample_interval: float = Field(10.0, alias="MAGPIE_WEB_SAMPLE_INTERVAL", ge=1, le=HOUR)
    """Seconds between two samples of throughput and lateness kept for the dashboard's charts."""
    web_sample_keep: int = Field(720, alias="MAGPIE_WEB_SAMPLE_KEEP", ge=10, le=10_000)
    """Samples kept in the Redis ring behind the charts (720 x 10 s = 2 hours)."""
    web_page_size: int = Field(100, alias="MAGPIE_WEB_PAGE_SIZE", ge=10, le=1000)
    """Rows per page of the dashboard's route and dead-letter lists."""

    # --- settings: the program API (/api, API tokens) ---
    api_rate: float = Field(20.0, alias="MAGPIE_API_RATE", gt=0, le=100_000)
    """Requests per second each API token may send on average (a token bucket per token, kept in Redis)."""
    api_burst: int = Field(40, alias="MAGPIE_API_BURST", ge=1, le=1_000_000)
    """Requests a token may send at once before ``MAGPIE_API_RATE`` paces it (the bucket's size)."""
    api_import_max_bytes: int = Field(16 * 1024 * 1024, alias="MAGPIE_API_IMPORT_MAX_BYTES", ge=1024,
                                      le=1024 * 1024 * 1024)
    """Largest proxy list ``POST /api/imports`` takes, as a request body or fetched from a URL (bytes)."""
    api_fetch_timeout: float = Field(30.0, alias="MAGPIE_API_FETCH_TIMEOUT", gt=0, le=600)
    """Seconds an import's ``source_url`` may take, connecting and reading the whole list."""
    api_fetch_allow_private: str = Field("false", alias="MAGPIE_API_FETCH_ALLOW_PRIVATE")
    """Non-public addresses an import's ``source_url`` may resolve to, as ``MAGPIE_CHECK_ALLOW_PRIVATE``
    takes them (``false``, ``true`` or CIDRs such as ``127.0.0.0/8``)."""

    @field_validator("api_fetch_allow_private", mode="before")
    @classmethod
    def _api_fetch_allow(cls, v):
        from magpie.base.egress import parse_allow

        if isinstance(v, bool):
            v = "true" if v else "false"
        parse_allow(v)
        return v

    # --- settings: observability (logs, probes) ---
    log_format: Literal["text", "json"] = Field("text", alias="MAGPIE_LOG_FORMAT")
    """Log lines of workers, beat and the CLI: ``text`` (Celery's format) or ``json`` (one object a line)."""
    metrics_route_series: int = Field(1000, alias="MAGPIE_METRICS_ROUTE_SERIES", ge=1, le=100_000)
    """Most label sets of ``magpie_routes_alive`` per scrape (the largest groups are kept)."""
    metrics_route_cache: float = Field(30.0, alias="MAGPIE_METRICS_ROUTE_CACHE", ge=0, le=3600)
    """Seconds the exporter reuses its whole-table aggregates: alive routes, deliveries (0: every scrape)."""

    # --- settings: operations (interval, demo) ---
    interval_respread: bool = Field(True, alias="MAGPIE_INTERVAL_RESPREAD")
    """Respread the schedule once, in bounded batches, when ``MAGPIE_CHECK_INTERVAL`` differs from the
    interval the schedule was spread for (the ``interval_respread`` maintenance job)."""
    dead_backoff_after: int = Field(0, alias="MAGPIE_DEAD_BACKOFF_AFTER", ge=0, le=1_000_000)
    """Default dead-route policy: after this many dead checks in a row a route is checked every
    ``MAGPIE_DEAD_BACKOFF_FACTOR`` x its interval until a check finds it alive (0: off)."""
    dead_backoff_factor: int = Field(4, alias="MAGPIE_DEAD_BACKOFF_FACTOR", ge=2, le=1000)
    """Interval multiplier of a backed-off dead route (2 to 1,000)."""
    priority_share: float = Field(0.5, alias="MAGPIE_PRIORITY_SHARE", ge=0.0, le=1.0)
    """Share (0 to 1) of each claim that new imports and ``check-now`` may take ahead of the due backlog
    (the priority lane); the backlog keeps the rest. 0: claims in due order only."""
    respread_batch: int = Field(1000, alias="MAGPIE_RESPREAD_BATCH", ge=10, le=10_000)
    """Routes one respread batch moves in one Lua call (10 to 10,000): bounds how long Redis is busy."""
    demo_prefix: str = Field("magpie-demo:", alias="MAGPIE_DEMO_PREFIX", min_length=1, max_length=64)
    """Redis key prefix of ``make demo`` (schedule and broker keys); only keys under it are reset."""
    demo_database: str = Field("magpie_demo", alias="MAGPIE_DEMO_DATABASE", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    """PostgreSQL database ``make demo`` creates on the server of ``MAGPIE_DATABASE_URL``; it drops it
    at its next start only if the demo created it."""

    # --- settings: import formats, enrichment, blacklists ---
    geoip_country_db: str | None = Field(None, alias="MAGPIE_GEOIP_COUNTRY_DB")
    """Path of a MaxMind-format country (or city) database file (``.mmdb``) the operator supplies; unset:
    no country enrichment. Read with the ``maxminddb`` reader; a changed file is noticed and reloaded."""
    geoip_asn_db: str | None = Field(None, alias="MAGPIE_GEOIP_ASN_DB")
    """Path of a MaxMind-format ASN database file (``autonomous_system_number`` and
    ``autonomous_system_organization``); unset: no ASN enrichment and no network-type guess."""
    geoip_check_interval: float = Field(60.0, alias="MAGPIE_GEOIP_CHECK_INTERVAL", ge=1, le=DAY)
    """Seconds between two looks of one process at the database files (mtime, size; a hash when they moved)."""
    enrich_cache_size: int = Field(65536, alias="MAGPIE_ENRICH_CACHE_SIZE", ge=16, le=10_000_000)
    """Entries of each in-process enrichment cache (GeoIP lookups, abuse scores); the oldest go first."""
    enrich_cache_ttl: float = Field(3600.0, alias="MAGPIE_ENRICH_CACHE_TTL", ge=1, le=MONTH)
    """Seconds a GeoIP lookup stays in the in-process cache (a database reload empties it)."""
    abuse_api_url: str = Field("https://api.abuseipdb.com/api/v2/check", alias="MAGPIE_ABUSE_API_URL")
    """AbuseIPDB-style check endpoint (``GET ?ipAddress=...&maxAgeInDays=...`` with a ``Key`` header);
    reached through the egress guard (``MAGPIE_ENRICH_ALLOW_PRIVATE``)."""
    abuse_api_key: str | None = Field(None, alias="MAGPIE_ABUSE_API_KEY", min_length=8)
    """API key of the abuse-reputation provider; unset turns abuse lookups off. Never logged or shown."""
    abuse_rate_per_minute: float = Field(30.0, alias="MAGPIE_ABUSE_RATE_PER_MINUTE", gt=0, le=60_000)
    """Most abuse lookups a process sends per minute (token bucket); lookups beyond it wait or are refused."""
    abuse_cache_ttl: float = Field(86400.0, alias="MAGPIE_ABUSE_CACHE_TTL", ge=1, le=MONTH)
    """Seconds one address's abuse score is reused from the in-process cache."""
    abuse_max_age_days: int = Field(90, alias="MAGPIE_ABUSE_MAX_AGE_DAYS", ge=1, le=365)
    """Days of reports the abuse provider considers (``maxAgeInDays``)."""
    abuse_timeout: float = Field(10.0, alias="MAGPIE_ABUSE_TIMEOUT", gt=0, le=120)
    """Seconds for connecting to and for reading from the abuse provider."""
    enrich_allow_private: str = Field("false", alias="MAGPIE_ENRICH_ALLOW_PRIVATE")
    """Non-public addresses blacklist URLs and the abuse provider may resolve to, as
    ``MAGPIE_CHECK_ALLOW_PRIVATE`` takes them (``false``, ``true`` or CIDRs such as ``127.0.0.0/8``)."""
    blacklist_policy: Literal["flag", "skip", "remove"] = Field("flag", alias="MAGPIE_BLACKLIST_POLICY")
    """What a listed route becomes in a workspace with no policy of its own (``magpie blacklists policy``):
    ``flag`` (marked, still checked), ``skip`` (marked, not imported and not scheduled while no workspace
    wants it checked) or ``remove`` (not imported; taken out of the workspace, and out of the schedule and
    PostgreSQL once no workspace owns it)."""
    blacklist_max_bytes: int = Field(64 * 1024 * 1024, alias="MAGPIE_BLACKLIST_MAX_BYTES", ge=1024,
                                     le=1024 * 1024 * 1024)
    """Largest blacklist source read (bytes); a larger file or download fails that source's refresh."""
    blacklist_max_entries: int = Field(1_000_000, alias="MAGPIE_BLACKLIST_MAX_ENTRIES", ge=1, le=50_000_000)
    """Most addresses and ranges kept from one source; a source with more fails its refresh."""
    blacklist_fetch_timeout: float = Field(30.0, alias="MAGPIE_BLACKLIST_FETCH_TIMEOUT", gt=0, le=600)
    """Seconds for connecting to and for reading from a blacklist URL."""

    # --- settings: proxy-list sources ---
    source_allow_private: str = Field("false", alias="MAGPIE_SOURCE_ALLOW_PRIVATE")
    """Non-public addresses proxy-list source URLs (and their redirects) may resolve to, as
    ``MAGPIE_CHECK_ALLOW_PRIVATE`` takes them (``false``, ``true`` or CIDRs such as ``127.0.0.0/8``)."""
    source_max_bytes: int = Field(16 * 1024 * 1024, alias="MAGPIE_SOURCE_MAX_BYTES", ge=1024,
                                  le=1024 * 1024 * 1024)
    """Largest body one source fetch reads (bytes); a longer one fails that fetch."""
    source_fetch_timeout: float = Field(30.0, alias="MAGPIE_SOURCE_FETCH_TIMEOUT", gt=0, le=600)
    """Seconds one source fetch may take in all (robots.txt, redirects, the body; a browser render)."""
    source_max_redirects: int = Field(5, alias="MAGPIE_SOURCE_MAX_REDIRECTS", ge=0, le=20)
    """Redirects one source fetch follows (each one through the egress guard)."""
    source_max_pages: int = Field(10, alias="MAGPIE_SOURCE_MAX_PAGES", ge=1, le=1000)
    """Pages of a paged list one fetch follows (``rel="next"`` links; 1: the first page only)."""
    source_dead_letter_after: int = Field(5, alias="MAGPIE_SOURCE_DEAD_LETTER_AFTER", ge=1, le=1000)
    """Failed fetches in a row after which a source is dead-lettered (off the schedule until refreshed)."""
    source_backoff_base: float = Field(60.0, alias="MAGPIE_SOURCE_BACKOFF_BASE", gt=0, le=DAY)
    """Seconds before the first retry of a failed source fetch; each further failure doubles it."""
    source_backoff_cap: float = Field(6 * HOUR, alias="MAGPIE_SOURCE_BACKOFF_CAP", gt=0, le=MONTH)
    """Longest wait (seconds) between retries of a failing source."""
    source_tick: float = Field(30.0, alias="MAGPIE_SOURCE_TICK", ge=0, le=DAY)
    """Seconds between two beat triggers of the due-source fetch task (0: no beat entry)."""
    source_batch: int = Field(8, alias="MAGPIE_SOURCE_BATCH", ge=1, le=1000)
    """Due sources one trigger claims and fetches."""
    source_concurrency: int = Field(4, alias="MAGPIE_SOURCE_CONCURRENCY", ge=1, le=64)
    """Sources one trigger fetches at once (threads)."""
    source_lease: float = Field(600.0, alias="MAGPIE_SOURCE_LEASE", ge=10, le=DAY)
    """Seconds a claimed source stays leased to its fetcher (keep it above the fetch and import time)."""
    source_robots_cache_size: int = Field(1024, alias="MAGPIE_SOURCE_ROBOTS_CACHE_SIZE", ge=1, le=1_000_000)
    """Origins whose robots.txt a process keeps (least recently used leave first)."""
    source_robots_ttl: float = Field(3600.0, alias="MAGPIE_SOURCE_ROBOTS_TTL", ge=1, le=MONTH)
    """Seconds a fetched robots.txt is reused."""
    source_browser_pages: int = Field(2, alias="MAGPIE_SOURCE_BROWSER_PAGES", ge=1, le=32)
    """Pages a process renders at once in headless Chromium for ``--browser`` sources."""
    source_chromium: str = Field("/usr/bin/chromium", alias="MAGPIE_SOURCE_CHROMIUM")
    """Chromium executable ``--browser`` sources are rendered with (Playwright drives it)."""

    @field_validator("source_allow_private", mode="before")
    @classmethod
    def _source_allow(cls, v):
        from magpie.base.egress import parse_allow

        if isinstance(v, bool):
            v = "true" if v else "false"
        parse_allow(v)
        return str(v)

    @field_validator("enrich_allow_private", mode="before")
    @classmethod
    def _enrich_allow(cls, v):
        from magpie.base.egress import parse_allow

        if isinstance(v, bool):
            v = "true" if v else "false"
        parse_allow(v)
        return str(v)


    # --- settings: judges, profiles, caches, failure tracking ---
    judge_failovers: int = Field(1, alias="MAGPIE_JUDGE_FAILOVERS", ge=0, le=5)
    """Other judges a check tries within the same cycle when its judge (not the route) failed."""
    judge_down_seconds: float = Field(30.0, alias="MAGPIE_JUDGE_DOWN_SECONDS", gt=0, le=HOUR)
    """Seconds a checker leaves out of its round robin a judge it found failing (until the refresh job
    or this timer brings it back)."""
    judge_probe_timeout: float = Field(5.0, alias="MAGPIE_JUDGE_PROBE_TIMEOUT", gt=0, le=120)
    """Seconds the judge refresh job gives one direct probe of a judge."""
    config_reconcile_seconds: float = Field(5.0, alias="MAGPIE_CONFIG_RECONCILE_SECONDS", ge=0.1, le=HOUR)
    """Seconds between two comparisons of a process's cached judges and profiles with the persisted
    revision (a missed notification converges within this cadence)."""
    profile_max_timeout: float | None = Field(None, alias="MAGPIE_PROFILE_MAX_TIMEOUT", gt=0, le=600)
    """Largest per-attempt timeout in seconds a check profile may set (default: ``MAGPIE_CHECK_TIMEOUT``);
    with the attempts bound it sets the longest check, which the check pool's start margin and last
    guard allow for."""
    profile_max_attempts: int | None = Field(None, alias="MAGPIE_PROFILE_MAX_ATTEMPTS", ge=1, le=10)
    """Most attempts a check profile may set (default: ``MAGPIE_CHECK_ATTEMPTS``)."""
    dns_cache_size: int = Field(10_000, alias="MAGPIE_DNS_CACHE_SIZE", ge=1, le=10_000_000)
    """Host names kept by a process's DNS cache (least recently used leave first)."""
    dns_ttl: float = Field(300.0, alias="MAGPIE_DNS_TTL", gt=0, le=DAY)
    """Seconds a resolved host name is kept when the resolver gives no TTL of its own (upper bound)."""
    dns_negative_ttl: float = Field(30.0, alias="MAGPIE_DNS_NEGATIVE_TTL", ge=0, le=HOUR)
    """Seconds a failed resolution is remembered (0: not cached)."""
    plan_cache_size: int = Field(4096, alias="MAGPIE_PLAN_CACHE_SIZE", ge=1, le=1_000_000)
    """Check plans (owner set and protocol to the checks to run) a process keeps per config revision."""
    ownership_verify_per_pass: int = Field(10_000, alias="MAGPIE_OWNERSHIP_VERIFY_PER_PASS", ge=1,
                                           le=10_000_000)
    """Routes the ``route_ownership`` job compares between Redis and PostgreSQL per pass (every 60 s),
    resuming where the last pass stopped: the sweep's cost is fixed per pass, not proportional to the
    population (10,000: a million routes are verified every ~100 minutes, ~170 routes/s)."""

    # --- settings: reputation, rollups, instances ---
    reputation_window_days: int = Field(7, alias="MAGPIE_REPUTATION_WINDOW_DAYS", ge=1, le=90)
    """Days of check history a route's reputation uptime and latency are computed from."""
    reputation_recency_horizon: float = Field(86400.0, alias="MAGPIE_REPUTATION_RECENCY_HORIZON", gt=0,
                                              le=MONTH)
    """Seconds after the newest alive check at which the recency component reaches 0 (linear decay)."""
    reputation_latency_good_ms: float = Field(500.0, alias="MAGPIE_REPUTATION_LATENCY_GOOD_MS", ge=0,
                                              le=600_000)
    """Mean alive latency (ms) at or below which the latency component is 1."""
    reputation_latency_bad_ms: float = Field(5000.0, alias="MAGPIE_REPUTATION_LATENCY_BAD_MS", gt=0,
                                             le=600_000)
    """Mean alive latency (ms) at or above which the latency component is 0 (must exceed the good one)."""
    reputation_streak_limit: int = Field(10, alias="MAGPIE_REPUTATION_STREAK_LIMIT", ge=1, le=10_000)
    """Consecutive failures at which the failure-streak component reaches 0."""
    reputation_max_age: float = Field(86400.0, alias="MAGPIE_REPUTATION_MAX_AGE", ge=60, le=MONTH)
    """Seconds after which a score is recomputed even without new results (recency decays)."""
    reputation_per_pass: int = Field(5_000, alias="MAGPIE_REPUTATION_PER_PASS", ge=1, le=10_000_000)
    """Most routes one pass of the ``reputation`` job scores (every 60 s), in route id order from where
    the last pass stopped: each score reads the route's window of history, so the job's cost per pass is
    fixed, not proportional to the population (5,000: a million routes are rescored every ~3.3 hours)."""
    rollup_lookback_hours: int = Field(2, alias="MAGPIE_ROLLUP_LOOKBACK_HOURS", ge=0, le=168)
    """Closed hours recomputed by every hourly-count pass besides the current one (late results)."""
    snapshot_retention_days: int = Field(30, alias="MAGPIE_SNAPSHOT_RETENTION_DAYS", ge=1, le=3650)
    """Days of 10-minute workspace snapshots kept."""
    hourly_retention_days: int = Field(30, alias="MAGPIE_HOURLY_RETENTION_DAYS", ge=1, le=3650)
    """Days of hourly route counts kept."""
    usage_retention_days: int = Field(400, alias="MAGPIE_USAGE_RETENTION_DAYS", ge=1, le=3650)
    """Days of daily workspace usage kept."""
    source_stats_retention_days: int = Field(7, alias="MAGPIE_SOURCE_STATS_RETENTION_DAYS", ge=1, le=3650)
    """Days a source-statistics row no refresh wrote (its source has no routes left) is kept."""
    instance_heartbeat: float = Field(10.0, alias="MAGPIE_INSTANCE_HEARTBEAT", gt=0, le=300)
    """Seconds between two refreshes of a worker's or beat's instance record."""
    instance_ttl: float = Field(30.0, alias="MAGPIE_INSTANCE_TTL", ge=1, le=3600)
    """Seconds an instance record lives after its last refresh (keep it above two heartbeats)."""

    # --- settings: rotators ---
    rotator_ports: str = Field("20000-20100", alias="MAGPIE_ROTATOR_PORTS", pattern=r"^\s*\d{1,5}\s*-\s*\d{1,5}\s*$")
    """Port range ``A-B`` (inclusive) rotators get their listening port from."""
    rotator_host: str = Field("127.0.0.1", alias="MAGPIE_ROTATOR_HOST")
    """Address rotator listeners bind to (``0.0.0.0`` to serve other hosts)."""
    rotator_reconcile: float = Field(10.0, alias="MAGPIE_ROTATOR_RECONCILE", gt=0, le=HOUR)
    """Seconds between a rotator process's reconciliations of its listeners with its assignments."""
    rotator_pool_refresh: float = Field(30.0, alias="MAGPIE_ROTATOR_POOL_REFRESH", gt=0, le=HOUR)
    """Seconds between reloads of each listener's eligible routes (changes also notify at once)."""
    rotator_tries: int = Field(3, alias="MAGPIE_ROTATOR_TRIES", ge=1, le=20)
    """Upstream routes tried per client connection before it is refused."""
    rotator_connect_timeout: float = Field(10.0, alias="MAGPIE_ROTATOR_CONNECT_TIMEOUT", gt=0, le=600)
    """Seconds an upstream route may take to connect and complete its proxy handshake."""
    rotator_idle_timeout: float = Field(300.0, alias="MAGPIE_ROTATOR_IDLE_TIMEOUT", gt=0, le=DAY)
    """Seconds a tunnel may stay without traffic in either direction before it is closed."""
    rotator_max_connections: int = Field(10_000, alias="MAGPIE_ROTATOR_MAX_CONNECTIONS", ge=1, le=1_000_000)
    """Client connections one rotator process serves at once (more wait in the listen backlog)."""
    rotator_metrics_port: int | None = Field(None, alias="MAGPIE_ROTATOR_METRICS_PORT", ge=1, le=65535)
    """Port of the rotator process's ``/metrics`` (None: not served)."""
    rotator_allow_private: str = Field("false", alias="MAGPIE_ROTATOR_ALLOW_PRIVATE")
    """Non-public destinations rotator clients may tunnel to (same syntax as ``MAGPIE_CHECK_ALLOW_PRIVATE``;
    default none: loopback, private and reserved addresses are refused, names after resolution)."""
    rotator_allowed_ports: str = Field("80,443", alias="MAGPIE_ROTATOR_ALLOWED_PORTS")
    """Destination ports rotator clients may tunnel to, e.g. ``80,443,8000-8100`` (a rotator's
    ``--allowed-ports`` replaces it for that rotator)."""


    # --- settings: rate limits, dashboard history ---
    judge_rate: float = Field(0.0, alias="MAGPIE_JUDGE_RATE", ge=0, le=1_000_000)
    """Requests per second a judge takes from the whole deployment, for judges whose own ``rate`` is not
    set (0: unlimited). A check out of tokens waits up to its deadline, then is retried, not recorded."""
    judge_rate_block: int = Field(256, alias="MAGPIE_JUDGE_RATE_BLOCK", ge=1, le=100_000)
    """Most judge tokens a check process takes from Redis in one call."""
    workspace_check_rate: float = Field(0.0, alias="MAGPIE_WORKSPACE_CHECK_RATE", ge=0, le=10_000_000)
    """Checks per second promote claims for one workspace's routes (0: unlimited); a route over every
    owner's budget is deferred."""
    workspace_check_rates: str = Field("", alias="MAGPIE_WORKSPACE_CHECK_RATES")
    """Per-workspace overrides of ``MAGPIE_WORKSPACE_CHECK_RATE``: ``<workspace id>=<checks/s>,...``."""
    rotator_client_rate: float = Field(0.0, alias="MAGPIE_ROTATOR_CLIENT_RATE", ge=0, le=1_000_000)
    """New connections per second one client address may open to one rotator (0: unlimited); more are
    refused (closed at once) and counted."""
    dashboard_snapshot_retention_days: int = Field(14, alias="MAGPIE_DASHBOARD_SNAPSHOT_RETENTION_DAYS",
                                                   ge=1, le=3650)
    """Days the dashboard's stored chart snapshots (job ``dashboard_snapshot``) are kept."""

    @field_validator("workspace_check_rates")
    @classmethod
    def _workspace_rates(cls, v: str) -> str:
        parse_workspace_rates(v)
        return v

    # --- settings: reliability (quarantine) ---

    @field_validator("rotator_ports")
    @classmethod
    def _rotator_ports(cls, v: str) -> str:
        lo, hi = (int(x) for x in v.split("-"))
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"{lo}-{hi} is not a range A-B with 1 <= A <= B <= 65535")
        return v

    @field_validator("maintenance_cadences")
    @classmethod
    def _cadences(cls, v: str) -> str:
        parse_cadences(v)
        return v

    @field_validator("rotator_allowed_ports")
    @classmethod
    def _rotator_allowed_ports(cls, v: str) -> str:
        from magpie.base.egress import format_ports, parse_ports

        return format_ports(parse_ports(v))

    @field_validator("check_allow_private", "webhook_allow_private", "rotator_allow_private", mode="before")
    @classmethod
    def _allow_private(cls, v):
        from magpie.base.egress import parse_allow

        if isinstance(v, bool):  # a bool (an override, an older config) stays as its word
            v = "true" if v else "false"
        parse_allow(v)
        return v

    @field_validator("egress_only")
    @classmethod
    def _egress_only(cls, v: str) -> str:
        from magpie.base.egress import parse_egress_only

        parse_egress_only(v)
        return v.strip()

    @field_validator("judge_ca_bundle")
    @classmethod
    def _ca_bundle_readable(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            return None
        if v is not None and not os.path.isfile(v):
            raise ValueError("not a readable PEM file")
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        from magpie.base.redisconn import url_problem

        problem = url_problem(v) or redis_db_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @property
    def schedule(self) -> ScheduleSettings:
        """The schedule's slice of the settings."""
        return ScheduleSettings(
            self.redis_url, self.redis_prefix, self.queue_shards, int(self.check_interval * 1000),
            int(self.lease_seconds * 1000), self.max_stalled, self.max_inflight, self.promote_budget,
            self.pop_batch, self.routes_per_task, self.dead_backoff_after, self.dead_backoff_factor,
            self.priority_share, self.schedule_partitions, self.redis_wait_replicas, self.redis_wait_timeout_ms)

    @property
    def checks(self) -> CheckSettings:
        """The check engine's and check pool's slice of the settings."""
        return CheckSettings(
            self.judge_url, self.check_timeout, self.connect_timeout, self.check_attempts, self.body_cap,
            self.check_allow_private, self.checks_per_process, self.renew_below_seconds * 1000,
            int(self.retry_base * 1000), int(self.retry_cap * 1000), self.complete_interval,
            self.checker_heartbeat, judge_ca_bundle=self.judge_ca_bundle)

    @property
    def stream(self) -> StreamSettings:
        """The results stream's slice of the settings."""
        return StreamSettings(self.redis_prefix, self.stats_stream_maxlen, self.stats_overflow,
                              self.stats_block_timeout, self.stats_batch, self.stats_max_deliveries)

    @property
    def connect_timeout(self) -> float:
        """Connect plus handshake timeout of one attempt in seconds (see ``MAGPIE_CONNECT_TIMEOUT``)."""
        return min(self.connect_timeout_s or self.check_timeout / 2, self.check_timeout)

    @property
    def max_check_seconds(self) -> float:
        """Upper bound in seconds on one check: attempts x deadline plus one second of slack."""
        return self.check_attempts * self.check_timeout + 1.0

    @model_validator(mode="after")
    def _broker_scheme(self) -> "Settings":
        # checked across the model so that the rejected URL (it may hold a password) is never echoed
        for url in self.broker_url.split(";"):
            scheme, sep, _ = url.strip().partition("://")
            if not sep or scheme.lower() not in BROKER_SCHEMES:
                named = sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]{0,19}", scheme)
                names = ", ".join(s + "://" for s in BROKER_SCHEMES[:-1]) + f" or {BROKER_SCHEMES[-1]}://"
                raise ValueError(f"MAGPIE_BROKER_URL: must be a {names} URL "
                                 f"(got {f'scheme {scheme!r}' if named else 'no scheme'})")
        kinds = {url.strip().partition("://")[0].lower() in AMQP_SCHEMES for url in self.broker_url.split(";")}
        if len(kinds) > 1:
            raise ValueError("MAGPIE_BROKER_URL: failover URLs (separated by ';') must be all RabbitMQ or all "
                             "Redis, not both")
        if self.broker_key_prefix and self.broker_is_amqp:
            raise ValueError("MAGPIE_BROKER_KEY_PREFIX: only for a Redis broker; on RabbitMQ give each "
                             "deployment a vhost of its own, the path of MAGPIE_BROKER_URL (amqp://host:5672/<vhost>)")
        return self

    @property
    def redis_cluster(self) -> bool:
        """True when ``MAGPIE_REDIS_URL`` names a Redis Cluster (``redis+cluster://``, ``rediss+cluster://``):
        the results streams then carry their partition's hash tag (:mod:`magpie.queue.partitions`)."""
        from magpie.base.redisconn import is_cluster_url

        return is_cluster_url(self.redis_url)

    @property
    def broker_is_amqp(self) -> bool:
        """True when ``MAGPIE_BROKER_URL`` (its first URL) is RabbitMQ: ``amqp://``, ``amqps://``, ``pyamqp://``."""
        return self.broker_url.strip().split("://", 1)[0].lower() in AMQP_SCHEMES

    @model_validator(mode="after")
    def _broker_beside_cluster(self) -> "Settings":
        from magpie.base.redisconn import is_cluster_url

        if is_cluster_url(self.redis_url) and "broker_url" not in self.model_fields_set:
            raise ValueError("MAGPIE_REDIS_URL names a Redis Cluster, which cannot be a Celery broker: set "
                             "MAGPIE_BROKER_URL (a plain redis:// or amqp:// URL)")
        return self

    @model_validator(mode="after")
    def _lease_fits_checks(self) -> "Settings":
        if self.lease_seconds <= self.max_check_seconds:
            raise ValueError(f"MAGPIE_LEASE_SECONDS ({self.lease_seconds:g}) must exceed MAGPIE_CHECK_ATTEMPTS x "
                             f"MAGPIE_CHECK_TIMEOUT + 1 ({self.max_check_seconds:g}): a check would outlive its lease")
        if self.renew_below_seconds >= self.lease_seconds:
            raise ValueError(f"MAGPIE_RENEW_BELOW_SECONDS ({self.renew_below_seconds:g}) must be below "
                             f"MAGPIE_LEASE_SECONDS ({self.lease_seconds:g})")
        return self

    @field_validator("redis_prefix")
    @classmethod
    def _prefix_nonempty(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("database_url")
    @classmethod
    def _pg_only(cls, v: str) -> str:
        if not v.startswith("postgresql"):
            raise ValueError("must be a postgresql:// URL")
        return v


def parse_cadences(text: str) -> dict[str, float]:
    """Parse ``MAGPIE_MAINTENANCE_CADENCES`` (``"job=seconds,job=seconds"``) into ``{job: seconds}``.

    Raises ``ValueError`` on a malformed pair or a negative number (job names are checked by
    :mod:`magpie.maintenance.beat`).
    """
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected job=seconds, got {part!r}")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"not a number of seconds for {name.strip()!r}: {value!r}") from None
        if seconds < 0:
            raise ValueError(f"negative cadence for {name.strip()!r}")
        out[name.strip()] = seconds
    return out


def parse_workspace_rates(text: str) -> dict[int, float]:
    """Parse ``MAGPIE_WORKSPACE_CHECK_RATES`` (``"12=50,7=0"``) into ``{workspace id: checks/s}``.

    Raises ``ValueError`` on a malformed pair, a non-integer id or a negative rate."""
    out: dict[int, float] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        ws, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError
            wid, rate = int(ws), float(value)
        except ValueError:
            raise ValueError(f"expected <workspace id>=<checks/s>, got {part!r}") from None
        if rate < 0 or wid < 1:
            raise ValueError(f"need a workspace id >= 1 and a rate >= 0, got {part!r}")
        out[wid] = rate
    return out


def load_settings(**overrides) -> Settings:
    """Build settings from the environment plus explicit ``overrides`` (field names).

    Raises :class:`ConfigError` naming the environment variable when a value is invalid. The message
    never holds a secret (:mod:`magpie.base.redact`): values of secret settings show as ``'***'``, URL
    passwords as ``user:***@``, and any secret value a validator's text repeats is masked too.
    """
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            if not err["loc"]:  # a rule across settings; its message names the variables
                parts.append(err["msg"].removeprefix("Value error, "))
                continue
            loc = err["loc"][0]
            field = Settings.model_fields.get(str(loc))
            name = field.alias if field is not None and field.alias else str(loc)
            parts.append(f"{name}: {err['msg']} (got {redact.shown(name, err.get('input'))})")
        fields = Settings.model_fields.items()
        names = {**{(f.alias or k).upper(): (f.alias or k).upper() for k, f in fields},
                 **{k.upper(): (f.alias or k).upper() for k, f in fields}}
        secrets = redact.secret_values(redact.raw_values(names, overrides))
        message = redact.scrub("invalid magpie configuration: " + "; ".join(parts), secrets)
        raise ConfigError(message) from None
    if settings.egress_only and not os.environ.get("MAGPIE_EGRESS_ONLY", "").strip():
        # set in .env (or an override) only: the guard and subprocesses read the environment
        from magpie.base.egress import install_socket_guard

        os.environ["MAGPIE_EGRESS_ONLY"] = settings.egress_only
        install_socket_guard()
    return settings


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, loaded once (see :func:`load_settings`)."""
    return load_settings()
