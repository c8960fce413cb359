"""Readiness: can this deployment do its work right now? (``magpie health``)

Probes, each bounded by ``MAGPIE_HEALTH_TIMEOUT`` seconds:

* ``redis``: ``PING`` on ``MAGPIE_REDIS_URL`` and one short-lived write; not ready while Redis refuses
  writes (``maxmemory`` reached under ``noeviction``), naming its memory state.
* ``postgres``: ``SELECT 1`` on ``MAGPIE_DATABASE_URL``.
* ``broker``: a kombu connection to ``MAGPIE_BROKER_URL`` (``ensure_connection``, one attempt).
* ``schema``: the database's Alembic revision equals the newest one shipped with the code.
* ``queue``: the schedule is bootstrapped: its heads index exists, or it was built from PostgreSQL (the
  rebuild marker is set; an operator may have drained it since), or PostgreSQL holds no route that a
  workspace owns (nothing to schedule).
* ``key``: ``PROXY_ENCRYPTION_KEY`` matches the fingerprint recorded in PostgreSQL (or none is recorded
  yet); read only, it never records one.
* ``judge``: no network; fails only when ``MAGPIE_JUDGE_CA_BUNDLE`` cannot be loaded for an https judge.
  For an https judge its detail notes that anonymity grading cannot see headers a proxy adds.

* ``stats``: statistics ingestion (Redis only): not ready while ingestion backs off because PostgreSQL
  refused writes (read-only, disk full, timeouts: results wait in the stream, none is lost, but none is
  stored either), until a write succeeds; ready with ``"warn": true`` (``WARN`` in the text output) while
  the dead-letter stream holds entries: nothing is blocked, but those results need an operator
  (inspect, then ``magpie stats redrive``).

* ``instances``: live instance heartbeats per role (:mod:`magpie.coordination.instances`) and the beat's
  schedule-bootstrap state; ready with a warning while no beat is live or its schedule is not loaded.

Readiness does not prove that jobs finish: watch ``magpie_maintenance_last_success_timestamp_seconds``,
failures and backlog for that (``magpie metrics``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis as redis_lib
import sqlalchemy as sa
from magpie.base import redisconn



class _Unreachable:
    """Stands in for a client that could not be built: every call raises the construction's error."""

    def __init__(self, exc: Exception):
        self._exc = exc

    def close(self) -> None:
        pass

    def __getattr__(self, name):
        def fail(*_a, **_k):
            raise self._exc
        return fail

def _probe(fn: Callable[[], str]) -> dict:
    t0 = time.monotonic()
    try:
        detail = fn()
        ok = True
    except Exception as exc:  # noqa: BLE001 - every failure is a "not ready" with its reason
        from magpie.base.redact import mask_url_passwords

        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        detail = f"{exc.__class__.__name__}: {mask_url_passwords(text)}"  # a driver may repeat its URL
        ok = False
    return {"ok": ok, "detail": detail, "ms": round((time.monotonic() - t0) * 1000, 1),
            "warn": ok and isinstance(detail, _Warning)}


def judge_probe(settings) -> str:
    """The judge's TLS setup, without connecting: the CA bundle loads, and the https grading note.

    Raises :class:`magpie.config.ConfigError` when ``MAGPIE_JUDGE_CA_BUNDLE`` cannot be loaded.
    """
    from urllib.parse import urlsplit

    from magpie.checker.tls import HTTPS_JUDGE_NOTE, is_https, judge_ssl_context
    from magpie.base.egress import EgressPolicy, is_ip_literal

    host = urlsplit(settings.judge_url).hostname or ""
    refused = EgressPolicy(settings.check_allow_private).refusal(host) if is_ip_literal(host) else None
    if refused:  # every check would be retried and none recorded
        return _Warning(f"judge refused by the egress guard: {refused}")
    if not is_https(settings.judge_url):
        return "http judge (anonymity graded from the headers it echoes)"
    judge_ssl_context(settings.judge_ca_bundle)
    trust = "CAs of MAGPIE_JUDGE_CA_BUNDLE" if settings.judge_ca_bundle else "system trust store"
    return f"{HTTPS_JUDGE_NOTE} (certificates verified against the {trust})"


class _Warning(str):
    """A probe's detail that is a warning: the check is ok, but an operator should look."""


