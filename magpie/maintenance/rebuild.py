"""Rebuild the Redis route schedule from PostgreSQL after Redis lost data, by hand or by the ``rebuild`` job.

:func:`rebuild_schedule` feeds every route some workspace owns (:func:`magpie.db.repo.all_route_records`) to
:meth:`magpie.queue.RouteQueue.schedule` in chunks. ``schedule`` adds a missing route with a first due
time spread over the check interval (route *i* of *n* due at now + i * interval / n) and never resets a
route still present (its due time, lease and payload stay; only workspace ids are merged in), nor
re-adds a dead-lettered one. So a rebuild is idempotent and safe to run while workers are checking.

After a complete rebuild a marker key (``<schedule base>maintenance_marker``) is set. Redis losing its data
loses the marker too; the ``rebuild`` job, every pass, rebuilds when the marker is missing and PostgreSQL
has routes (``MAGPIE_SCHEDULE_AUTO_REBUILD``). Operator removals (``queue drain``/``obliterate``) leave the
marker, so they are not undone. A partial loss (an older snapshot restored) keeps the marker: run
:func:`rebuild_schedule` by hand then (``magpie queue rebuild``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis as redis_lib
from sqlalchemy.engine import Engine

from magpie.base import redisconn
from magpie.maintenance.base import Job, JobContext
from magpie.maintenance.marker import mark_bootstrapped, marker_key, needs_rebuild, owned_routes  # noqa: F401

CHUNK = 5000
LOCK = "rebuild"
"""Leader-lock name of schedule rebuilds (``<prefix>leader:rebuild``), shared by the job and the CLI."""

def rebuild_schedule(
    settings,
    *,
    engine: Engine | None = None,
    redis: redis_lib.Redis | None = None,
    queue=None,
    chunk: int = CHUNK,
    lock: bool = True,
    cancel: threading.Event | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Schedule again every route PostgreSQL knows, keeping routes still present as they are.

    Args:
        settings: :class:`magpie.config.Settings` (URLs, prefix, shards, interval, encryption key and
            ``PROXY_QUEUE_ENCRYPT_CREDENTIALS`` for the payloads of routes added back).
        engine / redis / queue: defaults from ``settings``.
        chunk: routes per :meth:`RouteQueue.schedule` call (and per database fetch).
        lock: hold the ``rebuild`` leader lock for the duration (two rebuilds never overlap); with
            ``lock=False`` the caller coordinates.
        cancel: stop between chunks once set (the routes scheduled so far stay scheduled).
        progress: called after each chunk with ``(routes fed so far, routes counted at the start)``.
    Returns:
        ``{"ran": bool, "routes": int (routes fed), "total": int (owned routes counted at the start),
        "new": int (added back), "merged": int, "unchanged": int, "complete": bool, "seconds": float}``,
        plus ``"profile_cadences"`` (check profiles whose cadence was written back) on the Redis schedule;
        ``ran`` is False (and ``reason`` set) when another process holds the lock.
    Raises:
        magpie.base.crypto.CredentialError: stored credentials do not decrypt with ``PROXY_ENCRYPTION_KEY``.
        sqlalchemy.exc.DBAPIError / redis.RedisError: a store is unavailable (scheduled chunks stay;
            re-running finishes the job).
    """
    from magpie.base.crypto import get_keyring
    from magpie.db.repo import all_route_records
    from magpie.queue.payload import schedule_item, write_cipher
    from magpie.queue.provider import create_provider

    if engine is None:
        from magpie.db.session import get_engine

        engine = get_engine(settings.database_url)
    if queue is None:
        redis = redis or redisconn.connect(settings.redis_url)
        queue = create_provider(settings.schedule_url, settings, redis_client=redis)
    if lock:
        from magpie.coordination.leader import LeaderLock

        with LeaderLock(
            queue.redis, settings.redis_prefix, LOCK, int(settings.maintenance_lock_ttl * 1000)
        ).hold() as lost:
            if lost is None:
                return {"ran": False, "reason": "another process holds the rebuild lock"}
            return rebuild_schedule(
                settings, engine=engine, queue=queue, chunk=chunk, lock=False, cancel=lost, progress=progress
            )

    t0 = time.monotonic()
    total = owned_routes(engine)
    out = {"ran": True, "routes": 0, "total": total, "new": 0, "merged": 0, "unchanged": 0, "complete": True}
    if getattr(queue, "carries_cadence", False):  # profile cadences first: routes added back take them
        from magpie.db.repo import profile_cadences
        from magpie.queue.cadence import restore_profile_cadences

        out["profile_cadences"] = restore_profile_cadences(queue, profile_cadences(engine))
    keyring = get_keyring(settings.encryption_key)
    cipher = write_cipher(settings)  # PROXY_QUEUE_ENCRYPT_CREDENTIALS: routes added back are sealed
    buf: list[tuple[str, str]] = []

    def flush():
        counts = queue.schedule(buf, total=max(total, out["routes"] + len(buf)), start_index=out["routes"])
        for k in ("new", "merged", "unchanged"):
            out[k] += counts[k]
        out["routes"] += len(buf)
        buf.clear()
        if progress is not None:
            progress(out["routes"], max(total, out["routes"]))

    records = all_route_records(engine, keyring, batch=chunk)
    try:
        for rec in records:
            buf.append(schedule_item(rec, cipher))
            if len(buf) >= chunk:
                flush()
                if cancel is not None and cancel.is_set():
                    out["complete"] = False
                    break
        if buf and out["complete"]:
            flush()
    finally:
        records.close()
    if out["complete"]:
        mark_bootstrapped(queue)
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


class ScheduleRebuildJob(Job):
    name = "rebuild"
    every = 60.0
    lock_name = LOCK
    description = "rebuild the Redis schedule from PostgreSQL when Redis lost it (marker missing)"

    def run(self, ctx: JobContext) -> dict:
        s = ctx.settings
        queue = ctx.queue()
        if not s.schedule_auto_rebuild:
            return {"rebuilt": False, "reason": "MAGPIE_SCHEDULE_AUTO_REBUILD is off", "complete": True}
        if not needs_rebuild(ctx.engine, queue):
            return {"rebuilt": False, "complete": True}
        r = rebuild_schedule(s, engine=ctx.engine, queue=queue, lock=False, cancel=ctx.cancel)
        return {"rebuilt": True, **{k: v for k, v in r.items() if k != "ran"}}


JOB = ScheduleRebuildJob()
