"""Celery signal hooks registering worker and beat processes as instances (:mod:`magpie.coordination.instances`).

* Worker main process: its record (role ``worker``, ``queues``, ``node`` name) is refreshed from
  ``worker_ready`` until ``worker_shutdown`` withdraws it; ``checks`` (``in_flight``, ``slots``,
  ``processes``) sums the reports of its check-pool processes.
* Check-pool processes (prefork children, or the main process of a solo/threads worker): a daemon thread
  reports the pool's running checks and slots every heartbeat under the worker's id.
* Beat: its record (role ``beat``) carries the schedule-bootstrap state in ``schedule``: ``entries``
  (loaded), ``bootstrapped`` (loaded and ticked at least once) and ``last_tick_age_s``.

Imported by :mod:`magpie.wiring.worker`; importing it only connects the handlers.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time

from celery import signals
from magpie.base import redisconn

log = logging.getLogger(__name__)

_node: dict = {"id": None, "queues": [], "name": None, "heartbeat": None, "reporter": None}


def _settings():
    from magpie.config import get_settings

    return get_settings()


def _client():
    import redis

    return redisconn.connect(_settings().redis_url, socket_timeout=5, socket_connect_timeout=5)


@signals.celeryd_init.connect(weak=False)
def _on_worker_init(sender=None, options=None, **_kw) -> None:
    from celery.utils.text import str_to_list

    from magpie.coordination.instances import new_id

    options = options or {}
    q = options.get("queues")
    _node["queues"] = str_to_list(q) if q else []
    _node["name"] = str(sender) if sender else None
    _node["id"] = new_id("worker")  # before the pool forks: children inherit it


def _pool_figures() -> tuple[int, int] | None:
    """(running checks, slots) of this process's check pool, if it has one (never builds one)."""
    from magpie.wiring import runtime

    pool = runtime._cache.get((os.getpid(), "check_pool"))  # noqa: SLF001 - read only, no side effect
    if pool is None:
        return None
    st = pool.stats()
    return st.running, st.capacity


def _report_loop(stop: threading.Event) -> None:
    from magpie.coordination.instances import InstanceRegistry

    s = _settings()
    reg = InstanceRegistry(_client(), s.redis_prefix)
    while not stop.is_set():
        try:
            figs = _pool_figures()
            if figs is not None and _node["id"]:
                reg.report_checks(_node["id"], os.getpid(), figs[0], figs[1], s.instance_ttl)
        except Exception:  # noqa: BLE001 - figures are best effort
            log.debug("check figures not reported", exc_info=True)
        stop.wait(s.instance_heartbeat)
    try:
        reg.forget_checks(_node["id"], os.getpid())
    except Exception:  # noqa: BLE001
        pass


def _start_reporter() -> None:
    if _node.get("reporter") is not None and _node["reporter"][1] == os.getpid():
        return
    stop = threading.Event()
    t = threading.Thread(target=_report_loop, args=(stop,), name="magpie-check-figures", daemon=True)
    t.start()
    _node["reporter"] = (stop, os.getpid(), t)


def _stop_reporter() -> None:
    rep = _node.get("reporter")
    if rep is not None and rep[1] == os.getpid():
        rep[0].set()
        rep[2].join(timeout=3)
        _node["reporter"] = None


@signals.worker_process_init.connect(weak=False)
def _on_child_init(**_kw) -> None:
    from magpie.wiring.runtime import worker_state as _state

    _node["reporter"] = None  # a forked copy of the parent's is not ours
    if _state.get("checks"):
        _start_reporter()


@signals.worker_process_shutdown.connect(weak=False)
def _on_child_shutdown(**_kw) -> None:
    _stop_reporter()


@signals.worker_ready.connect(weak=False)
def _on_worker_ready(**_kw) -> None:
    from magpie.coordination.instances import Heartbeat, InstanceRegistry
    from magpie.wiring.runtime import worker_state as _state

    s = _settings()
    if _node["id"] is None:
        from magpie.coordination.instances import new_id

        _node["id"] = new_id("worker")
    reg = InstanceRegistry(_client(), s.redis_prefix)

    def checks() -> dict:
        running, slots, procs = reg.checks_of(_node["id"], s.instance_ttl)
        return {"in_flight": running, "slots": slots, "processes": procs}

    hb = Heartbeat("worker", reg.r, s.redis_prefix, interval=s.instance_heartbeat, ttl=s.instance_ttl,
                   fields={"queues": _node["queues"] or ["(all)"], "node": _node["name"]},
                   dynamic={"checks": checks}, instance_id=_node["id"])
    _node["heartbeat"] = hb.start()
    if _state.get("checks") and not _state.get("prefork"):
        _start_reporter()  # the pool runs in this process
    log.info("instance %s registered (heartbeat every %gs, ttl %gs)", hb.id, hb.interval, hb.ttl)


@signals.worker_shutdown.connect(weak=False)
def _on_worker_shutdown(**_kw) -> None:
    _stop_reporter()
    hb = _node.get("heartbeat")
    if hb is not None:
        hb.stop(withdraw=True)
        _node["heartbeat"] = None


def beat_state(service) -> dict:
    """Schedule-bootstrap state of a Celery beat ``service``: ``entries`` (int), ``bootstrapped`` (bool:
    entries loaded and at least one tick), ``last_tick_age_s`` (seconds | None)."""
    try:
        entries = len(service.scheduler.schedule)
    except Exception:  # noqa: BLE001 - a scheduler that failed to load
        entries = 0
    last = getattr(service, "_last_tick", None)
    age = None if last is None else round(time.monotonic() - last, 1)
    return {"entries": entries, "bootstrapped": bool(entries) and last is not None, "last_tick_age_s": age}


@signals.beat_init.connect(weak=False)
def _on_beat_init(sender=None, **_kw) -> None:
    from magpie.coordination.instances import Heartbeat

    s = _settings()
    hb = Heartbeat("beat", _client(), s.redis_prefix, interval=s.instance_heartbeat, ttl=s.instance_ttl,
                   dynamic={"schedule": lambda: beat_state(sender)})
    _node["heartbeat"] = hb.start()
    atexit.register(hb.stop, True)
    log.info("instance %s registered", hb.id)
