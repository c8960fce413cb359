"""The read side of the results stream: backlog figures for status output and the metrics exporter.

Read-only; the replay floor (how far back entries may still be delivered again) is read by
:func:`magpie.stats.upkeep.replay_floor`.
"""

from __future__ import annotations

import redis as redis_lib

from magpie.stats.infra import state_from
from magpie.base.redisconn import server_time
from magpie.queue.streams import GROUP, dead_key, infra_key, stream_key, tagged_for, text


def pending_summary(redis: redis_lib.Redis, prefix: str, pairs: list[tuple[str, str]] | None = None) -> dict:
    """Backlog figures of the results stream (three round trips at most), or of every stream of ``pairs``
    (``[(results stream, dead-letter stream)]``, :func:`magpie.queue.partitions.stream_pairs`): then the
    figures are summed (``lag`` None when any stream's is unknown; ``last_delivered_id`` None) and
    ``"streams"`` lists each stream's own summary.

    Returns:
        ``{"stream": key, "length": int (entries in the stream), "pending": int (delivered, not yet
        acknowledged), "lag": int | None (entries not yet delivered to the group; None when Redis
        cannot tell, e.g. after deletions), "consumers": int, "last_delivered_id": str | None,
        "dead": int (entries in the dead-letter stream; ``magpie stats redrive`` moves them back),
        "group": bool (group exists), "infra": dict | None (ingestion backing off because the database
        refuses writes: :func:`magpie.stats.infra.read_state`'s dict; None while it writes fine)}``.
    Raises:
        redis.RedisError: Redis unavailable.
    """
    tagged = tagged_for(redis)
    one = (stream_key(prefix, tagged), dead_key(prefix, tagged))
    if pairs is not None and (len(pairs) != 1 or pairs[0] != one):
        return _summed([_one(redis, prefix, s, d) for s, d in pairs])
    return _one(redis, prefix, *one)


def _summed(each: list[dict]) -> dict:
    out = dict(each[0]) if each else {}
    out["stream"] = ",".join(e["stream"] for e in each)
    for k in ("length", "pending", "consumers", "dead"):
        out[k] = sum(e[k] for e in each)
    out["lag"] = None if any(e["lag"] is None for e in each) else sum(e["lag"] for e in each)
    out["last_delivered_id"] = None
    out["group"] = all(e["group"] for e in each)
    out["streams"] = each
    return out


def _one(redis, prefix: str, key: str, dkey: str) -> dict:
    tagged = tagged_for(redis)
    pipe = redis.pipeline(transaction=False)
    pipe.xlen(key)
    pipe.xlen(dkey)
    pipe.hgetall(infra_key(prefix, tagged))
    if not tagged:
        pipe.time()  # a cluster pipeline refuses TIME: asked apart below
    length, dead, raw_infra, *rest = pipe.execute()
    sec, usec = rest[0] if rest else server_time(redis, key)
    out = {
        "stream": key,
        "length": int(length),
        "pending": 0,
        "lag": int(length),
        "consumers": 0,
        "last_delivered_id": None,
        "dead": int(dead),
        "group": False,
        "infra": state_from(raw_infra, int(sec) * 1000 + int(usec) // 1000),
    }
    if not length and not redis.exists(key):
        return out
    for g in redis.xinfo_groups(key):
        g = {text(k): v for k, v in g.items()}
        if text(g.get("name")) != GROUP:
            continue
        lag, last = g.get("lag"), g.get("last-delivered-id")
        out.update(
            pending=int(g.get("pending") or 0),
            lag=None if lag is None else int(lag),
            consumers=int(g.get("consumers") or 0),
            last_delivered_id=None if last is None else text(last),
            group=True,
        )
    return out


__all__ = ["pending_summary"]
