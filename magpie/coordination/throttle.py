"""Throttling of failed credential checks per client address (rotator passwords, the dashboard's sign-in).

:class:`FailureThrottle` lets a client address fail ``free`` times, then blocks it with an exponential
backoff (``base_s``, doubled per further failure, at most ``cap_s``); a blocked address is refused without
its credentials being checked, so guessing runs at about one try per ``cap_s`` per address. A success
clears the address; failures older than ``window_s`` are forgotten. :class:`FailureLog` logs failures as
a rate (count, client addresses, busiest address), never the credentials tried.
"""

from __future__ import annotations

import logging
import time
from collections import Counter


class FailureThrottle:
    """Per-address failure backoff.

    Args:
        free: failures an address may make before it is blocked (>= 0).
        base_s / cap_s: first block and longest block, seconds.
        window_s: seconds after which an address's failures are forgotten (its last failure ends it).
        max_clients: addresses tracked at most (the oldest are dropped beyond it).
        clock: monotonic seconds (tests).
    """

    def __init__(self, free: int = 5, base_s: float = 1.0, cap_s: float = 300.0, window_s: float = 900.0,
                 max_clients: int = 100_000, clock=time.monotonic):
        self.free, self.base_s, self.cap_s, self.window_s = int(free), float(base_s), float(cap_s), float(window_s)
        self.max_clients = int(max_clients)
        self.clock = clock
        self._state: dict[str, tuple[int, float, float]] = {}  # address -> (failures, last failure, blocked until)

    def blocked(self, client: str) -> float:
        """Seconds ``client`` must still wait before its credentials are checked again (0.0: may try)."""
        st = self._state.get(client)
        if st is None:
            return 0.0
        now = self.clock()
        if now - st[1] > self.window_s and now >= st[2]:
            del self._state[client]
            return 0.0
        return max(0.0, st[2] - now)

    def failed(self, client: str) -> float:
        """Record a failed check of ``client``; returns the block now in force, seconds (0.0: none)."""
        now = self.clock()
        n, last, _until = self._state.pop(client, (0, now, 0.0))
        if now - last > self.window_s:
            n = 0
        n += 1
        block = 0.0 if n <= self.free else min(self.cap_s, self.base_s * 2 ** (n - self.free - 1))
        self._state[client] = (n, now, now + block)
        if len(self._state) > self.max_clients:
            for key in list(self._state)[: len(self._state) - self.max_clients]:
                del self._state[key]
        return block

    def succeeded(self, client: str) -> None:
        """Forget ``client``'s failures (a correct credential)."""
        self._state.pop(client, None)


class FailureLog:
    """Logs failed credential checks as a rate: at most one line per ``every_s`` seconds.

    Args:
        logger: where to log (level WARNING). what: the subject, e.g. ``"rotator r1: failed authentications"``.
        every_s: seconds between two lines. clock: monotonic seconds (tests).
    """

    def __init__(self, logger: logging.Logger, what: str, every_s: float = 60.0, clock=time.monotonic):
        self.logger, self.what, self.every_s, self.clock = logger, what, float(every_s), clock
        self._counts: Counter[str] = Counter()
        self._refused = 0
        self._since: float | None = None
        self._last_line = -float("inf")

    def failed(self, client: str, blocked: bool = False) -> None:
        """Count one failure of ``client`` (``blocked``: refused unchecked while blocked); may log a line."""
        now = self.clock()
        if self._since is None:
            self._since = now
        self._counts[client] += 1
        self._refused += int(blocked)
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Log the failures counted since the last line, when ``every_s`` has passed since it (or ``force``);
        nothing when there were none."""
        now = self.clock()
        if not self._counts or (not force and now - self._last_line < self.every_s):
            return
        total = sum(self._counts.values())
        span = max(now - (self._since if self._since is not None else now), 0.0)
        top, top_n = self._counts.most_common(1)[0]
        rate = f", {total / span:.1f}/s" if span >= 1.0 else ""
        self.logger.warning("%s: %d in %.0f s%s from %d client address(es) (most: %s, %d); %d refused while "
                            "blocked", self.what, total, span, rate, len(self._counts), top, top_n, self._refused)
        self._counts.clear()
        self._refused = 0
        self._since = None
        self._last_line = now


__all__ = ["FailureLog", "FailureThrottle"]
