"""Small helpers shared by test modules (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import threading
from typing import Callable


def run_concurrently(fn: Callable[[], object], threads: int) -> tuple[list, list]:
    """Run ``fn`` in ``threads`` threads at once; returns (results, exceptions) once all have finished."""
    results, errors = [], []

    def run():
        try:
            results.append(fn())
        except Exception as exc:  # noqa: BLE001 - the caller asserts on it
            errors.append(exc)

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results, errors


def spawn_celery(args: list[str], env: dict, log, cwd) -> "subprocess.Popen":
    """Start ``celery -A magpie <args>`` in its own process group (so :func:`stop_group` reaches its pool
    children), output to ``log``."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "celery", "-A", "magpie", *args], cwd=cwd, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_group(proc) -> None:
    """SIGTERM the process group ``proc`` leads (only ours: started with a new session); SIGKILL after 20 s."""
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def checked_until(procs, db, settings, log_path, stop: Callable, workspace: str = "e2e", rounds: int = 2,
                  timeout: float = 60.0) -> list[dict]:
    """Poll the latest health of ``workspace`` once a second until every route was checked ``rounds`` times
    (or ``timeout`` seconds pass), failing at once if a process of ``procs`` exits; then ``stop`` each
    process. Returns the last rows read (:func:`magpie.db.repo.latest_health`)."""
    import time

    from magpie.crypto import get_keyring
    from magpie.db.repo import latest_health

    rows: list[dict] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(1)
            assert all(p.poll() is None for p in procs), log_path.read_text()[-3000:]
            rows = latest_health(db, workspace, keyring=get_keyring(settings.encryption_key))
            if rows and all((r["checks_total"] or 0) >= rounds for r in rows):
                break
    finally:
        for p in procs:
            stop(p)
    return rows


def append_entries(redis, prefix: str, entries) -> list[str]:
    """Append result entries (field dicts) to the results stream of ``prefix`` with plain ``XADD`` (one
    pipeline), unbounded: for tests of the readers. Check workers append through the schedule's
    completion, which applies the bound and the overflow policy. Returns the new stream ids."""
    from magpie.stats.keys import stream_key

    pipe = redis.pipeline(transaction=False)
    for fields in entries:
        pipe.xadd(stream_key(prefix), fields)
    return [i.decode() if isinstance(i, bytes) else i for i in pipe.execute()]
