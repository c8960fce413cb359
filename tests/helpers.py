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