def stats_probe(r: redis_lib.Redis, prefix: str, pairs=None) -> str:
    """The ``stats`` probe's detail; a :class:`_Warning` while dead letters wait.

    Raises ``RuntimeError`` while ingestion backs off because the database refuses writes."""
    from magpie.stats.status import pending_summary

    s = pending_summary(r, prefix, pairs)  # every partition's stream when ``pairs`` lists them
    inf = s["infra"]
    if inf is not None:
        raise RuntimeError(
            f"ingestion backing off: the database failed {inf['failures']} write attempt(s) in a row "
            f"(last: {inf['error']}); results wait in the stream"
        )
    backlog = s["length"] if s["lag"] is None else s["lag"]
    detail = f"backlog {backlog}, pending {s['pending']}"
    if s["dead"]:
        return _Warning(f"{s['dead']} dead-lettered result(s) ({detail}): inspect, then "
                        "`magpie stats redrive`")
    return f"{detail}, no dead letters"


def instances_probe(r: redis_lib.Redis, prefix: str) -> str:
    """The ``instances`` probe's detail: live instances per role and the beat's schedule-bootstrap state
    (:mod:`magpie.coordination.instances`); a :class:`_Warning` when no beat is live or none has bootstrapped its
    schedule (nothing is triggered). Raises ``redis.RedisError`` when Redis fails."""
    from magpie.coordination.instances import InstanceRegistry

    live = InstanceRegistry(r, prefix).list_live()
    roles: dict[str, int] = {}
    for rec in live:
        roles[str(rec.get("role"))] = roles.get(str(rec.get("role")), 0) + 1
    who = ", ".join(f"{n} {role}" for role, n in sorted(roles.items())) or "none"
    beats = [rec.get("schedule") or {} for rec in live if rec.get("role") == "beat"]
    if not beats:
        return _Warning(f"live instances: {who}; no beat instance: nothing triggers promote or the jobs")
    ready = [b for b in beats if b.get("bootstrapped")]
    if not ready:
        return _Warning(f"live instances: {who}; beat schedule not bootstrapped yet")
    entries = max(b.get("entries", 0) for b in ready)
    return f"live instances: {who}; beat schedule bootstrapped ({entries} entries)"


def redis_write_probe(r: redis_lib.Redis, prefix: str) -> str:
    """Whether Redis takes writes: one short-lived ``SET <prefix>health:write``.

    Returns ``"PING ok, writes ok"``. Raises ``RuntimeError`` naming the memory state when Redis refuses
    the write (``maxmemory`` reached under ``noeviction``: claims, completions, imports and results are
    all refused until memory is freed); other redis errors propagate."""
    from magpie.queue.redis_policy import is_write_refusal, refusal_line

    try:
        r.set(f"{prefix}health:write", "1", px=5000)
    except redis_lib.RedisError as exc:
        if not is_write_refusal(exc):
            raise
        raise RuntimeError(f"{refusal_line(r, exc)}; claims, completions and imports fail until memory is "
                           "freed or maxmemory raised") from None
    return "PING ok, writes ok"


def _stats_check(r: redis_lib.Redis, prefix: str, pairs=None) -> dict:
    return _probe(lambda: stats_probe(r, prefix, pairs))


