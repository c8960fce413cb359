"""Small helpers shared by test modules (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


class TimedOut(AssertionError):
    """A polled condition did not hold before its deadline."""


def wait_until(pred: Callable[[], T], timeout: float = 15.0, interval: float = 0.05,
               what: str = "condition") -> T:
    """Poll ``pred()`` every ``interval`` seconds until it returns something truthy, and return that.

    Raises :class:`TimedOut` (an ``AssertionError``) naming ``what`` when ``timeout`` seconds pass first
    (the last value is shown). The one place tests wait: a condition with a deadline, never a bare sleep.
    """
    deadline = time.monotonic() + timeout
    got = pred()
    while not got:
        if time.monotonic() >= deadline:
            raise TimedOut(f"timed out after {timeout} s waiting for {what} (last: {got!r})")
        time.sleep(interval)
        got = pred()
    return got


async def await_until(pred: Callable[[], T], timeout: float = 15.0, interval: float = 0.02,
                      what: str = "condition") -> T:
    """:func:`wait_until` inside an event loop: polls ``pred()`` (a plain callable) without blocking it."""
    deadline = time.monotonic() + timeout
    got = pred()
    while not got:
        if time.monotonic() >= deadline:
            raise TimedOut(f"timed out after {timeout} s waiting for {what} (last: {got!r})")
        await asyncio.sleep(interval)
        got = pred()
    return got


def pending_idle(r, key: str, group: str, min_idle_ms: int) -> bool:
    """True when every pending entry of consumer group ``group`` on stream ``key`` was delivered at least
    ``min_idle_ms`` ago (what a claim with that minimum idle time takes over); poll it with
    :func:`wait_until`."""
    entries = r.xpending_range(key, group, min="-", max="+", count=10_000)
    return all(e["time_since_delivered"] >= min_idle_ms for e in entries)


def consumers_idle(r, key: str, group: str, names: list[str], min_idle_ms: int) -> bool:
    """True when each consumer of ``names`` in ``group`` on stream ``key`` has been idle (``XINFO CONSUMERS``)
    for at least ``min_idle_ms``; poll it with :func:`wait_until`."""
    idle = {c["name"].decode() if isinstance(c["name"], bytes) else c["name"]: int(c["idle"])
            for c in r.xinfo_consumers(key, group)}
    return all(idle.get(n, -1) >= min_idle_ms for n in names)


def elapse(seconds: float) -> None:
    """Let ``seconds`` of wall time pass where the passing of time IS the behaviour under test (a TTL or a
    lease running out with nobody renewing it, a quiet period). Callers say why in a comment; waiting for
    anything else uses :func:`wait_until`."""
    time.sleep(seconds)


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
    """Poll the latest health of ``workspace`` every 0.25 s until every route was checked ``rounds`` times
    (or ``timeout`` seconds pass), failing at once if a process of ``procs`` exits; then ``stop`` each
    process. Returns the last rows read (:func:`magpie.db.repo.latest_health`)."""
    from magpie.base.crypto import get_keyring
    from magpie.db.repo import latest_health

    rows: list[dict] = []
    try:
        def done():
            nonlocal rows
            assert all(p.poll() is None for p in procs), log_path.read_text()[-3000:]
            rows = latest_health(db, workspace, keyring=get_keyring(settings.encryption_key))
            return bool(rows) and all((r["checks_total"] or 0) >= rounds for r in rows)

        try:
            wait_until(done, timeout=timeout, interval=0.25,
                       what=f"every route of {workspace} checked {rounds}x")
        except TimedOut:
            pass  # the caller asserts on the rows, with the logs
    finally:
        for p in procs:
            stop(p)
    return rows


def append_entries(redis, prefix: str, entries) -> list[str]:
    """Append result entries (field dicts) to the results stream of ``prefix`` with plain ``XADD`` (one
    pipeline), unbounded: for tests of the readers. Check workers append through the schedule's
    completion, which applies the bound and the overflow policy. Returns the new stream ids."""
    from magpie.queue.streams import stream_key

    pipe = redis.pipeline(transaction=False)
    for fields in entries:
        pipe.xadd(stream_key(prefix), fields)
    return [i.decode() if isinstance(i, bytes) else i for i in pipe.execute()]


def add_history(engine, route_ids, per_route: int = 2) -> None:
    """Insert ``per_route`` ``check_history`` rows (failed checks, the last hour) for each of ``route_ids``."""
    import sqlalchemy as sa

    with engine.begin() as c:
        c.execute(sa.text(
            "INSERT INTO check_history (route_id, checked_at, alive, error) "
            "SELECT r, now() - make_interval(mins => k), false, 'timeout' "
            "FROM unnest(CAST(:ids AS bigint[])) AS r, generate_series(1, :k) AS k"),
            {"ids": [int(i) for i in route_ids], "k": per_route})


def history_by_route(engine) -> dict[int, int]:
    """``check_history`` rows per route id (only routes that have some)."""
    import sqlalchemy as sa

    with engine.connect() as c:
        return {int(r): int(n) for r, n in c.execute(sa.text(
            "SELECT route_id, count(*) FROM check_history GROUP BY route_id"))}
