"""RabbitMQ as the broker: a real worker on a vhost of the test's own declares all of magpie's queues as
quorum queues (also those it does not consume), runs a task sent through them, and a ``countdown`` task goes through Celery's native delayed
delivery (held by RabbitMQ, not by the worker)."""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import pytest
from celery import Celery
from kombu import Queue

from helpers import spawn_celery, stop_group, wait_until

from magpie.base.broker import AMQP_DELIVERY_LIMIT, QUEUES
from magpie.wiring.celery_config import build
from magpie.lab.rabbitmq import ctl

ROOT = Path(__file__).resolve().parents[2]


def _env(settings, amqp_vhost, pg_url) -> dict:
    env = dict(os.environ)
    env.update({"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
                "MAGPIE_BROKER_URL": amqp_vhost.url, "MAGPIE_BROKER_KEY_PREFIX": "",
                "MAGPIE_DATABASE_URL": pg_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key})
    return env


def _received_at(log: Path, task_id: str) -> float | None:
    """Epoch seconds of the worker's ``Task ...[task_id] received`` line, or None."""
    m = re.search(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+): \w+/[\w-]+\] Task magpie\.promote\["
                  + re.escape(task_id) + r"\] received", log.read_text(errors="replace"))
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def test_worker_declares_quorum_queues_and_runs_tasks_sent_through_them(settings, pg_url, amqp_vhost, tmp_path):
    s = settings.model_copy(update={"broker_url": amqp_vhost.url, "broker_key_prefix": ""})
    log_path = tmp_path / "worker.log"
    log = open(log_path, "w")
    # it consumes two queues, and declares every magpie queue (magpie.wiring.worker.declare_amqp_queues)
    worker = spawn_celery(["worker", "-Q", "promote,checks", "-n", f"amqp-{uuid.uuid4().hex[:6]}@%h",
                           "--concurrency=1", "--loglevel=info", "--without-mingle", "--without-gossip"],
                          _env(settings, amqp_vhost, pg_url), log, ROOT)
    app = Celery("amqp-test", set_as_current=False)
    app.conf.update(build(s))
    try:
        wait_until(lambda: worker.poll() is None and "ready." in log_path.read_text(errors="replace"),
                   timeout=60, interval=0.2, what="the worker ready")
        types = amqp_vhost.queue_types()
        assert {q: types.get(q) for q in QUEUES} == {q: "quorum" for q in QUEUES}, types
        rows = {ln.split("\t")[0]: ln.split("\t")[1:] for ln in
                ctl("list_queues", "-p", amqp_vhost.name, "--no-table-headers", "name", "durable",
                    "arguments").splitlines() if ln.strip()}
        for name in QUEUES:
            durable, arguments = rows[name]
            assert durable == "true" and f'{{"x-delivery-limit",{AMQP_DELIVERY_LIMIT}}}' in arguments, rows[name]
        with app.connection_for_write() as conn:  # kombu's passive declare sees them, with their consumer
            for name in QUEUES:
                got = Queue(name, channel=conn.default_channel).queue_declare(passive=True)
                assert got.queue == name and got.consumer_count == (name in ("promote", "checks")), got
        assert any(q.startswith("celery_delayed_") for q in types), types  # native delayed delivery is set up

        now = app.send_task("magpie.promote")
        wait_until(lambda: f"Task magpie.promote[{now.id}] succeeded" in log_path.read_text(errors="replace"),
                   timeout=30, interval=0.1, what="the promote task run through the quorum queue")

        sent = time.time()
        later = app.send_task("magpie.promote", countdown=2)
        wait_until(lambda: f"Task magpie.promote[{later.id}] succeeded" in log_path.read_text(errors="replace"),
                   timeout=30, interval=0.1, what="the countdown task run")
        got = _received_at(log_path, later.id)
        # the broker held it: the worker saw it only once the delay had passed (1 s of log-stamp slack)
        assert got is not None and got >= sent + 1.0, (sent, got)
    finally:
        stop_group(worker)
        log.close()
        app.close()
    text = log_path.read_text(errors="replace")
    assert "Failed to bind" not in text and "delayed delivery" not in text.lower(), text[-3000:]
    assert "guest:guest" not in text and "amqp://guest:**@" in text, text[:2000]


def test_an_amqp_password_never_reaches_health_output_or_json_logs(amqp_vhost, monkeypatch):
    """A refused login (wrong password) shows in ``magpie health`` and in JSON logs with the password masked."""
    import subprocess
    import sys

    canary = "Canary-amqp-s3cr3t"
    url = amqp_vhost.url.replace("guest:guest@", f"guest:{canary}@")
    env = {**os.environ, "MAGPIE_BROKER_URL": url, "MAGPIE_BROKER_KEY_PREFIX": "", "MAGPIE_LOG_FORMAT": "json"}
    done = subprocess.run([sys.executable, "-m", "magpie", "health", "--json", "--timeout", "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert '"broker"' in done.stdout and "ACCESS_REFUSED" in done.stdout, done.stdout[-2000:]
    assert canary not in done.stdout + done.stderr

    import logging

    from magpie.observability.logs import JsonFormatter

    # a worker's JSON log masks the broker URL's password even where a message repeats it bare
    monkeypatch.setenv("MAGPIE_BROKER_URL", url)
    rec = logging.LogRecord("kombu", logging.ERROR, __file__, 1, "cannot connect to %s (password %s)",
                            (url, canary), None)
    line = JsonFormatter().format(rec)
    assert canary not in line and "guest:***@" in line, line
