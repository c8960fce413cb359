"""Quiet housekeeping triggers: which tasks are ticks, what counts as work, and how the annotations land
on the registered tasks (the end-to-end measure is tests/e2e/test_flower_events.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from magpie.wiring.celery_config import build
from magpie.coordination.ticks import TICK_TASKS, annotations, did_work, quiet_beat, worked


@pytest.mark.parametrize("result, expected", [
    (0, False), (None, False), (3, True), (True, True), (False, False), ({}, False),
    (Counter(), False), (Counter(sent=1), True), ({"sent": 0, "retry": 0}, False), ({"failed": 2}, True),
    ({"now": "2026-01-01", "n": 0}, False), ("5", False), ([1], False),
    ({"complete": True, "deleted": 0}, False), ({"created": True, "moved": 0}, True),
    ({"configured_ms": 8000, "effective_ms": 8000, "batches": 0}, False), ({"outer": {"moved": 4}}, True),
])
def test_did_work(result, expected):
    assert did_work(result) is expected


@pytest.mark.parametrize("out, expected", [
    ({"status": "skipped", "result": None, "reason": "held"}, False),
    ({"status": "ok", "result": {"deleted": 0, "complete": True}, "seconds": 0.2, "generation": 7}, False),
    ({"status": "ok", "result": {"deleted": 12, "complete": True}, "seconds": 0.2}, True),
    ({"status": "error", "result": None, "error": "boom"}, True),
    (None, False),
])
def test_a_maintenance_pass_counts_as_work_when_it_did_something(out, expected):
    assert worked("magpie.maintenance.run", out) is expected


def test_an_alert_evaluation_counts_as_work_when_it_applied_or_moved_something():
    idle = {"now": "x", "workspaces": 3, "rules": 0, "applied": 0, "stale": 0, "outcomes": {}, "errors": [],
            "transitions": []}
    assert not worked("magpie.alerts.evaluate", idle) and not worked("magpie.alerts.evaluate", None)
    assert worked("magpie.alerts.evaluate", idle | {"applied": 2})
    assert worked("magpie.alerts.evaluate", idle | {"errors": ["rule 3: bad"]})


def test_every_frequent_beat_entry_is_a_quiet_tick(settings):
    conf = build(settings)
    for name, entry in conf["beat_schedule"].items():
        period = entry["schedule"].total_seconds()
        if period <= 60:
            assert entry["task"] in TICK_TASKS, f"beat entry {name} runs every {period:g} s but is not a tick"
    for task in TICK_TASKS:
        ann = conf["task_annotations"][task]
        assert ann["send_events"] is False and callable(ann["after_return"]) and callable(ann["before_start"])
    assert "soft_time_limit" in conf["task_annotations"]["magpie.check_routes"]
    assert set(annotations(["x"])) == {"x"}


def test_annotations_reach_the_registered_tasks():
    import magpie.wiring.tasks  # noqa: F401 - registers the tasks
    from celery.app.trace import task_has_custom

    from magpie.wiring.celery_app import app

    for name in TICK_TASKS:
        task = app.tasks[name]
        assert task.send_events is False and task_has_custom(task, "after_return")
    for name in ("magpie.check_routes", "magpie.maintenance.rebuild_schedule"):
        assert app.tasks[name].send_events is True


def test_beat_sends_no_task_sent_events():
    class Conf:
        task_send_sent_event = True

    class App:
        conf = Conf()

    class Service:
        app = App()

    svc = Service()
    quiet_beat(sender=svc)
    assert svc.app.conf.task_send_sent_event is False
    quiet_beat(sender=None)  # no sender: nothing to do, no error
