"""Celery worker hooks: which processes run a check pool, and its clean start and stop.

A worker that consumes the ``checks`` queue (named in ``-Q``, or no ``-Q`` at all) runs one
:class:`magpie.pipeline.checkpool.CheckPool` per pool process, started as the process starts so that its capacity
is announced before promote needs it; promote claims nothing while no engine announces slots. On a
process's shutdown the pool hands its leases back unchecked (no stall is counted). A worker on other
queues (promote, stats, jobs) starts no pool. The worker's main process also serves ``/metrics`` when
``MAGPIE_METRICS_PORT`` is set.

Every worker (whatever its queues) and beat first check that ``PROXY_ENCRYPTION_KEY`` is the database's
key (:func:`verify_key_at_start`): on a mismatch the process prints one line and exits with status 2
before it consumes or schedules anything.
"""

from __future__ import annotations

import logging
import sys
import time

from celery import signals

from magpie.wiring.runtime import worker_state as _state

log = logging.getLogger(__name__)


def consumes_checks(queues) -> bool:
    """True when a worker started with ``-Q queues`` (list, comma-separated text or None) takes ``checks``."""
    from celery.utils.text import str_to_list

    names = str_to_list(queues) if queues else []
    return not names or "checks" in names


@signals.celeryd_init.connect(weak=False)
def _on_init(sender=None, instance=None, conf=None, options=None, **_kw) -> None:
    options = options or {}
    _state["checks"] = consumes_checks(options.get("queues"))
    pool = str(options.get("pool") or options.get("pool_cls") or "prefork")
    _state["prefork"] = "prefork" in pool or "processes" in pool
    if _state["checks"] and _state["prefork"] and conf is not None:
        size_check_processes(conf, options.get("concurrency"))


def size_check_processes(conf, given) -> None:
    """Set ``worker_concurrency`` of a check worker started without ``--concurrency``: from
    ``MAGPIE_CHECK_CONCURRENCY``, else one process per core plus one, or more under a low open-file limit
    (:func:`magpie.checker.limits.size_check_worker`); logs the sizing either way.

    Args: ``conf`` the Celery app's configuration; ``given`` the worker's ``--concurrency`` (None or 0:
    not given). A bad setting raises :class:`magpie.config.ConfigError` (one line naming it)."""
    from magpie.checker.limits import size_check_worker
    from magpie.config import get_settings

    s = get_settings()
    wanted = int(given) if given else s.check_concurrency
    sizing = size_check_worker(s.checks_per_process, wanted)
    if not given:
        conf.worker_concurrency = sizing.processes
    _state["sizing"] = sizing  # logged once logging is set up (worker_ready)


