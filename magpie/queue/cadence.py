"""Per-route cadence on the Redis schedule: a route's own interval and the dead-route policy.

State (``lua/lib.lua``): ``proxy_ws_cadence`` maps a workspace id to ``interval_ms:dead_after:dead_factor``
(0 = not set), and ``p:<workspace id>`` to the same from the workspace's check profile; ``proxy_cadence`` holds each affected route's own interval (``<m>``), an operator's
override (``<m>#r``), its dead-route policy (``<m>#p``) and its dead streak (``<m>#d``). ``complete.lua``
reads that hash only while it holds anything, so a deployment without cadences pays one ``EXISTS`` per
completion call. A change walks only the routes it affects (:func:`walk_workspace`, resumable) and moves
a route due later than now + its new interval into that interval (``lua/cadence.lua``).

Precedence of a route's interval: the operator's override (``magpie queue set-interval``), then the
shortest over its workspaces of each one's profile interval (``magpie profiles set --interval``) or else
its workspace interval (``magpie workspaces set-interval``), then ``MAGPIE_CHECK_INTERVAL``. The dead-route
policy: per workspace the profile's, else the workspace's; the smallest factor over the route's
workspaces; else ``MAGPIE_DEAD_BACKOFF_AFTER`` / ``MAGPIE_DEAD_BACKOFF_FACTOR``.
"""

from __future__ import annotations

import re
from typing import Callable

from magpie.errors import Refusal
from magpie.queue.lease import text as _s
from magpie.queue.refusals import QueueError

_W = re.compile(r'"w":\[([\d,]*)\]\}$')


def _apply(queue, members: list[str], mode: str, override_ms: int = 0) -> list:
    k = queue.keys
    return queue.scripts.cadence(keys=queue._core + [k.shard_of(m) for m in members], args=[
        queue._now(), k.payload_prefix, mode, int(override_ms), int(queue.interval_ms), *members])


def set_route_interval(queue, member: str, interval_ms: int | None) -> dict:
    """Give route ``member`` its own interval (``interval_ms``) or clear it (None: back to its workspaces'
    cadence or the deployment's interval).

    Returns ``{"member", "interval_ms" (the route's interval now), "due_ms"}``. Raises ``ValueError`` for an
    interval under 1 s, :class:`QueueError` ``gone`` when the route is not scheduled (dead-lettered
    included).
    """
    if interval_ms is not None and int(interval_ms) < 1000:
        raise ValueError(f"interval must be at least 1s, got {interval_ms} ms")
    moved, iv, due = _apply(queue, [member], "clear" if interval_ms is None else "set", interval_ms or 0)
    if not _s(due):
        raise QueueError(Refusal.GONE, member)
    return {"member": member, "interval_ms": int(iv), "due_ms": int(float(_s(due))), "moved": int(moved)}


def route_cadence(queue, member: str) -> dict:
    """The cadence fields of one route: ``{"interval_ms", "override_ms", "policy", "dead_streak"}``
    (None where unset)."""
    holder = getattr(queue, "holder", None)
    if holder is not None:  # the partitioned schedule: the partition holding the route
        queue = holder(member)
    iv, over, pol, streak = queue.r.hmget(queue.keys.cadence, [member, f"{member}#r", f"{member}#p", f"{member}#d"])
    return {"interval_ms": int(iv) if iv else None, "override_ms": int(over) if over else None,
            "policy": _s(pol) if pol else None, "dead_streak": int(streak) if streak else 0}


def _read(queue, field: str) -> dict | None:
    first = (getattr(queue, "parts", None) or [queue])[0]  # every partition holds the same copy
    raw = first.r.hget(first.keys.ws_cadence, field)
    if raw is None:
        return None
    iv, after, factor = (int(x) for x in _s(raw).split(":"))
    return {"interval_ms": iv, "dead_after": after, "dead_factor": factor}


def workspace_cadence(queue, workspace_id: int) -> dict | None:
    """``{"interval_ms", "dead_after", "dead_factor"}`` set for a workspace (0 = unset), or None."""
    return _read(queue, str(int(workspace_id)))


def profile_cadence(queue, workspace_id: int) -> dict | None:
    """``{"interval_ms", "dead_after", "dead_factor"}`` the workspace's check profile sets (0 = unset), or
    None when it sets none."""
    return _read(queue, f"p:{int(workspace_id)}")


def _validate(interval_ms: int, dead_after: int, dead_factor: int) -> None:
    if interval_ms and int(interval_ms) < 1000:
        raise ValueError(f"interval must be at least 1s, got {interval_ms} ms")
    if dead_after < 0 or (dead_after and dead_factor < 2):
        raise ValueError("a dead-route policy needs --dead-after >= 1 and --dead-factor >= 2")


def _store(queue, field: str, interval_ms: int, dead_after: int, dead_factor: int) -> None:
    for part in getattr(queue, "parts", None) or [queue]:  # every partition's setting before any walk
        if not (interval_ms or dead_after):
            part.r.hdel(part.keys.ws_cadence, field)
        else:
            part.r.hset(part.keys.ws_cadence, field, f"{int(interval_ms)}:{int(dead_after)}:{int(dead_factor)}")


