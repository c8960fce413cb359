"""The deployment's one quarantine slot: at most one quarantined check runs anywhere at a time.

A route in quarantine (:attr:`magpie.queue.Lease.alone`) has stalled twice in a row; its next stall counts
toward a dead letter only if it was its own. One check per process is not alone enough: a crash can take
a whole worker (every pool process) down, so two quarantined checks in two processes of one worker would
blame each other. The check pool therefore takes this slot (``SET NX PX`` on ``<prefix>quarantine_slot``)
before it starts a quarantined check and gives it back after; a holder that dies frees it when its TTL
(the check's longest time) runs out. Quarantine is rare (routes that crashed their process twice in a
row), so serialising it costs little.
"""

from __future__ import annotations

import redis as redis_lib

_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class QuarantineSlot:
    """The slot under ``<prefix>quarantine_slot`` on ``client``.

    Raises ``redis.RedisError`` from every call when Redis is unreachable.
    """

    def __init__(self, client: redis_lib.Redis, prefix: str):
        self.r = client
        self.key = f"{prefix}quarantine_slot"
        self._release = client.register_script(_RELEASE)

    def take(self, token: str, ttl_ms: int) -> bool:
        """Hold the slot as ``token`` for ``ttl_ms`` ms; False when another holder has it."""
        return bool(self.r.set(self.key, token, nx=True, px=max(1, int(ttl_ms))))

    def give_back(self, token: str) -> bool:
        """Free the slot if ``token`` still holds it (compare-and-delete); True when it did."""
        return bool(self._release(keys=[self.key], args=[token]))

    def holder(self) -> str | None:
        """The current holder's token, or None."""
        v = self.r.get(self.key)
        return v.decode() if isinstance(v, bytes) else v
