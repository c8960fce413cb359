"""Operator reads of the schedule, as functions of a redis client and the :class:`QueueKeys`.

None of them writes or needs the scripts, so a reader (the command line, the metrics exporter) can call
them without building a :class:`~magpie.queue.RouteQueue`; its methods of the same names delegate here.
Times are Unix ms on the clock the caller passes (the Redis server clock in production).
"""

from __future__ import annotations

import json

import redis

from magpie.queue.keys import QueueKeys, fnv1a_32
from magpie.queue.lease import is_lease_score, text


def server_time_ms(client: redis.Redis) -> int:
    """Now in Unix ms on the Redis server clock (``TIME``)."""
    s, us = client.time()
    return int(s) * 1000 + int(us) // 1000


def dead_letters(client: redis.Redis, keys: QueueKeys, limit: int = 100) -> list[dict]:
    """Dead-lettered routes, oldest first: ``[{"member", "dead_at_ms", "reason", "stalls", "claims",
    "alone"}]``: the evidence of a stall dead-letter is the counted stalls, the stalled claims of started
    leases since the last completion, and whether the route was checked alone (quarantine)."""
    rows = client.zrange(keys.dead, 0, limit - 1, withscores=True)
    infos = client.hmget(keys.dead_info, [m for m, _ in rows]) if rows else []
    out = []
    for (m, sc), info in zip(rows, infos):
        d = json.loads(info) if info else {}
        out.append({"member": text(m), "dead_at_ms": int(sc), "reason": d.get("reason"),
                    "stalls": d.get("stalls"), "claims": d.get("claims"), "alone": d.get("alone")})
    return out


def inspect(client: redis.Redis, keys: QueueKeys, member: str, now_ms: int) -> dict:
    """Everything known about one route: ``{"member", "payload", "score", "state", "stalls",
    "retries", "progress", "logs", "dead"}``. ``state`` is one of ``due``, ``waiting``, ``retry``,
    ``leased``, ``lease_expired``, ``dead``, ``gone``, judged against ``now_ms`` (the schedule's clock)."""
    p = client.pipeline(transaction=False)
    p.get(keys.payload(member))
    p.zscore(keys.shard_of(member), member)
    p.hget(keys.stalls, member)
    p.hget(keys.retries, member)
    p.hget(keys.progress, member)
    p.lrange(keys.logs_prefix + member, -20, -1)
    p.zscore(keys.dead, member)
    p.hget(keys.dead_info, member)
    payload, score, stalls, retries, progress, logs, dead_at, dead_info = p.execute()
    if score is not None:
        if is_lease_score(score):
            state = "leased" if score > now_ms else "lease_expired"
        elif score % 1 == 0.25:
            state = "retry"
        else:
            state = "due" if score <= now_ms else "waiting"
    elif dead_at is not None:
        state = "dead"
    else:
        state = "gone"
    return {
        "member": member, "payload": text(payload) if payload is not None else None,
        "score": None if score is None else f"{score:.2f}", "state": state,
        "stalls": int(stalls or 0), "retries": int(retries or 0),
        "progress": text(progress) if progress is not None else None, "logs": [text(x) for x in logs],
        "dead": {"at_ms": int(dead_at), **json.loads(dead_info)} if dead_at is not None and dead_info else None,
    }


_SHARD_MEMO_MAX = 500_000  # members whose shard index is kept between calls (cleared whole when full)
_shard_memo: dict[int, dict] = {}  # shard count -> {member: shard index}


def status(client: redis.Redis, keys: QueueKeys, now_ms: int) -> dict:
    """Per-shard counts for operators (not on the hot path), as of ``now_ms`` (the schedule's clock).

    Returns ``{"now_ms", "paused", "shards": [{"shard", "scheduled", "leased", "expired_leases",
    "due_now", "next_due_ms", "oldest_lateness_s"}], "totals": {...}}``. ``leased`` counts live leases
    and ``expired_leases`` leases past expiry not yet re-claimed (from the lease index); ``due_now``
    counts every claimable member (ordinary due routes and expired leases); lateness is now_ms minus the
    oldest claimable score, in seconds.
    """
    pipe = client.pipeline(transaction=False)
    for shard in keys.all_shards():
        pipe.zcard(shard)
        pipe.zrangebyscore(shard, "-inf", now_ms, start=0, num=1, withscores=True)
        pipe.zcount(shard, "-inf", now_ms)
        pipe.zrangebyscore(shard, f"({now_ms}", "+inf", withscores=True, start=0, num=1)
    pipe.zrangebyscore(keys.leased, f"({now_ms}", "+inf")  # members only: no score pairs to convert
    pipe.zrangebyscore(keys.leased, "-inf", now_ms)
    pipe.zcard(keys.dead)
    pipe.exists(keys.paused)
    res = pipe.execute()
    live_rows, expired_rows, dead, paused = res[-4:]
    per_shard: dict[str, list[int]] = {}
    names = keys.all_shards()
    memo = _shard_memo.setdefault(keys.shards, {})
    if len(memo) > _SHARD_MEMO_MAX:
        memo.clear()
    for col, rows in ((0, live_rows), (1, expired_rows)):
        for m in rows:
            n = memo.get(m)
            if n is None:  # FNV-1a in Python costs microseconds; a lease is seen in many samples
                n = memo[m] = fnv1a_32(m if isinstance(m, bytes) else m.encode()) % keys.shards
            entry = per_shard.setdefault(names[n], [0, 0])
            entry[col] += 1
    shards = []
    for i, shard in enumerate(keys.all_shards()):
        card, oldest, due, nxt = res[4 * i: 4 * i + 4]
        live, expired = per_shard.get(shard, [0, 0])
        shards.append({
            "shard": shard, "scheduled": int(card), "leased": live, "expired_leases": expired,
            "due_now": int(due), "next_due_ms": int(nxt[0][1]) if nxt else None,
            "oldest_lateness_s": round((now_ms - oldest[0][1]) / 1000, 3) if oldest else 0.0,
        })
    totals = {
        "scheduled": sum(s["scheduled"] for s in shards),
        "leased": sum(s["leased"] for s in shards),
        "expired_leases": sum(s["expired_leases"] for s in shards),
        "due_now": sum(s["due_now"] for s in shards),
        "dead": int(dead),
        "next_due_ms": min((s["next_due_ms"] for s in shards if s["next_due_ms"]), default=None),
        "oldest_lateness_s": max((s["oldest_lateness_s"] for s in shards), default=0.0),
    }
    return {"now_ms": now_ms, "paused": bool(paused), "shards": shards, "totals": totals}