def verify_key_at_start(settings=None, *, poll_s: float = 2.0) -> None:
    """Check ``PROXY_ENCRYPTION_KEY`` against the database (recording its fingerprint on first use).

    Waits up to ``MAGPIE_KEY_CHECK_WAIT`` seconds for PostgreSQL to be reachable and migrated (processes
    may start alongside the database and ``magpie db upgrade``), polling every ``poll_s`` seconds.

    Args:
        settings: :class:`magpie.config.Settings` (default: the process's).
    Raises:
        magpie.base.crypto.KeyMismatchError: another key (at once, no waiting).
        magpie.errors.MagpieError: PostgreSQL still unreachable or unmigrated when the wait ends, or a
            bad setting (:class:`magpie.config.ConfigError`). One-line messages without secrets.
    """
    import sqlalchemy as sa
    from sqlalchemy import exc as sa_exc

    from magpie.config import get_settings
    from magpie.db.keycheck import KeyTableMissing, verify_key
    from magpie.errors import MagpieError

    s = settings or get_settings()
    deadline = time.monotonic() + s.key_check_wait
    engine = sa.create_engine(s.database_url, poolclass=sa.pool.NullPool, connect_args={"connect_timeout": 5})
    try:
        while True:
            try:
                verify_key(engine, s.encryption_key)
                return
            except (KeyTableMissing, sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
                if isinstance(exc, KeyTableMissing):
                    why = str(exc)
                else:
                    first = (str(getattr(exc, "orig", exc)).strip().splitlines() or [""])[0]
                    why = f"cannot reach PostgreSQL (MAGPIE_DATABASE_URL): {first}"
                if time.monotonic() + poll_s > deadline:
                    waited = f"waited {s.key_check_wait:g} s, MAGPIE_KEY_CHECK_WAIT"
                    raise MagpieError(f"{why} ({waited})") from None
                log.warning("waiting for PostgreSQL before checking PROXY_ENCRYPTION_KEY: %s", why)
                time.sleep(poll_s)
    finally:
        engine.dispose()


def _refuse_to_start() -> None:
    """Run :func:`verify_key_at_start`; on failure print one line and exit with status 2 (no traceback)."""
    from magpie.errors import MagpieError

    try:
        verify_key_at_start()
        from magpie.queue.redis_policy import verify_redis_policy_at_start

        verify_redis_policy_at_start()  # a Redis that may evict schedule keys
    except MagpieError as exc:
        # the process's own stderr: beat has redirected sys.stderr into its log by now
        print(f"Error: {exc}", file=sys.__stderr__ or sys.stderr, flush=True)
        raise SystemExit(2) from None


@signals.celeryd_init.connect(weak=False)
def _check_key_on_worker_init(**_kw) -> None:
    _refuse_to_start()  # main process, before any pool process or consumer starts


@signals.beat_init.connect(weak=False)
def _check_key_on_beat_init(**_kw) -> None:
    _refuse_to_start()


def _start_pool() -> None:
    from magpie.wiring import runtime

    try:
        from magpie.base.collector import tune_collector
        from magpie.config import get_settings

        tune_collector(get_settings().check_gc_interval)
        pool = runtime.check_pool()
        log.info("check pool started: %d checks at once", pool.capacity)
    except Exception:  # noqa: BLE001 - the first task will try again and report
        log.exception("check pool did not start")


@signals.worker_process_init.connect(weak=False)
def _on_process_init(**_kw) -> None:
    if _state["checks"]:
        _start_pool()


@signals.worker_ready.connect(weak=False)
def _on_ready(**_kw) -> None:
    sizing = _state.pop("sizing", None)
    if sizing is not None:
        log.info(sizing.describe())
    if _state["checks"] and not _state["prefork"]:
        _start_pool()


@signals.worker_process_shutdown.connect(weak=False)
def _on_process_shutdown(**_kw) -> None:
    from magpie.wiring import runtime

    runtime.close_check_pool()


@signals.worker_shutdown.connect(weak=False)
def _on_shutdown(**_kw) -> None:
    from magpie.wiring import runtime

    runtime.close_check_pool()


@signals.worker_init.connect(weak=False)
def _serve_metrics(**_kw) -> None:
    from magpie.config import get_settings
    from magpie.observability.metrics import serve
    from magpie.wiring.jobs import JOBS

    s = get_settings()
    if not s.metrics_port:
        return
    try:
        serve(s, s.metrics_host, s.metrics_port, jobs=JOBS.values())
        log.info("metrics on http://%s:%d/metrics", s.metrics_host, s.metrics_port)
    except OSError as exc:
        log.warning("metrics endpoint not started on %s:%s: %s", s.metrics_host, s.metrics_port, exc)


def declare_amqp_queues(app) -> int:
    """RabbitMQ only: declare every magpie queue (with its exchange and binding) on ``app``'s broker, not only
    the queues this worker consumes, so that Celery's native delayed delivery, which binds every queue of
    the app, finds them all even before the other workers started. Returns the count declared (0 for
    another broker or when the broker does not answer: the worker's own connection retries then)."""
    if app.connection_for_write().transport.driver_type != "amqp":
        return 0
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=2, interval_start=0.5, interval_step=0.5, timeout=10)
            channel = conn.default_channel
            for q in app.amqp.queues.values():
                q(channel).declare()
            return len(app.amqp.queues)
    except Exception as exc:  # noqa: BLE001 - the consumer's own connection retries and reports
        log.warning("magpie queues not declared before start: %s", exc.__class__.__name__)
        return 0


@signals.worker_init.connect(weak=False)
def _declare_queues(sender=None, **_kw) -> None:
    if sender is not None and getattr(sender, "app", None) is not None:
        declare_amqp_queues(sender.app)


# hooks: modules below connect their own Celery signal handlers when imported
import magpie.enrich.hooks  # noqa: E402,F401  (GeoIP revision announcements)
import magpie.wiring.instance_hooks  # noqa: E402,F401  (instance heartbeats of workers and beat)
from magpie.observability import logs  # noqa: E402,F401 (JSON log format; quiet housekeeping triggers)
from magpie.coordination import ticks  # noqa: E402,F401 (JSON log format; quiet housekeeping triggers)