def check_health(settings, *, timeout: float | None = None) -> dict:
    """Run every readiness probe.

    Args:
        settings: :class:`magpie.config.Settings`.
        timeout: seconds per probe (default ``MAGPIE_HEALTH_TIMEOUT``).
    Returns:
        ``{"ready": bool, "checks": {"redis" | "postgres" | "broker" | "schema" | "key" | "judge" | "queue" |
        "scripts" | "engines":
        {"ok": bool, "detail": str, "ms": float}}}``; ``ready`` is True only when every check is ok.
        Never raises for an unreachable service (it shows as a failed check).
    """
    t = float(timeout if timeout is not None else settings.health_timeout)
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    try:
        r = redisconn.connect(
            settings.redis_url, socket_timeout=t, socket_connect_timeout=t, retry=Retry(NoBackoff(), 0)
        )
    except redis_lib.ConnectionError as exc:  # a cluster client connects at once: fail the checks, not us
        r = _Unreachable(exc)
    engine = sa.create_engine(
        settings.database_url,
        poolclass=sa.pool.NullPool,
        connect_args={
            "connect_timeout": max(1, int(round(t))),
            "options": f"-c statement_timeout={int(t * 1000)}",
        },
    )
    checks: dict[str, dict] = {}
    try:

        def redis_probe() -> str:
            r.ping()
            return redis_write_probe(r, settings.redis_prefix)

        def pg_probe() -> str:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
            return "SELECT 1 ok"

        def broker_probe() -> str:
            from kombu import Connection

            from magpie.base.broker import broker_options

            opts = broker_options(settings)["broker_transport_options"]
            with Connection(settings.broker_url, connect_timeout=t, transport_options=opts) as conn:
                conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=t)
            return f"connected ({settings.broker_url.split('://', 1)[0]})"

        def schema_probe() -> str:
            from alembic.runtime.migration import MigrationContext

            from magpie.db.migrate import head_revision

            with engine.connect() as conn:
                current = MigrationContext.configure(conn).get_current_revision()
            head = head_revision()
            if current != head:
                raise RuntimeError(
                    f"database at revision {current}, code expects {head} (run: magpie db upgrade)"
                )
            return f"at head {head}"

        def key_probe() -> str:
            from magpie.base.crypto import KeyMismatchError
            from magpie.db.keycheck import MISMATCH_MESSAGE, read_status, short

            st = read_status(engine, settings.encryption_key)
            if st.state == "mismatch":
                raise KeyMismatchError(MISMATCH_MESSAGE)
            if st.state == "unrecorded":
                return ("PROXY_ENCRYPTION_KEY not recorded yet "
                        "(the first process using the database records it)")
            return f"PROXY_ENCRYPTION_KEY matches the recorded fingerprint {short(st.recorded)}"

        def queue_probe() -> str:
            from magpie.queue import QueueKeys

            keys = QueueKeys(settings.redis_prefix, settings.queue_shards)
            if (settings.schedule_url or "").startswith("postgresql"):  # the schedule lives in PostgreSQL
                from magpie.queue.pg.health import schedule_health

                sched = sa.create_engine(settings.schedule_url, poolclass=sa.pool.NullPool, connect_args={
                    "connect_timeout": max(1, round(t)), "options": f"-c statement_timeout={int(t * 1000)}"})
                try:
                    with sched.connect() as conn:
                        detail, warn = schedule_health(conn, keys.base)
                finally:
                    sched.dispose()
                return _Warning(detail) if warn else detail
            from magpie.queue.partitions import partition_names

            names = partition_names(int(getattr(settings, "schedule_partitions", 1) or 1))
            if r.exists(*[QueueKeys(settings.redis_prefix, settings.queue_shards, n).heads for n in names]):
                return "heads index present"
            if r.exists(keys.base + "maintenance_marker"):  # built from PostgreSQL, then drained on purpose
                return "schedule built from PostgreSQL (now empty)"
            with engine.connect() as conn:
                owned = conn.execute(sa.text("SELECT EXISTS (SELECT 1 FROM route_workspaces)")).scalar_one()
            if owned:
                raise RuntimeError(
                    "schedule not bootstrapped: no heads index but routes in PostgreSQL "
                    "(run: magpie queue rebuild)"
                )
            return "no routes to schedule"

        def scripts_probe() -> str:
            from magpie.queue.scripts import NAMES, script_text
            from magpie.stats.scripts import ALL as STREAM_SCRIPTS

            for name in NAMES:
                r.script_load(script_text(name))
            for script in STREAM_SCRIPTS:
                r.script_load(script.source()[0])
            return f"{len(NAMES) + len(STREAM_SCRIPTS)} scripts loaded"

        def engines_probe() -> str:
            from magpie.queue import QueueKeys
            from magpie.queue.capacity import CapacityRegistry

            live = CapacityRegistry(r, QueueKeys(settings.redis_prefix, settings.queue_shards)).engines()
            if not live:
                return "no check engine announced (promote claims nothing until a check worker runs)"
            return f"{len(live)} check engine(s), {sum(live.values())} slots"

        checks["redis"] = _probe(redis_probe)
        checks["postgres"] = _probe(pg_probe)
        checks["judge"] = _probe(lambda: judge_probe(settings))
        checks["broker"] = _probe(broker_probe)
        checks["schema"] = (
            _probe(schema_probe)
            if checks["postgres"]["ok"]
            else {"ok": False, "detail": "PostgreSQL unreachable", "ms": 0.0}
        )
        checks["key"] = (
            _probe(key_probe)
            if checks["postgres"]["ok"]
            else {"ok": False, "detail": "PostgreSQL unreachable", "ms": 0.0}
        )
        if checks["redis"]["ok"]:
            checks["scripts"] = _probe(scripts_probe)
            checks["engines"] = _probe(engines_probe)
            from magpie.queue.partitions import settings_stream_pairs

            checks["stats"] = _stats_check(r, settings.redis_prefix, settings_stream_pairs(settings))
            checks["instances"] = _probe(lambda: instances_probe(r, settings.redis_prefix))
        if checks["redis"]["ok"] and checks["postgres"]["ok"]:
            checks["queue"] = _probe(queue_probe)
        else:
            checks["queue"] = {"ok": False, "detail": "Redis or PostgreSQL unreachable", "ms": 0.0}
    finally:
        r.close()
        engine.dispose()
    return {"ready": all(c["ok"] for c in checks.values()), "checks": checks}


__all__ = ["check_health"]
