"""The lease a claim hands out: the fencing token of one route's check, and its cancellation token."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Lease:
    """One claimed route, as returned by :meth:`RouteQueue.pop`.

    Attributes:
        member: route hash (the sorted-set member).
        payload: the payload text as stored at claim time (the worker's original snapshot).
        previous_score: score before the claim (due ms; ``.25`` a retry due time, ``.5`` an expired lease).
        lease_score: the fencing token, ``'<expiry ms>.50'``.
        shard: shard key the member lives in.
        stalled: True when this claim re-took an expired lease (the previous holder vanished).
        retry_attempts: backoff retries already made for this route (0 for an ordinary cycle).
        server_offset_ms: Redis server clock minus this process's clock at claim time (ms).
        alone: True when the route is in quarantine (it stalled ``max(MAGPIE_MAX_STALLED, 2)`` times since
            its last completion): it is dispatched in a message of its own and checked alone, so that a
            stall of this lease is its own (the dead-letter rule in ``docs/design.md``).
        claimed_ms: when the claim returned (Unix ms, the claiming process's clock); 0 when unknown.
        dispatched_ms: when its check message was sent (Unix ms, the dispatching process's clock); 0 when
            unknown. With the pool's own stamps (received, admitted, started) these give the lease's
            claim-to-start time (:mod:`magpie.pipeline.checkpool`); across hosts they carry the hosts' clock skew.
    The cancellation token (:meth:`cancel`, :attr:`cancelled`) is process-local and not serialised.
    """

    member: str
    payload: str
    previous_score: str
    lease_score: str
    shard: str
    stalled: bool = False
    retry_attempts: int = 0
    server_offset_ms: float = 0.0
    alone: bool = False
    claimed_ms: float = 0.0
    dispatched_ms: float = 0.0
    _token: threading.Event | None = field(default=None, repr=False, compare=False)

    @property
    def expires_at_ms(self) -> float:
        """Lease expiry on the Redis server clock (Unix ms)."""
        return float(self.lease_score) - 0.5

    def remaining_ms(self) -> float:
        """Estimated ms left on the lease, corrected by the server clock offset seen at claim time."""
        return self.expires_at_ms - (time.time() * 1000 + self.server_offset_ms)

    @property
    def cancelled(self) -> bool:
        """True once a fenced call on this lease was refused: the check should stop."""
        return self._token is not None and self._token.is_set()

    @property
    def token(self) -> threading.Event:
        """The cancellation token (an Event, created on first use) for a check to wait on."""
        if self._token is None:
            self._token = threading.Event()
        return self._token

    def cancel(self) -> None:
        """Fire the cancellation token (the schedule does so when a fenced call is refused)."""
        self.token.set()

    def to_dict(self) -> dict:
        """JSON-safe dict for a Celery message (without the cancellation token)."""
        return {"member": self.member, "payload": self.payload, "previous_score": self.previous_score,
                "lease_score": self.lease_score, "shard": self.shard, "stalled": self.stalled,
                "retry_attempts": self.retry_attempts, "server_offset_ms": self.server_offset_ms,
                "alone": self.alone, "claimed_ms": self.claimed_ms, "dispatched_ms": self.dispatched_ms}

    @classmethod
    def from_dict(cls, d: dict) -> "Lease":
        """The lease :meth:`to_dict` made (with a fresh cancellation token)."""
        return cls(**d)


def text(v) -> str:
    """A Redis reply (bytes or not) as text."""
    return v.decode() if isinstance(v, bytes) else str(v)


def is_lease_score(score: float | str | None) -> bool:
    """True when ``score`` carries the ``.5`` lease marker."""
    return score is not None and float(score) % 1 == 0.5
