"""Interval changes converge by themselves: the stored effective interval and the bounded respread.

The schedule's Redis keeps, beside the shards, the interval its due times are spread for: the hash
``<schedule base>proxy_interval`` (:func:`interval_key`). Its fields:

* ``effective_ms``: the interval the schedule is spread for (absent until first recorded);
* ``respreads``: respreads finished so far; ``last_done_ms``, ``last_moved``, ``last_leased``,
  ``last_from_ms``, ``last_to_ms``: the newest one;
* while a respread runs: ``run`` (its token), ``target_ms``, ``from_ms``, ``total`` (routes counted at
  its start), ``started_ms``, and its cursor ``shard``, ``cursor``, ``placed``, ``moved``, ``leased``,
  which every batch updates in the same Lua call that moves the routes (``lua/respread_batch.lua``).

The ``interval_respread`` maintenance job (leader lock ``respread``, shared with ``magpie queue
respread``) compares ``MAGPIE_CHECK_INTERVAL`` with ``effective_ms`` each pass. When they differ it starts
a respread once: shard by shard, :attr:`Settings.respread_batch` routes per batch, stopping at the pass's
limits and resuming from the stored cursor on the next pass (so a killed pass loses nothing and moves no
route twice). A change of the setting during a run starts a new run for the new value. Without a stored
value (a new schedule, or a Redis that lost its data and was rebuilt over the current interval) the job
records the setting and moves nothing. Leased routes keep their lease; completion applies the interval.

Every process must run with the same ``MAGPIE_CHECK_INTERVAL``; the job follows the maintenance worker's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from magpie.maintenance.base import Job, JobContext

LOCK = "respread"
"""Leader lock of every respread (the job and ``magpie queue respread``)."""

_RUN_FIELDS = ("run", "target_ms", "from_ms", "total", "started_ms", "shard", "cursor", "placed", "moved",
               "held")


def interval_key(queue) -> str:
    """The stored-interval hash of ``queue``'s schedule (inside its hash tag)."""
    return queue.side_key("proxy_interval")


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _read(queue) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in queue.redis.hgetall(interval_key(queue)).items()}


def read_interval_state(queue) -> dict:
    """What ``magpie queue interval`` and the metrics show.

    Returns:
        ``{"configured_ms": int, "effective_ms": int | None, "converged": bool, "respreads": int,
        "last": {"done_ms", "moved", "from_ms", "to_ms"} | None,
        "running": {"target_ms", "from_ms", "shard", "shards", "placed", "total", "moved", "leased",
        "started_ms", "percent"} | None}`` (times Unix ms).
    """
    st = _read(queue)
    eff = int(st["effective_ms"]) if "effective_ms" in st else None
    running = None
    if "run" in st:
        total = int(st.get("total", 0))
        placed = int(st.get("placed", 0))
        running = {
            "target_ms": int(st["target_ms"]), "from_ms": int(st["from_ms"]) if st.get("from_ms") else None,
            "shard": int(st.get("shard", 0)), "shards": getattr(queue, "respread_units", queue.shards), "placed": placed, "total": total,
            "moved": int(st.get("moved", 0)), "leased": int(st.get("held", 0)),
            "started_ms": int(st.get("started_ms", 0)),
            "percent": round(100.0 * min(placed, total) / total, 1) if total else 100.0,
        }
    last = None
    if "last_done_ms" in st:
        last = {"done_ms": int(st["last_done_ms"]), "moved": int(st.get("last_moved", 0)),
                "from_ms": int(st["last_from_ms"]) if st.get("last_from_ms") else None,
                "to_ms": int(st.get("last_to_ms", 0))}
    return {"configured_ms": queue.interval_ms, "effective_ms": eff,
            "converged": eff == queue.interval_ms and running is None,
            "respreads": int(st.get("respreads", 0)), "last": last, "running": running}


def record_effective(queue, interval_ms: int | None = None, *, only_if_missing: bool = False) -> bool:
    """Store ``interval_ms`` (default: the queue's) as the effective interval; True when written."""
    ms = int(interval_ms or queue.interval_ms)
    key = interval_key(queue)
    if only_if_missing:
        return bool(queue.redis.hsetnx(key, "effective_ms", ms))
    queue.redis.hset(key, "effective_ms", ms)
    return True


def start_run(queue, target_ms: int) -> str:
    """Begin a tracked respread toward ``target_ms`` (replacing any run in progress); returns its token."""
    st = _read(queue)
    token = uuid.uuid4().hex
    key = interval_key(queue)
    pipe = queue.redis.pipeline(transaction=True)
    pipe.hdel(key, *_RUN_FIELDS)
    pipe.hset(key, mapping={
        "run": token, "target_ms": int(target_ms), "from_ms": st.get("effective_ms", ""),
        "total": queue.route_count(), "started_ms": int(time.time() * 1000), "shard": 0, "cursor": "0",
        "placed": 0, "moved": 0, "held": 0})
    pipe.execute()
    return token


def _finish(queue, token: str) -> dict:
    st = _read(queue)
    if st.get("run") != token:
        return {"finished": False}
    key = interval_key(queue)
    pipe = queue.redis.pipeline(transaction=True)
    pipe.hset(key, mapping={"effective_ms": st["target_ms"], "last_done_ms": int(time.time() * 1000),
                            "last_moved": st.get("moved", 0), "last_leased": st.get("held", 0),
                            "last_from_ms": st.get("from_ms", ""),
                            "last_to_ms": st["target_ms"]})
    pipe.hincrby(key, "respreads", 1)
    pipe.hdel(key, *_RUN_FIELDS)
    pipe.execute()
    return {"finished": True}


