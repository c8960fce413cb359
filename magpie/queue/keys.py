"""Key names of one route schedule and the shard function (docs/design.md, "The route schedule").

Every key of a schedule shares one Redis Cluster hash tag, ``{<name>}``, so a schedule can live on a single
cluster node later and several schedules on several nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

FNV_OFFSET = 0x811C9DC5
FNV_PRIME = 0x01000193


def fnv1a_32(data: bytes) -> int:
    """FNV-1a 32-bit hash of ``data`` (int in 0..2**32-1)."""
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & 0xFFFFFFFF
    return h


@dataclass(frozen=True)
class QueueKeys:
    """Key names for schedule ``name`` under ``prefix`` with ``shards`` shards (1..128).

    Raises ``ValueError`` when ``shards`` is out of range.
    """

    prefix: str
    shards: int = 16
    name: str = "default"

    def __post_init__(self):
        if not 1 <= self.shards <= 128:
            raise ValueError(f"PROXY_QUEUE_SHARDS must be within 1..128, got {self.shards}")

    @property
    def base(self) -> str:
        return f"{self.prefix}{{{self.name}}}:"

    @property
    def payload_prefix(self) -> str:
        """Prefix of payload keys; the payload of route hash ``h`` is at ``payload_prefix + h``."""
        return self.base + "proxy:"

    def payload(self, route_hash: str) -> str:
        return self.payload_prefix + route_hash

    def shard(self, n: int) -> str:
        return f"{self.base}proxy_queue:{n}"

    def shard_of(self, route_hash: str) -> str:
        """Shard key of a route: FNV-1a 32 of the hash modulo the shard count."""
        return self.shard(fnv1a_32(route_hash.encode()) % self.shards)

    def all_shards(self) -> list[str]:
        return [self.shard(n) for n in range(self.shards)]

    @property
    def heads(self) -> str:
        return self.base + "proxy_queue_heads"

    @property
    def leased(self) -> str:
        """Lease index: member -> lease score of every lease handed out and not ended. Live leases are the
        scores above now (``MAGPIE_MAX_INFLIGHT`` is checked against their count in ``pop.lua``)."""
        return self.base + "proxy_leased"

    @property
    def dead(self) -> str:
        """Dead-lettered routes: member -> time dead-lettered (Unix ms)."""
        return self.base + "proxy_dead"

    @property
    def dead_info(self) -> str:
        """Reason beside each dead-lettered route: member -> JSON ``{"reason", "stalls", "at"}``."""
        return self.base + "proxy_dead_info"

    @property
    def stalls(self) -> str:
        """Consecutive stalled claims per route (hash); cleared by a completed cycle."""
        return self.base + "proxy_stalls"

    @property
    def retries(self) -> str:
        """Backoff retries per route (hash); cleared by a completed cycle."""
        return self.base + "proxy_retries"

    @property
    def paused(self) -> str:
        """Present while the queue is paused; ``pop.lua`` claims nothing then."""
        return self.base + "proxy_paused"

    @property
    def progress(self) -> str:
        """Latest progress text per leased route (hash)."""
        return self.base + "proxy_progress"

    @property
    def logs_prefix(self) -> str:
        """Per-route log lists live at ``logs_prefix + hash`` (bounded)."""
        return self.base + "proxy_logs:"

    @property
    def layout(self) -> str:
        """The shard count this schedule was created with (``PROXY_QUEUE_SHARDS`` must keep matching it)."""
        return self.base + "proxy_layout"

    @property
    def checkers(self) -> str:
        """Set of check-engine instance ids that announced capacity (see :mod:`magpie.queue.capacity`)."""
        return self.base + "checkers"

    @property
    def checker_prefix(self) -> str:
        """``checker_prefix + id`` holds one engine's slot count, expiring unless its heartbeat renews it."""
        return self.base + "checker:"

    @property
    def cadence(self) -> str:
        """Per-route cadence state (hash): ``<m>`` own interval ms, ``<m>#r`` operator override ms,
        ``<m>#p`` dead-route policy ``after:factor``, ``<m>#d`` dead checks in a row."""
        return self.base + "proxy_cadence"

    @property
    def priority(self) -> str:
        """The priority lane (sorted set member -> due ms): imports and check-now, claimed first."""
        return self.base + "proxy_priority"

    @property
    def ws_cadence(self) -> str:
        """Workspace cadences (hash): workspace id -> ``interval_ms:dead_after:dead_factor`` (0 = unset), and
        ``p:<workspace id>`` -> the same from the workspace's check profile (it wins field by field)."""
        return self.base + "proxy_ws_cadence"

    def core(self) -> list[str]:
        """The eleven keys every script receives first, in ``lua/lib.lua`` order."""
        return [self.heads, self.leased, self.dead, self.dead_info, self.stalls, self.retries, self.paused,
                self.progress, self.cadence, self.priority, self.ws_cadence]
