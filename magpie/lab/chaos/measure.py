"""What a fault scenario measures, read from the stores themselves (never from the processes' own reports).

- **Results** are the results stream's entries (one per completed cycle, appended by ``complete.lua`` in the
  same step as the completion; the stream id's time is the Redis clock at completion) and the
  ``check_history`` rows ingested from them (each row names its stream id).
- **Double completions**: a completion schedules the route's next due time at least one interval after
  itself, so two results of one route less than an interval apart (stream clock) mean one cycle was
  completed twice: a late write of a stale holder took effect, or a duplicate.
- **Results lost**: stream entries with no ``check_history`` row once ingestion has drained (entries in the
  stats dead-letter stream count as lost: nothing ingests them unless an operator redrives them).
- **Routes lost**: routes PostgreSQL owns that the schedule holds neither scheduled, leased nor
  dead-lettered.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import sqlalchemy as sa

from magpie.queue.partitions import is_tagged, layout_key, stream_pairs
from magpie.queue.streams import GROUP, ledger_id, stream_space, tagged_for


@dataclass
class Result:
    """One results-stream entry: ``at_ms`` (stream clock), ``route_hash``, ``route_id``, ``alive``."""

    stream_id: str
    at_ms: int
    route_hash: str
    route_id: int
    alive: bool


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def pairs_of(r, prefix: str) -> list[tuple[str, str]]:
    """``[(results stream, dead-letter stream)]`` of the schedule stored under ``prefix``: one per partition
    of the partition count recorded in Redis (one, untagged, when none is)."""
    raw = r.get(layout_key(prefix))
    n = int(_s(raw)) if raw else 1
    cluster = tagged_for(r)
    return stream_pairs(prefix, n, is_tagged(n, cluster), cluster)


def stream_results(r, prefix: str) -> list[Result]:
    """Every entry of every results stream (one per partition), oldest first; ``stream_id`` is the id the
    ledger and ``check_history`` record (:func:`magpie.queue.streams.ledger_id`)."""
    out = []
    for key, _ in pairs_of(r, prefix):
        space = stream_space(key)
        last = "-"
        while True:
            rows = r.xrange(key, min=last, max="+", count=5000)
            if last != "-":
                rows = rows[1:]
            if not rows:
                break
            for sid, f in rows:
                f = {_s(k): _s(v) for k, v in f.items()}
                sid = _s(sid)
                out.append(Result(ledger_id(sid, space), int(sid.split("-")[0]), f.get("route_hash", ""),
                                  int(f.get("route_id") or 0), f.get("alive") == "1"))
            last = _s(rows[-1][0])
    out.sort(key=lambda res: res.at_ms)
    return out


def wait_drained(r, prefix: str, timeout: float = 60.0) -> bool:
    """Wait until the stats consumer group has read every entry and acknowledged all of them; True when
    drained within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_drained(r, key) for key, _ in pairs_of(r, prefix)):
            return True
        time.sleep(0.5)
    return False


def _drained(r, key: str) -> bool:
    try:
        groups = {_s(g["name"]): g for g in r.xinfo_groups(key)}
        info = r.xinfo_stream(key)
    except Exception:  # noqa: BLE001 - no stream or group yet
        return not r.exists(key)
    g = groups.get(GROUP)
    last = _s(info.get("last-generated-id", b"0-0"))
    return (g is not None and g["pending"] == 0 and _s(g["last-delivered-id"]) == last) or (
        g is None and info.get("length") == 0)


def history_ids(engine) -> list[str]:
    """``check_history.stream_id`` of every row (duplicates kept)."""
    with engine.connect() as c:
        return [row[0] for row in c.execute(sa.text("SELECT stream_id FROM check_history"))]


def double_completions(results: list[Result], interval_ms: float, since_ms: int = 0,
                       tolerance_ms: float = 50.0) -> int:
    """Pairs of consecutive results of one route less than ``interval_ms - tolerance_ms`` apart, the later
    one at or after ``since_ms``."""
    last: dict[str, int] = {}
    n = 0
    for res in results:
        prev = last.get(res.route_hash)
        if prev is not None and res.at_ms >= since_ms and res.at_ms - prev < interval_ms - tolerance_ms:
            n += 1
        last[res.route_hash] = res.at_ms
    return n


