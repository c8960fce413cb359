"""Celery worker hooks: which processes run a check pool, and its clean start and stop.

A worker that consumes the ``checks`` queue (named in ``-Q``, or no ``-Q`` at all) runs one
:class:`magpie.checkpool.CheckPool` per pool process, started as the process starts so that its capacity
is announced before promote needs it; promote claims nothing while no engine announces slots. On a
process's shutdown the pool hands its leases back unchecked (no stall is counted). A worker on other
queues (promote, stats, jobs) starts no pool. The worker's main process also serves ``/metrics`` when
``MAGPIE_METRICS_PORT`` is set.
"""

from __future__ import annotations

import logging

from celery import signals

log = logging.getLogger(__name__)

_state = {"checks": False, "prefork": True}


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


def _start_pool() -> None:
    from magpie import runtime

    try:
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
    if _state["checks"] and not _state["prefork"]:
        _start_pool()


@signals.worker_process_shutdown.connect(weak=False)
def _on_process_shutdown(**_kw) -> None:
    from magpie import runtime

    runtime.close_check_pool()


@signals.worker_shutdown.connect(weak=False)
def _on_shutdown(**_kw) -> None:
    from magpie import runtime

    runtime.close_check_pool()


@signals.worker_init.connect(weak=False)
def _serve_metrics(**_kw) -> None:
    from magpie.config import get_settings
    from magpie.metrics import serve

    s = get_settings()
    if not s.metrics_port:
        return
    try:
        serve(s, s.metrics_host, s.metrics_port)
        log.info("metrics on http://%s:%d/metrics", s.metrics_host, s.metrics_port)
    except OSError as exc:
        log.warning("metrics endpoint not started on %s:%s: %s", s.metrics_host, s.metrics_port, exc)
