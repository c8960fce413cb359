"""Python face of the route schedule: thin, typed wrappers over the fenced Lua scripts in ``lua/``.

The lease score a claim returns (``expiry_ms + 0.5``, a string so the ``.5`` survives) is the fencing token:
renew, complete and remove take effect only while the stored score still equals it (DESIGN.md invariants
1-7). Scores travel as strings end to end; Python never rounds them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import redis

from magpie.queue.keys import QueueKeys
from magpie.queue.scripts import Scripts

COMPLETED, LEASE_LOST, GONE, PAYLOAD_CHANGED = 1, -1, -2, -3
_REASONS = {LEASE_LOST: "lease_lost", GONE: "gone", PAYLOAD_CHANGED: "payload_changed"}


class QueueError(RuntimeError):
    """A queue call was refused. ``code`` is one of ``lease_lost``, ``gone``, ``payload_changed``."""

    def __init__(self, code: str, member: str):
        super().__init__(f"{code}: route {member}")
        self.code = code
        self.member = member


class LeaseLost(QueueError):
    """The caller no longer holds the lease (it expired and another holder claimed the route)."""


@dataclass(slots=True)
class Lease:
    """One claimed route, as returned by :meth:`RouteQueue.pop`.

    Attributes:
        member: route hash (the sorted-set member).
        payload: the payload text as stored at claim time (the original snapshot).
        previous_score: score before the claim (due time in Unix ms, ``.5`` if an expired lease).
        lease_score: the fencing token, ``'<expiry ms>.5'``.
        shard: shard key the member lives in.
        stalled: True when this claim re-took an expired lease (the previous holder vanished).
        server_offset_ms: Redis server clock minus this process's clock at claim time (ms).
    """

    member: str
    payload: str
    previous_score: str
    lease_score: str
    shard: str
    stalled: bool = False
    server_offset_ms: float = 0.0

    @property
    def expires_at_ms(self) -> float:
        """Lease expiry on the Redis server clock (Unix ms)."""
        return float(self.lease_score) - 0.5

    def remaining_ms(self) -> float:
        """Estimated ms left on the lease, corrected by the server clock offset seen at claim time."""
        return self.expires_at_ms - (time.time() * 1000 + self.server_offset_ms)

    def to_dict(self) -> dict:
        """JSON-safe dict for a Celery message."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Lease":
        return cls(**d)


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RouteQueue:
    """The recurring route schedule of one deployment.

    Args:
        client: a redis-py client (``decode_responses`` either way).
        keys: the :class:`QueueKeys` naming the schedule.
        interval_ms: check interval in ms (next due = max(previous due, now) + interval).
        lease_ms: lease length in ms given by a claim or a renewal.
    """

    def __init__(self, client: redis.Redis, keys: QueueKeys, interval_ms: int, lease_ms: int = 300_000):
        self.r = client
        self.keys = keys
        self.interval_ms = int(interval_ms)
        self.lease_ms = int(lease_ms)
        self.scripts = Scripts(client)

    @classmethod
    def from_settings(cls, settings, client: redis.Redis | None = None) -> "RouteQueue":
        """Build from :class:`magpie.config.Settings` (interval and lease in seconds there)."""
        client = client or redis.Redis.from_url(settings.redis_url)
        return cls(
            client,
            QueueKeys(settings.redis_prefix, settings.queue_shards),
            interval_ms=int(settings.check_interval * 1000),
            lease_ms=int(settings.lease_seconds * 1000),
        )

    # -- claiming -----------------------------------------------------------------------------------
    def pop(self, count: int = 1, max_inflight: int = 0, lease_ms: int | None = None) -> list[Lease]:
        """Claim up to ``count`` due routes in due-time order across shards (``pop.lua``).

        ``max_inflight`` > 0 caps the outstanding leases (live lease index entries) after the claim.
        Returns the leases (possibly empty). Expired leases are re-claimed here (``stalled=True``).
        """
        k = self.keys
        local_before = time.time() * 1000
        raw = self.scripts.pop(
            keys=[k.heads, k.leased],
            args=[int(count), int(lease_ms or self.lease_ms), k.payload_prefix, int(max_inflight)],
        )
        local_after = time.time() * 1000
        offset = float(_s(raw[0])) - (local_before + local_after) / 2
        return [
            Lease(_s(m), _s(p), _s(prev), _s(lease), _s(shard), bool(int(st)), offset)
            for m, p, prev, lease, shard, st in raw[2:]
        ]

    def renew(self, lease: Lease, lease_ms: int | None = None) -> Lease:
        """Extend ``lease`` (``renew.lua``); returns it with its new ``lease_score``.

        Raises :class:`LeaseLost` when the score moved on (stale holder), :class:`QueueError` ``gone``
        when the route was removed.
        """
        k = self.keys
        res = self.scripts.renew(
            keys=[lease.shard, k.heads, k.leased],
            args=[lease.member, lease.lease_score, int(lease_ms or self.lease_ms)],
        )
        if isinstance(res, int):
            raise (LeaseLost if res == LEASE_LOST else QueueError)(_REASONS[res], lease.member)
        lease.lease_score = _s(res)
        return lease

    def complete(self, leases: Sequence[Lease], interval_ms: int | None = None) -> list[int]:
        """Finish the cycles of ``leases`` in one script call (``complete.lua``); writes no payload.

        Returns one code per lease: 1 completed, -1 lease lost (stale, nothing changed), -2 gone.
        """
        if not leases:
            return []
        k = self.keys
        args: list = [int(interval_ms or self.interval_ms)]
        for le in leases:
            args += [le.member, le.lease_score]
        args += [le.previous_score for le in leases]
        return [int(x) for x in self.scripts.complete(keys=[k.heads, k.leased] + [le.shard for le in leases],
                                                      args=args)]

    def complete_one(self, lease: Lease) -> None:
        """Complete a single lease; raises :class:`LeaseLost` / :class:`QueueError` when refused."""
        code = self.complete([lease])[0]
        if code != COMPLETED:
            raise (LeaseLost if code == LEASE_LOST else QueueError)(_REASONS[code], lease.member)

    def remove(self, lease: Lease) -> None:
        """Delete a leased route (``remove.lua``), fenced on the lease score and the original payload.

        Raises :class:`LeaseLost` (stale holder), :class:`QueueError` ``gone`` or ``payload_changed``
        (a concurrent import changed the payload after the claim; nothing is removed).
        """
        k = self.keys
        res = int(self.scripts.remove(
            keys=[lease.shard, k.heads, k.leased, k.payload(lease.member)],
            args=[lease.member, lease.lease_score, lease.payload],
        ))
        if res != COMPLETED:
            raise (LeaseLost if res == LEASE_LOST else QueueError)(_REASONS[res], lease.member)

    # -- import -------------------------------------------------------------------------------------
    def schedule(self, items: Iterable[tuple[str, str]], total: int | None = None, start_index: int = 0,
                 batch: int = 500) -> dict[str, int]:
        """Add routes to the schedule (``schedule.lua``), first due times spread over the interval.

        Args:
            items: ``(route_hash, payload_text)`` pairs; payload text as :meth:`Payload.encode` makes it.
            total: number of routes the spread is computed over (default: ``len(items)``).
            start_index: index of the first item within that spread (for chunked imports).
        Route i of ``total`` becomes due at now + i * interval / total. A route already stored keeps its
        due time; only the new payload's workspace ids are merged into the stored one.
        Returns ``{"new": n, "merged": n, "unchanged": n}``.
        """
        items = list(items)
        total = total or len(items) or 1
        step = self.interval_ms / total
        k = self.keys
        counts = {"new": 0, "merged": 0, "unchanged": 0}
        pipe = self.r.pipeline(transaction=False)
        for off in range(0, len(items), batch):
            chunk = items[off: off + batch]
            args: list = [k.payload_prefix]
            for j, (h, payload) in enumerate(chunk):
                args += [h, payload, int((start_index + off + j) * step)]
            self.scripts.schedule(keys=[k.heads, k.dead] + [k.shard_of(h) for h, _ in chunk], args=args,
                                  client=pipe)
        for res in pipe.execute():
            for name, v in zip(("new", "merged", "unchanged"), res):
                counts[name] += int(v)
        return counts

    # -- reads --------------------------------------------------------------------------------------
    def server_time_ms(self) -> int:
        """Redis server clock in Unix ms."""
        s, us = self.r.time()
        return int(s) * 1000 + int(us) // 1000

    def score(self, member: str) -> str | None:
        """Current score of a route as a '%.1f'-style string, or None when not scheduled."""
        v = self.r.zscore(self.keys.shard_of(member), member)
        return None if v is None else f"{v:.1f}"

    def payload(self, member: str) -> str | None:
        v = self.r.get(self.keys.payload(member))
        return None if v is None else _s(v)

    def status(self) -> dict:
        """Per-shard counts for operators (not on the hot path; reads each shard's lease window).

        Returns ``{"now_ms", "shards": [{"shard", "scheduled", "leased", "expired_leases", "due_now",
        "next_due_ms", "oldest_lateness_s"}], "totals": {...}}``. ``due_now`` counts ordinary due routes
        and expired leases (both claimable); lateness is now minus the oldest claimable score, in seconds.
        """
        now = self.server_time_ms()
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        for shard in k.all_shards():
            pipe.zcard(shard)
            pipe.zrangebyscore(shard, "-inf", now, start=0, num=1, withscores=True)
            pipe.zcount(shard, "-inf", now)
            pipe.zrangebyscore(shard, f"({now}", "+inf", withscores=True, start=0, num=1)
        res = pipe.execute()
        lease_rows = self.r.zrangebyscore(k.leased, "-inf", "+inf", withscores=True)
        leased_by_shard: dict[str, list[int]] = {}
        for m, sc in lease_rows:
            entry = leased_by_shard.setdefault(k.shard_of(_s(m)), [0, 0])
            entry[0 if sc > now else 1] += 1
        shards = []
        for i, shard in enumerate(k.all_shards()):
            card, oldest, due, nxt = res[4 * i: 4 * i + 4]
            live, expired = leased_by_shard.get(shard, [0, 0])
            shards.append({
                "shard": shard, "scheduled": int(card), "leased": live, "expired_leases": expired,
                "due_now": int(due),
                "next_due_ms": int(nxt[0][1]) if nxt else None,
                "oldest_lateness_s": round((now - oldest[0][1]) / 1000, 3) if oldest else 0.0,
            })
        totals = {
            "scheduled": sum(s["scheduled"] for s in shards),
            "leased": sum(s["leased"] for s in shards),
            "expired_leases": sum(s["expired_leases"] for s in shards),
            "due_now": sum(s["due_now"] for s in shards),
            "dead": int(self.r.zcard(k.dead)),
            "next_due_ms": min((s["next_due_ms"] for s in shards if s["next_due_ms"]), default=None),
            "oldest_lateness_s": max((s["oldest_lateness_s"] for s in shards), default=0.0),
        }
        return {"now_ms": now, "shards": shards, "totals": totals}