def set_workspace_cadence(queue, workspace_id: int, *, interval_ms: int = 0, dead_after: int = 0,
                          dead_factor: int = 0, batch: int = 500,
                          progress: Callable[[dict], object] | None = None) -> dict:
    """Set (or, all zero, clear) workspace ``workspace_id``'s cadence and walk its routes.

    Args:
        interval_ms: the workspace's check interval (0: the deployment's; at least 1,000 otherwise).
        dead_after / dead_factor: dead-route policy: after ``dead_after`` dead checks in a row a route
            waits ``dead_factor`` x its interval until alive (0: the deployment's default policy).
        batch: routes per ZSCAN step. progress: called with the walk's counts after each step.
    Returns the walk's counts (:func:`walk_workspace`). Raises ``ValueError`` for out-of-range values.
    """
    _validate(interval_ms, dead_after, dead_factor)
    _store(queue, str(int(workspace_id)), interval_ms, dead_after, dead_factor)
    return walk_workspace(queue, workspace_id, batch=batch, progress=progress)


def set_profile_cadence(queue, workspace_id: int, *, interval_ms: int = 0, dead_after: int = 0,
                        dead_factor: int = 0, batch: int = 500,
                        progress: Callable[[dict], object] | None = None) -> dict:
    """Set (or, all zero, clear) the cadence of workspace ``workspace_id``'s check profile and walk the
    workspace's routes, resumably, as :func:`set_workspace_cadence` does. A profile field set wins over the
    workspace's own (see the module doc); the durable copy is the ``check_profiles`` row
    (:func:`magpie.judges.store.set_profile`), this is the one the schedule reads.

    Args and errors as :func:`set_workspace_cadence`. Returns the walk's counts (:func:`walk_workspace`).
    """
    _validate(interval_ms, dead_after, dead_factor)
    _store(queue, f"p:{int(workspace_id)}", interval_ms, dead_after, dead_factor)
    return walk_workspace(queue, workspace_id, batch=batch, progress=progress)


def restore_profile_cadences(queue, cadences: dict[int, dict]) -> int:
    """Write the profile cadences PostgreSQL holds (``{workspace id: {"interval_ms", "dead_after",
    "dead_factor"}}``, :func:`magpie.judges.store.profile_cadences`) back into the schedule, without a walk:
    a schedule rebuild (:func:`magpie.maintenance.rebuild.rebuild_schedule`) runs it before it adds the
    routes back, and ``schedule.lua`` gives every route it adds its cadence. Returns the profiles written."""
    if not cadences:
        return 0
    mapping = {f"p:{int(w)}": f"{int(c['interval_ms'])}:{int(c['dead_after'])}:{int(c['dead_factor'])}"
               for w, c in cadences.items()}
    for part in getattr(queue, "parts", None) or [queue]:  # each partition's scripts read their own copy
        part.r.hset(part.keys.ws_cadence, mapping=mapping)
    return len(cadences)


def walk_workspace(queue, workspace_id: int, *, batch: int = 500,
                   progress: Callable[[dict], object] | None = None) -> dict:
    """Recompute the cadence of every route of ``workspace_id``, shard by shard.

    The walk's place (shard, ZSCAN cursor, counts) is kept in the side key ``cadence_walk:<id>`` with the
    workspace and profile settings it serves; a walk interrupted (a crash, Ctrl-C) resumes there when run again for the
    same setting, and a changed setting starts it over. Returns ``{"routes": affected routes, "moved":
    routes moved into their new interval, "resumed": bool}``.
    """
    parts = getattr(queue, "parts", None)
    if parts is not None:  # the partitioned schedule: each partition walks its own routes
        out = {"routes": 0, "moved": 0, "resumed": False}
        for part in parts:
            got = walk_workspace(part, workspace_id, batch=batch, progress=progress)
            out["routes"] += got["routes"]
            out["moved"] += got["moved"]
            out["resumed"] = out["resumed"] or got["resumed"]
        return out
    ws = str(int(workspace_id))
    r, k = queue.r, queue.keys
    key = queue.side_key(f"cadence_walk:{ws}")
    own, prof = r.hmget(k.ws_cadence, [ws, f"p:{ws}"])
    run = f"{_s(own or b'clear')}|{_s(prof or b'clear')}"  # the settings the walk serves
    state = {(_s(a)): _s(b) for a, b in r.hgetall(key).items()}
    resumed = state.get("run") == run
    if not resumed:
        state = {"run": run, "shard": "0", "cursor": "0", "routes": "0", "moved": "0"}
        r.delete(key)
        r.hset(key, mapping=state)
    counts = {"routes": int(state["routes"]), "moved": int(state["moved"]), "resumed": resumed}
    shard, cursor = int(state["shard"]), state["cursor"]
    while shard < k.shards:
        cursor, rows = r.zscan(k.shard(shard), cursor, count=batch)
        members = [_s(m) for m, _ in rows]
        hits = []
        if members:
            for m, p in zip(members, r.mget([k.payload(m) for m in members])):
                w = _W.search(_s(p)) if p else None
                if w and ws in w.group(1).split(","):
                    hits.append(m)
        for i in range(0, len(hits), 200):
            chunk = hits[i: i + 200]
            counts["moved"] += int(_apply(queue, chunk, "recompute")[0])
            counts["routes"] += len(chunk)
        cursor = str(int(cursor))
        if cursor == "0":
            shard += 1
        r.hset(key, mapping={"shard": shard, "cursor": cursor, "routes": counts["routes"], "moved": counts["moved"]})
        if progress is not None:
            progress(dict(counts, shard=shard))
    r.delete(key)
    return counts