def result_accounting(stack, interval_ms: float, since_ms: int = 0) -> dict[str, int]:
    """Results published, stored, lost and duplicated, after waiting for ingestion to drain.

    Returns ``{"published", "stored", "results_lost", "duplicated", "stats_dead_lettered", "drained"}``:
    ``duplicated`` counts history rows sharing a stream id plus double completions
    (:func:`double_completions`)."""
    prefix = stack.settings().redis_prefix
    drained = wait_drained(stack.r, prefix)
    results = stream_results(stack.r, prefix)
    ids = history_ids(stack.engine)
    stored = set(ids)
    published = {res.stream_id for res in results}
    return {
        "published": len(published),
        "stored": len(stored & published),
        "results_lost": len(published - stored),
        "duplicated": (len(ids) - len(stored)) + double_completions(results, interval_ms, since_ms),
        "stats_dead_lettered": sum(int(stack.r.xlen(d)) for _, d in pairs_of(stack.r, prefix)),
        "drained": int(drained),
    }


def route_kinds(stack) -> dict[str, str]:
    """route hash -> lab kind (``echo``, ``slow``, ``trickle``, ... or ``other``) of every stored route."""
    by_host = {addr.rsplit(":", 1)[0]: kind for kind, addr in stack.lab.addresses.items()}
    by_host.update(stack.extra_kinds)
    with stack.engine.connect() as c:
        rows = c.execute(sa.text("SELECT route_hash, host, port FROM routes")).all()
    return {h.strip(): by_host.get(f"{host}:{port}", by_host.get(host, "other")) for h, host, port in rows}


def schedule_members(stack) -> tuple[set[str], set[str]]:
    """(members of every shard, dead-lettered members) of the Redis schedule now (read from its keys: the
    lab's Redis scenarios inspect the layout itself)."""
    from magpie.queue.keys import QueueKeys
    from magpie.queue.partitions import partition_names

    s = stack.settings()
    members: set[str] = set()
    dead: set[str] = set()
    for name in partition_names(int(getattr(s, "schedule_partitions", 1) or 1)):
        keys = QueueKeys(s.redis_prefix, s.queue_shards, name)
        for shard in keys.all_shards():
            members.update(_s(m) for m in stack.r.zrange(shard, 0, -1))
        dead |= {_s(m) for m in stack.r.zrange(keys.dead, 0, -1)}
    return members, dead


def route_accounting(stack, healthy: set[str] | None = None) -> dict[str, int]:
    """``{"routes", "lost", "dead_lettered", "healthy_dead_lettered"}``: ``lost`` counts stored routes
    the schedule holds nowhere; ``healthy`` (route hashes, default all) are the routes that must never
    be dead-lettered."""
    kinds = route_kinds(stack)
    members, dead = schedule_members(stack)
    healthy = set(kinds) if healthy is None else healthy
    return {
        "routes": len(kinds),
        "lost": len(set(kinds) - members - dead),
        "dead_lettered": len(dead),
        "healthy_dead_lettered": len(dead & healthy),
    }


def checked_since(results: list[Result], since_ms: int) -> set[str]:
    """Route hashes with a result at or after ``since_ms``."""
    return {res.route_hash for res in results if res.at_ms >= since_ms}


def per_route_counts(results: list[Result], start_ms: int, end_ms: int) -> dict[str, int]:
    """route hash -> results in ``[start_ms, end_ms)``."""
    out: dict[str, int] = defaultdict(int)
    for res in results:
        if start_ms <= res.at_ms < end_ms:
            out[res.route_hash] += 1
    return out


def redis_ms(r) -> int:
    """The Redis server clock in Unix ms (the clock of every score and stream id; on a cluster a random
    node's, all on this machine's clock)."""
    from magpie.base.redisconn import server_time

    sec, usec = server_time(r)
    return sec * 1000 + usec // 1000
