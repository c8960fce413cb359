"""A small pool of worker threads sharing one "claim, send, record" step.

The step is usually :meth:`magpie.claims.table.ClaimTable.process_one` bound to one table and sender.

Each thread calls ``step()`` in a loop; ``step`` claims at most one row (its own database connection from
the engine's pool), sends it and records the outcome, returning an outcome label, or ``None`` when nothing
was due. In drain mode a thread stops at the first ``None``; with ``poll_s`` it sleeps and polls again until
``stop`` is set (the long-running ``magpie alerts deliver`` / ``magpie outbox work`` loops).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

log = logging.getLogger(__name__)


def run_workers(
    n: int,
    step: Callable[[], str | None],
    *,
    budget_s: float | None = None,
    stop: threading.Event | None = None,
    poll_s: float | None = None,
    name: str = "delivery",
) -> Counter:
    """Run ``n`` threads calling ``step`` until each finds nothing due (or the budget/stop ends them).

    Args:
        n: number of threads (>= 1).
        step: one unit of work; returns an outcome label (counted) or ``None`` when nothing was due.
            An exception is logged and counted as ``"error"``; the thread then stops (drain mode) or
            pauses ``poll_s`` seconds (polling mode).
        budget_s: stop starting new steps after this many seconds (``None``: no limit).
        stop: set it to end the workers at their next step boundary.
        poll_s: ``None`` for drain mode; else seconds to wait before polling again when idle.
        name: thread name prefix.
    Returns:
        A :class:`collections.Counter` of outcome labels over all threads.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    stop = stop or threading.Event()
    deadline = None if budget_s is None else time.monotonic() + budget_s
    totals: Counter = Counter()
    lock = threading.Lock()

    def loop() -> None:
        local: Counter = Counter()
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            try:
                outcome = step()
            except Exception:  # noqa: BLE001 - a worker survives one bad step
                log.exception("%s worker step failed", name)
                local["error"] += 1
                if poll_s is None:
                    break
                stop.wait(poll_s)
                continue
            if outcome is None:
                if poll_s is None:
                    break
                stop.wait(poll_s)
                continue
            local[outcome] += 1
        with lock:
            totals.update(local)

    threads = [threading.Thread(target=loop, name=f"{name}-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return totals
