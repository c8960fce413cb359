"""Check capacity announced by the running check engines, so promote never claims more than they can run.

Each check-worker process's engine announces its slot count (``MAGPIE_CHECKS_PER_PROCESS``, capped by its
file-descriptor limit) every ``MAGPIE_CHECKER_HEARTBEAT`` seconds as a key with a time to live of three
heartbeats; a crashed process's slots therefore stop counting on their own, with no sweeper and no clock
shared between hosts (Redis expires the key). Promote passes ``min(MAGPIE_MAX_INFLIGHT, total slots)`` to
``pop.lua``, which counts live leases atomically, so two promote passes at once can never claim more than
the slots together. Leases waiting in the broker count as in flight: they are never claimed ahead of a
slot that could run them.
"""

from __future__ import annotations

import redis

from magpie.base import redisconn
from magpie.queue.keys import QueueKeys


class CapacityRegistry:
    """Announce and sum check-engine slots.

    Args:
        client: redis-py client of the schedule.
        keys: the schedule's :class:`QueueKeys`.
    """

    def __init__(self, client: redis.Redis, keys: QueueKeys):
        self.r = client
        self.keys = keys

    def announce(self, instance: str, slots: int, ttl_ms: int) -> None:
        """Record ``slots`` (>= 0) for engine ``instance`` for ``ttl_ms`` ms. Raises ``redis.RedisError``."""
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.keys.checker_prefix + instance, int(slots), px=int(ttl_ms))
        pipe.sadd(self.keys.checkers, instance)
        pipe.execute()

    def withdraw(self, instance: str) -> None:
        """Remove ``instance`` at once (an engine shutting down). Raises ``redis.RedisError``."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(self.keys.checker_prefix + instance)
        pipe.srem(self.keys.checkers, instance)
        pipe.execute()

    def engines(self) -> dict[str, int]:
        """Live engines: ``{instance id: slots}``; ids whose announcement expired are forgotten here."""
        ids = [m.decode() if isinstance(m, bytes) else m for m in self.r.smembers(self.keys.checkers)]
        if not ids:
            return {}
        vals = redisconn.mget(self.r, [self.keys.checker_prefix + i for i in ids])
        live, gone = {}, []
        for i, v in zip(ids, vals):
            if v is None:
                gone.append(i)
            else:
                live[i] = int(v)
        if gone:
            self.r.srem(self.keys.checkers, *gone)
        return live

    def total(self) -> int:
        """Sum of the live engines' slots (0 when no engine runs)."""
        return sum(self.engines().values())
