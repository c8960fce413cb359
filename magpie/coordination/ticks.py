"""Housekeeping triggers ("ticks") stay out of Flower's task history unless they did something.

Beat triggers promote and ingestion every second, the delivery and email drains every few seconds and
the maintenance, alert and outbox jobs every minute or so: hundreds of thousands of trigger tasks a day
with an empty schedule, which would bury the checks, deliveries and job passes that did something, the
ones an operator looks for in Flower. So:

* a tick task sends no worker events (``send_events = False``, set through Celery's
  ``task_annotations``, see :func:`annotations`);
* beat publishes no ``task-sent`` events (:func:`quiet_beat`, on ``beat_init``): what beat triggers is
  reported by the worker that runs it;
* a tick that did work (promote claimed routes, ingestion stored results, a drain sent or retried
  something, a maintenance pass deleted or moved rows, an evaluation applied rules: see :data:`TICKS`)
  or failed reports itself after the fact with the ``task-received``,
  ``task-started`` and ``task-succeeded`` / ``task-failed`` events Flower shows, through one pooled
  event producer. An idle tick costs no event at all.

Beat stays the trigger; nothing about scheduling changes. Workers started without task events
(no ``-E``, ``worker_send_task_events`` off) send none of these either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from celery import signals

_TIME_KEYS = ("_ms", "_s", "seconds", "generation", "_at")


def did_work(result) -> bool:
    """True when a tick's return value counts something done.

    Args:
        result: the task's return value: a count (``int``; promote's claims, ingestion's stored
            results), or a mapping of counts (a drain's outcome ``Counter``; nested mappings are looked
            into). Booleans other than a top-level ``True``, and values under keys naming a duration, a
            time or a generation (``*_ms``, ``*_s``, ``*seconds``, ``*_at``, ``generation``), are not counts.
    Returns:
        True for a positive count; False for ``0``, ``None``, an empty mapping, or text.
    """
    if isinstance(result, bool):
        return result
    if isinstance(result, (int, float)):
        return result > 0
    if isinstance(result, Mapping):
        return any(_counts(k, v) for k, v in result.items())
    return False


def _counts(key, value) -> bool:
    if isinstance(value, bool) or str(key).endswith(_TIME_KEYS):
        return key == "created" and value is True
    if isinstance(value, Mapping):
        return did_work(value)
    return isinstance(value, (int, float)) and value > 0


def _maintenance_worked(out) -> bool:
    """A maintenance pass (:func:`magpie.maintenance.runner.run_job`'s dict) did work when it ended in
    ``error`` or its job's result counts something done; a ``skipped`` pass (another leader, slot
    already run) never did."""
    if not isinstance(out, Mapping):
        return False
    return out.get("status") == "error" or (out.get("status") == "ok" and did_work(out.get("result") or {}))


def _alerts_worked(out) -> bool:
    """An alert evaluation did work when it applied a rule's evaluation, moved an incident or hit errors."""
    if not isinstance(out, Mapping):
        return False
    return bool(out.get("applied") or out.get("transitions") or out.get("errors"))


TICKS: dict[str, object] = {
    "magpie.promote": did_work,
    "magpie.ingest_stats": did_work,
    "magpie.delivery.drain": did_work,
    "magpie.email.drain": did_work,
    "magpie.email.housekeeping": did_work,
    "magpie.alerts.evaluate": _alerts_worked,
    "magpie.maintenance.run": _maintenance_worked,
    "magpie.maintenance.fetch_sources": did_work,
}
"""Tasks beat triggers on a cadence whatever there is to do -> the predicate telling, from the task's
return value, whether a run did work (and so is reported)."""

TICK_TASKS: tuple[str, ...] = tuple(TICKS)
"""Names of the tick tasks."""

_started: dict[str, tuple[float, float]] = {}  # task id -> (wall clock, monotonic) at start
_started_lock = threading.Lock()


def worked(task_name: str, result) -> bool:
    """True when a run of tick ``task_name`` returning ``result`` did work (:data:`TICKS`' predicate)."""
    return bool(TICKS.get(task_name, did_work)(result))


def _before_start(self, task_id, args, kwargs) -> None:
    with _started_lock:
        _started[task_id] = (time.time(), time.monotonic())


def _after_return(self, status, retval, task_id, args, kwargs, einfo) -> None:
    with _started_lock:
        wall, mono = _started.pop(task_id, (time.time(), time.monotonic()))
    failed = status == "FAILURE"
    if not (failed or (status == "SUCCESS" and worked(self.name, retval))):
        return
    if not self.app.conf.worker_send_task_events:
        return
    runtime = time.monotonic() - mono
    report_events(self, task_id, args, kwargs, wall, runtime, retval, einfo if failed else None)


def report_events(task, task_id: str, args, kwargs, started_at: float, runtime_s: float, result, einfo=None):
    """Send the events Flower needs to show one finished run of ``task``.

    Args:
        task: the bound Celery task (its ``request`` gives hostname and ids).
        task_id: the run's id; args / kwargs: its arguments (ticks take none or a job name).
        started_at: Unix time the run started (s); runtime_s: how long it ran (s).
        result: the return value (success) or the exception (failure).
        einfo: ``celery.utils.collections.ExceptionInfo`` for a failure, else None.
    A failure to publish is swallowed: events must never fail the task.
    """
    from magpie.base.redact import mask_url_passwords

    req = task.request
    common = {"uuid": task_id}
    try:
        with task.app.events.default_dispatcher(hostname=req.hostname) as d:
            d.send("task-received", name=task.name, args=repr(list(args or ())),
                   kwargs=repr(dict(kwargs or {})),
                   retries=req.retries or 0, eta=None, expires=None, root_id=req.root_id or task_id,
                   parent_id=req.parent_id, timestamp=started_at, **common)
            d.send("task-started", timestamp=started_at, **common)
            if einfo is None:
                d.send("task-succeeded", result=mask_url_passwords(repr(result)), runtime=runtime_s, **common)
            else:
                d.send("task-failed", exception=mask_url_passwords(repr(result)),
                       traceback=mask_url_passwords(str(einfo.traceback or "")), **common)
    except Exception:  # noqa: BLE001 - monitoring must not fail a tick
        pass


def annotations(names=TICK_TASKS) -> dict:
    """``task_annotations`` entries making each task of ``names`` a quiet tick (no worker events; one
    after-the-fact report when it did work or failed)."""
    return {name: {"send_events": False, "before_start": _before_start, "after_return": _after_return}
            for name in names}


@signals.beat_init.connect(weak=False)
def quiet_beat(sender=None, **_kw) -> None:
    """Beat publishes no ``task-sent`` events: the worker running a triggered task reports it."""
    app = getattr(sender, "app", None)
    if app is not None:
        app.conf.task_send_sent_event = False


__all__ = ["TICKS", "TICK_TASKS", "annotations", "did_work", "quiet_beat", "report_events", "worked"]
