"""Readiness: can this deployment do its work right now? (``magpie health``)

Probes, each bounded by ``MAGPIE_HEALTH_TIMEOUT`` seconds:

* ``redis``: ``PING`` on ``MAGPIE_REDIS_URL``.
* ``postgres``: ``SELECT 1`` on ``MAGPIE_DATABASE_URL``.
* ``broker``: a kombu connection to ``MAGPIE_BROKER_URL`` (``ensure_connection``, one attempt).
* ``schema``: the database's Alembic revision equals the newest one shipped with the code.
* ``queue``: the schedule is bootstrapped: its heads index exists, or it was built from PostgreSQL (the
  rebuild marker is set; an operator may have drained it since), or PostgreSQL holds no route that a
  workspace owns (nothing to schedule).

Readiness does not prove that jobs finish: watch ``magpie_maintenance_last_success_timestamp_seconds``,
failures and backlog for that (``magpie metrics``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis as redis_lib
import sqlalchemy as sa


def _probe(fn: Callable[[], str]) -> dict:
    t0 = time.monotonic()
    try:
        detail = fn()
        ok = True
    except Exception as exc:  # noqa: BLE001 - every failure is a "not ready" with its reason
        detail = f"{exc.__class__.__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        ok = False
    return {"ok": ok, "detail": detail, "ms": round((time.monotonic() - t0) * 1000, 1)}


def check_health(settings, *, timeout: float | None = None) -> dict:
    """Run every readiness probe.

    Args:
        settings: :class:`magpie.config.Settings`.
        timeout: seconds per probe (default ``MAGPIE_HEALTH_TIMEOUT``).
    Returns:
        ``{"ready": bool, "checks": {"redis" | "postgres" | "broker" | "schema" | "queue":
        {"ok": bool, "detail": str, "ms": float}}}``; ``ready`` is True only when every check is ok.
        Never raises for an unreachable service (it shows as a failed check).
    """
    t = float(timeout if timeout is not None else settings.health_timeout)
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    r = redis_lib.Redis.from_url(
        settings.redis_url, socket_timeout=t, socket_connect_timeout=t, retry=Retry(NoBackoff(), 0)
    )
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
            return "PING ok"

        def pg_probe() -> str:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
            return "SELECT 1 ok"

        def broker_probe() -> str:
            from kombu import Connection

            opts = {}
            if settings.broker_key_prefix and settings.broker_url.startswith("redis"):
                opts["global_keyprefix"] = settings.broker_key_prefix
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

        def queue_probe() -> str:
            from magpie.queue import QueueKeys

            keys = QueueKeys(settings.redis_prefix, settings.queue_shards)
            if r.exists(keys.heads):
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
        checks["broker"] = _probe(broker_probe)
        checks["schema"] = (
            _probe(schema_probe)
            if checks["postgres"]["ok"]
            else {"ok": False, "detail": "PostgreSQL unreachable", "ms": 0.0}
        )
        if checks["redis"]["ok"]:
            checks["scripts"] = _probe(scripts_probe)
            checks["engines"] = _probe(engines_probe)
        if checks["redis"]["ok"] and checks["postgres"]["ok"]:
            checks["queue"] = _probe(queue_probe)
        else:
            checks["queue"] = {"ok": False, "detail": "Redis or PostgreSQL unreachable", "ms": 0.0}
    finally:
        r.close()
        engine.dispose()
    return {"ready": all(c["ok"] for c in checks.values()), "checks": checks}


__all__ = ["check_health"]