def advance(queue, token: str, *, batch: int, should_stop: Callable[[], bool] = lambda: False,
            tick: Callable[[int], None] = lambda n=1: None) -> dict:
    """Run batches of the tracked respread ``token`` from its stored cursor until it ends or ``should_stop()``.

    Args:
        queue: the schedule (:meth:`RouteQueue.respread_batch`, :meth:`RouteQueue.route_count`).
        batch: routes per batch.
        should_stop: asked before each batch (the job's limits); tick: called after each batch.
    Returns:
        ``{"complete": bool, "superseded": bool, "batches": int}``; ``superseded`` when another run
        replaced this one (nothing more was moved).
    """
    key = interval_key(queue)
    batches = 0
    while True:
        st = _read(queue)
        if st.get("run") != token:
            return {"complete": False, "superseded": True, "batches": batches}
        shard = int(st["shard"])
        if shard >= getattr(queue, "respread_units", queue.shards):  # partitions x shards when partitioned
            _finish(queue, token)
            return {"complete": True, "superseded": False, "batches": batches}
        if should_stop():
            return {"complete": False, "superseded": False, "batches": batches}
        step = queue.respread_batch(shard, st["cursor"], count=batch, placed=int(st["placed"]),
                                    total=int(st["total"]), interval_ms=int(st["target_ms"]), progress_key=key,
                                    run=token)
        if step["superseded"]:
            return {"complete": False, "superseded": True, "batches": batches}
        batches += 1
        tick(1)


def respread_now(queue, interval_ms: int | None = None, batch: int = 1000,
                 progress: Callable[[int, int], None] | None = None) -> dict:
    """A whole tracked respread toward ``interval_ms`` (default: the queue's) at once, then recorded as
    the effective interval. Run under the ``respread`` lock. ``progress(placed, total)`` (routes) is
    called after each batch. Returns ``{"moved", "leased", "missing", "routes", "interval_ms"}``."""
    target = int(interval_ms or queue.interval_ms)
    token = start_run(queue, target)

    def tick(_n: int = 1) -> None:
        st = _read(queue) if progress is not None else {}
        if "placed" in st:  # the run's fields go when it ends
            progress(int(st["placed"]), int(st.get("total", 0)))
    advance(queue, token, batch=batch, tick=tick)
    st = _read(queue)
    return {"moved": int(st.get("last_moved", 0)), "leased": int(st.get("last_leased", 0)), "missing": 0,
            "routes": queue.route_count(), "interval_ms": target}


def converge(queue, *, batch: int, should_stop: Callable[[], bool] = lambda: False,
             tick: Callable[[int], None] = lambda n=1: None) -> dict:
    """One pass of convergence toward the queue's interval (see the module doc).

    Returns:
        ``{"action": "recorded" | "none" | "started" | "resumed" | "done", "complete": bool,
        "configured_ms", "effective_ms", "running": {...} | None}`` (:func:`read_interval_state`
        shapes); ``complete`` False while a respread still has routes to move.
    """
    want = queue.interval_ms
    st = _read(queue)
    if "run" in st and int(st["target_ms"]) == want:
        action, token = "resumed", st["run"]
    elif "effective_ms" not in st and "run" not in st:
        record_effective(queue, want, only_if_missing=True)
        return {"action": "recorded", "complete": True, **_summary(queue)}
    elif "run" not in st and int(st["effective_ms"]) == want:
        return {"action": "none", "complete": True, **_summary(queue)}
    else:
        action, token = "started", start_run(queue, want)
    step = advance(queue, token, batch=batch, should_stop=should_stop, tick=tick)
    if step["complete"]:
        action = "done"
    return {"action": action, "complete": step["complete"], "batches": step["batches"], **_summary(queue)}


def _summary(queue) -> dict:
    s = read_interval_state(queue)
    return {"configured_ms": s["configured_ms"], "effective_ms": s["effective_ms"], "running": s["running"],
            "last": s["last"]}


class IntervalRespreadJob(Job):
    name = "interval_respread"
    every = 60.0
    lock_name = LOCK
    description = "respread the schedule once when MAGPIE_CHECK_INTERVAL differs from the stored interval"

    def run(self, ctx: JobContext) -> dict:
        s = ctx.settings
        if not getattr(s, "interval_respread", True):
            return {"action": "off", "reason": "MAGPIE_INTERVAL_RESPREAD is off", "complete": True}
        batch = int(getattr(s, "respread_batch", 1000))
        return converge(ctx.queue(), batch=batch, should_stop=ctx.should_stop, tick=ctx.tick)


JOB = IntervalRespreadJob()


def interval_families(queue) -> list:
    """Prometheus families of the interval and its respread (zero when none ran)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    s = read_interval_state(queue)
    interval = GaugeMetricFamily("magpie_check_interval_seconds",
                                 "Check interval: configured (MAGPIE_CHECK_INTERVAL) and effective (stored)",
                                 labels=["source"])
    interval.add_metric(["configured"], s["configured_ms"] / 1000)
    if s["effective_ms"] is not None:
        interval.add_metric(["effective"], s["effective_ms"] / 1000)
    run = s["running"] or {}
    return [
        interval,
        GaugeMetricFamily("magpie_interval_respread_active", "1 while a respread toward a new interval runs",
                          value=1.0 if s["running"] else 0.0),
        GaugeMetricFamily("magpie_interval_respread_placed_routes", "Routes the running respread has placed",
                          value=float(run.get("placed", 0))),
        GaugeMetricFamily("magpie_interval_respread_total_routes", "Routes the running respread places in all",
                          value=float(run.get("total", 0))),
        CounterMetricFamily("magpie_interval_respreads", "Respreads toward a new interval finished",
                            value=float(s["respreads"])),
    ]
