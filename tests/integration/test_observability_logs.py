"""``MAGPIE_LOG_FORMAT=json``: the formatter (fields, extras, tracebacks, redaction), real Celery worker and
beat processes writing only JSON log lines, and the command line."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import TimedOut, spawn_celery, stop_group, wait_until

from magpie.observability.logs import JsonFormatter

ROOT = Path(__file__).resolve().parents[2]
DB_PASSWORD = "pg-passw0rd-in-url"
SHUTDOWN = re.compile(r"^worker: (Warm|Cold) shutdown \(MainProcess\)$")


def _record(msg, *args, exc_info=None, **extra) -> logging.LogRecord:
    rec = logging.getLogger("magpie.test").makeRecord("magpie.test", logging.WARNING, __file__, 1, msg, args,
                                                      exc_info, extra=extra)
    return rec


def test_json_formatter_fields_extras_traceback_and_redaction():
    fmt = JsonFormatter(secrets=["the-encryption-key-value"])
    line = fmt.format(_record("routes %d via %s", 3, "http://user:hunter22@proxy.example:8080",
                              workspace="acme", obj=object()))
    out = json.loads(line)
    assert out["level"] == "WARNING" and out["logger"] == "magpie.test" and out["ts"].endswith("Z")
    assert out["message"] == "routes 3 via http://user:***@proxy.example:8080"
    assert out["workspace"] == "acme" and out["obj"].startswith("<object")
    assert out["pid"] == os.getpid() and "task_id" not in out
    try:
        raise ValueError("key the-encryption-key-value leaked")
    except ValueError:
        line = fmt.format(_record("failed", exc_info=sys.exc_info()))
    out = json.loads(line)
    assert "ValueError" in out["exc"] and "the-encryption-key-value" not in line and "***" in out["exc"]
    assert "\n" not in line


def test_json_formatter_masks_secret_settings_of_the_environment(monkeypatch):
    monkeypatch.setenv("PROXY_ENCRYPTION_KEY", "env-key-0123456789-secret")
    monkeypatch.setenv("MAGPIE_DATABASE_URL", f"postgresql://u:{DB_PASSWORD}@db/x")
    line = JsonFormatter().format(_record("key env-key-0123456789-secret and %s", DB_PASSWORD))
    assert "env-key-0123456789-secret" not in line and DB_PASSWORD not in line


def test_cli_logs_json_lines_and_refuses_an_unknown_format(tmp_path):
    env = dict(os.environ, MAGPIE_LOG_FORMAT="json", MAGPIE_REDIS_URL="redis://127.0.0.1:1/0",
               PROXY_ENCRYPTION_KEY="test-key-0123456789abcdef")
    code = ("import logging, sys; from magpie.observability.logs import setup_cli_logging; setup_cli_logging(); "
            "logging.getLogger('magpie.x').warning('hello %s', 'redis://:pw12345678@h/0')")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    out = json.loads(res.stderr.strip())
    assert out["message"] == "hello redis://:***@h/0" and out["level"] == "WARNING"
    env["MAGPIE_LOG_FORMAT"] = "xml"
    res = subprocess.run([sys.executable, "-m", "magpie", "status"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "MAGPIE_LOG_FORMAT" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_worker_and_beat_write_json_lines_without_secrets(settings, db, pg_url, redis_prefix, tmp_path):
    secret_url = pg_url  # trust auth: the password is accepted and ignored by the server
    head, rest = secret_url.split("://", 1)
    secret_url = f"{head}://postgres:{DB_PASSWORD}@{rest.split('@', 1)[1]}"
    env = dict(os.environ)
    env.update({
        "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": redis_prefix,
        "MAGPIE_BROKER_URL": settings.redis_url, "MAGPIE_BROKER_KEY_PREFIX": redis_prefix + "broker:",
        "MAGPIE_DATABASE_URL": secret_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
        "MAGPIE_LOG_FORMAT": "json",
    })
    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "beat")}
    files = {name: open(path, "w") for name, path in logs.items()}
    procs = [
        spawn_celery(["--quiet", "worker", "-Q", "stats", "-n", f"logs-{redis_prefix}@%h", "--pool=solo",
                      "--loglevel=info", "--without-mingle", "--without-gossip"], env, files["worker"], ROOT),
        spawn_celery(["--quiet", "beat", "--loglevel=info", f"--schedule={tmp_path / 'beat'}"], env,
                     files["beat"], ROOT),
    ]
    try:
        def ran():
            assert all(p.poll() is None for p in procs), {n: p.read_text()[-2000:] for n, p in logs.items()}
            beat = logs["beat"].read_text()
            return "succeeded" in logs["worker"].read_text() and "Sending due task" in beat

        try:
            wait_until(ran, timeout=40, interval=0.25, what="a task run and a beat send")
        except TimedOut:
            pass  # the assertions below show the logs
    finally:
        stoppers = [threading.Thread(target=stop_group, args=(p,)) for p in procs]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        for f in files.values():
            f.close()
    parsed = {}
    for name, path in logs.items():
        text = path.read_text()
        assert DB_PASSWORD not in text and settings.encryption_key not in text
        # Celery prints its shutdown notice itself (not a log record); every other line is a log record
        lines = [ln for ln in text.splitlines() if ln.strip() and not SHUTDOWN.match(ln)]
        assert lines, f"{name} wrote nothing"
        parsed[name] = [json.loads(ln) for ln in lines]  # every line is one JSON object
        assert all({"ts", "level", "logger", "message"} <= set(o) for o in parsed[name])
    assert any("Sending due task" in o["message"] for o in parsed["beat"])
    succeeded = [o for o in parsed["worker"] if "succeeded" in o["message"]]
    assert succeeded
    assert all(o.get("task_name") == "magpie.ingest_stats" and o.get("task_id") for o in succeeded)
