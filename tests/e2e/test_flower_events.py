"""What Flower sees: in a short demo-like run (the Procfile's workers and beat against the lab), at least
80 % of the task events on the broker are checks, deliveries or jobs that did work; idle housekeeping
triggers (promote, ingestion, the drains) send none. A Celery event receiver on the broker counts them,
as Flower's would."""

from __future__ import annotations

import ast
import contextlib
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from helpers import TimedOut, spawn_celery, stop_group, wait_until

from magpie.importer.service import import_file
from magpie.lab.lab import start_free_lab
from magpie.coordination.ticks import TICK_TASKS, worked

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a 35 s demo-like run: the slow tier
RUN_S = 35
PROMOTES = 15
WORK_PREFIXES = ("magpie.check_routes", "magpie.delivery.", "magpie.email.", "magpie.maintenance.",
                 "magpie.alerts.")


class Events:
    """Task events captured from the broker by ``celery.events.EventReceiver`` in a thread."""

    def __init__(self, broker_url: str, keyprefix: str):
        from celery import Celery

        self.app = Celery("flower-events-test", broker=broker_url)
        self.app.conf.broker_transport_options = {"global_keyprefix": keyprefix}
        self.events: list[dict] = []
        self._ready = threading.Event()
        self._recv = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.app.connection() as conn:
            self._recv = self.app.events.Receiver(conn, handlers={"*": self._on})
            self._ready.set()
            self._recv.capture(limit=None, timeout=None, wakeup=False)

    def _on(self, event: dict) -> None:
        if event.get("type", "").startswith("task-"):
            self.events.append(event)

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10)
        time.sleep(1.0)  # capture() subscribes without signalling it, and nothing is observable from here
        assert self._thread.is_alive(), "the event receiver stopped"  # subscribed before anything publishes

    def stop(self) -> bool:
        """Stop capturing; True when the receiver was still running (it never died on the way)."""
        alive = self._thread.is_alive()
        if self._recv is not None:
            self._recv.should_stop = True
        self._thread.join(10)
        return alive


def _classify(events: list[dict]) -> dict:
    names = {e["uuid"]: e["name"] for e in events if e.get("name")}
    results = {e["uuid"]: e.get("result") for e in events if e["type"] == "task-succeeded"}
    failed = {e["uuid"] for e in events if e["type"] == "task-failed"}
    per_kind: Counter = Counter()
    for e in events:
        name = names.get(e["uuid"], "?")
        if name in TICK_TASKS:
            raw = results.get(e["uuid"])
            try:
                value = ast.literal_eval(raw) if raw and not raw.startswith("Counter") else raw
            except (ValueError, SyntaxError):
                value = raw
            counter = isinstance(value, str) and re.search(r": [1-9]", value)  # Counter({'sent': 1})
            did = e["uuid"] in failed or worked(name, value) or bool(counter)
            per_kind["tick that did work" if did else "idle tick"] += 1
        elif name.startswith(WORK_PREFIXES):
            per_kind[name] += 1
        else:
            per_kind[f"other: {name}"] += 1
    return {"names": names, "per_kind": per_kind}


def test_flower_task_events_are_mostly_work(settings, db, pg_url, redis_prefix, tmp_path):
    lab = start_free_lab(slow_delay=1.0)
    keyprefix = redis_prefix + "broker:"
    env = dict(os.environ)
    env.update({
        "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": redis_prefix,
        "MAGPIE_BROKER_URL": settings.redis_url, "MAGPIE_BROKER_KEY_PREFIX": keyprefix,
        "MAGPIE_DATABASE_URL": pg_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
        "MAGPIE_JUDGE_URL": lab.judge_url, "MAGPIE_CHECK_INTERVAL": "8", "MAGPIE_CHECK_TIMEOUT": "6",
        "MAGPIE_LEASE_SECONDS": "60", "MAGPIE_RENEW_BELOW_SECONDS": "20",
        "MAGPIE_DELIVERY_INTERVAL": "2", "MAGPIE_EMAIL_INTERVAL": "2",  # more idle drains than the demo
    })
    receiver = Events(settings.redis_url, keyprefix)
    procs = []
    listening = False
    beat_log = tmp_path / "beat.log"
    try:
        lst = tmp_path / "lab.txt"
        lab.write_list(lst)
        import_file(lst, "flower", settings.model_copy(update={"check_interval": 8.0}))
        receiver.start()
        log = open(tmp_path / "workers.log", "w")
        blog = open(beat_log, "w")
        tag = redis_prefix.split(":")[1]
        common = ["--loglevel=info", "--without-mingle", "--without-gossip"]
        for args in (["-Q", "promote", "-n", f"promote-{tag}@%h", "--pool=solo"],
                     ["-Q", "checks", "-n", f"checks-{tag}@%h", "--concurrency=2"],
                     ["-Q", "stats,alerts,delivery,email,maintenance", "-n", f"jobs-{tag}@%h",
                      "--concurrency=2"]):
            procs.append(spawn_celery(["worker", *args, *common], env, log, ROOT))
        beat_args = ["beat", "--loglevel=info", f"--schedule={tmp_path / 'beat'}"]
        procs.append(spawn_celery(beat_args, env, blog, ROOT))
        def promoted():  # until beat has triggered promote PROMOTES times
            assert all(p.poll() is None for p in procs), (tmp_path / "workers.log").read_text()[-3000:]
            return beat_log.read_text().count("(magpie.promote)") >= PROMOTES

        with contextlib.suppress(TimedOut):  # the counts are asserted below
            wait_until(promoted, timeout=RUN_S, interval=0.5, what=f"{PROMOTES} promote triggers")
    finally:
        stoppers = [threading.Thread(target=stop_group, args=(p,)) for p in procs]  # in parallel
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        listening = receiver.stop()
        lab.stop()
    assert listening, "the event receiver stopped early"

    triggers = Counter(re.findall(r"Sending due task \S+ \((\S+)\)", beat_log.read_text()))
    got = _classify(receiver.events)
    per_kind = got["per_kind"]
    total = sum(per_kind.values())
    work = total - per_kind["idle tick"] - sum(v for k, v in per_kind.items() if k.startswith("other"))
    checks = per_kind["magpie.check_routes"]
    tick_triggers = sum(n for name, n in triggers.items() if name in TICK_TASKS)
    # What the same run would have shown with every trigger sending its four events (sent, received,
    # started, succeeded), the check events unchanged.
    before = checks / max(1, checks + 4 * tick_triggers)
    print(f"\nbeat triggers: {dict(triggers)}\ntask events: {total} {dict(per_kind)}\n"
          f"work share: {work / max(1, total):.2f} "
          f"(with every trigger visible it would be about {before:.2f})")

    assert checks > 0, "the receiver saw no check: it did not listen"
    assert triggers["magpie.promote"] >= 8 and triggers["magpie.delivery.drain"] >= 3
    assert per_kind["idle tick"] == 0
    drains = [u for u, n in got["names"].items() if n in ("magpie.delivery.drain", "magpie.email.drain")]
    assert not drains, "idle drains reached the event stream"
    assert work / total >= 0.8, dict(per_kind)

    # Flower's view (celery.events.state, what Flower keeps): each reported tick is a named, finished task.
    from celery.events.state import State

    state = State()
    for e in receiver.events:
        state.event(dict(e))
    ticks = [t for t in state.tasks.values() if t.name in TICK_TASKS]
    assert ticks and all(t.state == "SUCCESS" and t.runtime is not None and t.worker for t in ticks)
    assert all(t.name in TICK_TASKS or t.name.startswith(WORK_PREFIXES) for t in state.tasks.values())
