"""Instance heartbeats: every worker and beat process keeps a record with a TTL in Redis.

Layout (under ``MAGPIE_REDIS_PREFIX``): ``instance:<id>`` holds the record as JSON with a time to live of
``MAGPIE_INSTANCE_TTL`` seconds, refreshed every ``MAGPIE_INSTANCE_HEARTBEAT`` seconds; ``instances`` is a
set indexing the ids. A process that stops refreshing disappears when its key expires (Redis expires it:
no sweeper, no clock shared between hosts); readers drop ids whose key is gone from the index, and the
``instance_sweep`` maintenance job does the same on its cadence.

A record (:meth:`Heartbeat.record`) has ``id``, ``role`` (a free string: ``worker``, ``beat``, ...),
``host``, ``pid``, ``started_at``, ``refreshed_at`` (ISO 8601 UTC), ``version``, ``ttl_s`` and whatever the
role adds (``queues`` for workers), ``cache_revisions`` (``{cache: revision}`` from
:func:`register_cache_revision`) and the extras registered with :func:`register_extra`. Extras are
called at every refresh; one that raises is logged and left out.

Check-pool processes (Celery prefork children) report their running checks and slots into
``instance:<id>:checks`` (a hash, one field per process); the worker's record sums the fresh ones in its
``checks`` field (``in_flight``, ``slots``, ``processes``; :mod:`magpie.wiring.instance_hooks`).

:func:`promote_shares` gives promote its fair shares from the live counts: the per-pass budget split
between the live beats (each triggers its own passes) and the leases per message split between the live
check engines (:mod:`magpie.queue.capacity`), so one pass feeds every engine.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata

import redis as redis_lib

from magpie.base import redisconn

log = logging.getLogger(__name__)

_extras: dict[str, Callable[[], object]] = {}
_extras_lock = threading.Lock()


def register_extra(name: str, fn: Callable[[], object]) -> None:
    """Add field ``name`` to every instance record this process refreshes: ``fn()`` (JSON-able, called at
    each refresh, in the heartbeat thread; keep it cheap). Re-registering a name replaces it.

    Raises ``ValueError`` for an empty name or one of the base fields."""
    if not name or name in BASE_FIELDS:
        raise ValueError(f"extra name {name!r} is empty or a base field ({', '.join(BASE_FIELDS)})")
    with _extras_lock:
        _extras[name] = fn


def unregister_extra(name: str) -> None:
    """Remove extra ``name`` (no error when absent)."""
    with _extras_lock:
        _extras.pop(name, None)


BASE_FIELDS = ("id", "role", "host", "pid", "started_at", "refreshed_at", "version", "ttl_s",
               "cache_revisions")

_caches: dict[str, Callable[[], object]] = {}


def register_cache_revision(name: str, fn: Callable[[], object]) -> None:
    """Report ``fn()`` (the revision this process's cache ``name`` holds: a number, a hash, a timestamp)
    under ``cache_revisions[name]`` in every record, so operators see which process is behind."""
    if not name:
        raise ValueError("cache name must not be empty")
    with _extras_lock:
        _caches[name] = fn


def _key(prefix: str, instance_id: str) -> str:
    return f"{prefix}instance:{instance_id}"


def _index(prefix: str) -> str:
    return f"{prefix}instances"


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _version() -> str:
    """The installed magpie distribution's version (what ``pip show magpie`` reports)."""
    return metadata.version("magpie")


def new_id(role: str) -> str:
    """A unique instance id: ``<role>-<host>-<pid>-<4 hex>``."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class InstanceRegistry:
    """Read and write instance records.

    Args:
        client: redis-py client (bytes or text replies).
        prefix: ``MAGPIE_REDIS_PREFIX``.
    """

    def __init__(self, client: redis_lib.Redis, prefix: str):
        self.r = client
        self.prefix = prefix

    def refresh(self, record: dict, ttl_s: float) -> None:
        """Write ``record`` (has ``id``) for ``ttl_s`` seconds and index it. Raises ``redis.RedisError``."""
        pipe = self.r.pipeline(transaction=False)
        doc = json.dumps(record, default=str)
        pipe.set(_key(self.prefix, record["id"]), doc, px=max(1, int(ttl_s * 1000)))
        pipe.sadd(_index(self.prefix), record["id"])
        pipe.execute()

    def withdraw(self, instance_id: str) -> None:
        """Remove ``instance_id`` at once (a clean shutdown). Raises ``redis.RedisError``."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(_key(self.prefix, instance_id))  # one key per DEL: a cluster pipeline routes by key
        pipe.delete(_key(self.prefix, instance_id) + ":checks")
        pipe.srem(_index(self.prefix), instance_id)
        pipe.execute()

    def list_live(self, role: str | None = None) -> list[dict]:
        """Live records (of ``role`` only when given), ordered by role then id; ids whose record expired
        are dropped from the index. Raises ``redis.RedisError``."""
        ids = sorted(_text(m) for m in self.r.smembers(_index(self.prefix)))
        if not ids:
            return []
        vals = redisconn.mget(self.r, [_key(self.prefix, i) for i in ids])
        live, gone = [], []
        for i, v in zip(ids, vals):
            if v is None:
                gone.append(i)
                continue
            try:
                rec = json.loads(v)
            except ValueError:
                gone.append(i)
                continue
            if role is None or rec.get("role") == role:
                live.append(rec)
        if gone:
            self.r.srem(_index(self.prefix), *gone)
        return sorted(live, key=lambda d: (str(d.get("role")), str(d.get("id"))))

    def sweep(self) -> tuple[int, dict[str, int]]:
        """Drop expired ids from the index; returns ``(ids dropped, {role: live count})``."""
        before = self.r.scard(_index(self.prefix))
        live = self.list_live()
        counts: dict[str, int] = {}
        for rec in live:
            counts[str(rec.get("role"))] = counts.get(str(rec.get("role")), 0) + 1
        return max(0, int(before) - len(live)), counts

    def count_live(self, role: str | None = None, queue: str | None = None) -> int:
        """Live instances of ``role`` (any when None) that consume ``queue`` (any when None)."""
        return sum(1 for rec in self.list_live(role) if queue is None or queue in (rec.get("queues") or ()))

    # -- per-process check figures of a worker -------------------------------------------------------
    def report_checks(self, instance_id: str, pid: int, running: int, slots: int, ttl_s: float) -> None:
        """Record one check-pool process's ``running`` checks and ``slots`` under worker ``instance_id``."""
        key = _key(self.prefix, instance_id) + ":checks"
        doc = json.dumps({"running": int(running), "slots": int(slots), "at": time.time()})
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(key, str(pid), doc)
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        pipe.execute()

    def forget_checks(self, instance_id: str, pid: int) -> None:
        """Remove one process's check figures (it shuts down)."""
        self.r.hdel(_key(self.prefix, instance_id) + ":checks", str(pid))

    def checks_of(self, instance_id: str, ttl_s: float) -> tuple[int, int, int]:
        """``(checks in flight, slots, processes)`` summed over the fresh (younger than ``ttl_s``) process
        reports of ``instance_id``; stale ones are deleted."""
        key = _key(self.prefix, instance_id) + ":checks"
        now, running, slots, procs, stale = time.time(), 0, 0, 0, []
        for pid, raw in self.r.hgetall(key).items():
            try:
                d = json.loads(raw)
            except ValueError:
                d = {"at": 0}
            if now - float(d.get("at", 0)) > ttl_s:
                stale.append(pid)
                continue
            running += int(d.get("running", 0))
            slots += int(d.get("slots", 0))
            procs += 1
        if stale:
            self.r.hdel(key, *stale)
        return running, slots, procs


class Heartbeat:
    """This process's instance record, refreshed by a daemon thread.

    Args:
        role: free string (``worker``, ``beat``, ``rotator``...).
        client / prefix: where to write (see :class:`InstanceRegistry`).
        interval / ttl: seconds between refreshes / record lifetime (``MAGPIE_INSTANCE_HEARTBEAT`` /
            ``MAGPIE_INSTANCE_TTL``).
        fields: fixed role fields (e.g. ``{"queues": [...]}``) merged into every record.
        dynamic: ``{name: fn}`` fields of this heartbeat only, called at each refresh like extras.
        instance_id: default :func:`new_id` of ``role``.
    """

    def __init__(self, role: str, client: redis_lib.Redis, prefix: str, *, interval: float, ttl: float,
                 fields: dict | None = None, dynamic: dict[str, Callable[[], object]] | None = None,
                 instance_id: str | None = None):
        self.registry = InstanceRegistry(client, prefix)
        self.role = str(role)
        self.id = instance_id or new_id(self.role)
        self.interval = float(interval)
        self.ttl = float(ttl)
        self.fields = dict(fields or {})
        self.dynamic = dict(dynamic or {})
        self.started_at = datetime.now(UTC).isoformat()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self) -> dict:
        """The record as refreshed now: base fields, role fields, then dynamic fields and extras."""
        rec = {"id": self.id, "role": self.role, "host": socket.gethostname(), "pid": os.getpid(),
               "started_at": self.started_at, "refreshed_at": datetime.now(UTC).isoformat(),
               "version": _version(), "ttl_s": self.ttl, **self.fields}
        with _extras_lock:
            extra, caches = dict(_extras), dict(_caches)
        for name, fn in {**self.dynamic, **extra}.items():
            try:
                rec[name] = fn()
            except Exception:  # noqa: BLE001 - one failing extra never stops the heartbeat
                log.warning("instance extra %r failed", name, exc_info=True)
        revisions = {}
        for name, fn in caches.items():
            try:
                revisions[name] = fn()
            except Exception:  # noqa: BLE001
                log.warning("cache revision %r failed", name, exc_info=True)
        rec["cache_revisions"] = revisions
        return rec

    def beat_once(self) -> dict:
        """Refresh the record now; returns it. Raises ``redis.RedisError``."""
        rec = self.record()
        self.registry.refresh(rec, self.ttl)
        return rec

    def start(self) -> Heartbeat:
        """Refresh once now (errors logged) and then every :attr:`interval` in a daemon thread."""
        if self._thread is not None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"magpie-heartbeat-{self.role}", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat_once()
            except Exception:  # noqa: BLE001 - Redis away: the record expires, the next beat restores it
                log.warning("instance heartbeat of %s failed", self.id, exc_info=True)
            self._stop.wait(self.interval)

    def stop(self, withdraw: bool = True) -> None:
        """Stop refreshing; with ``withdraw`` remove the record at once (else it expires after its TTL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if withdraw:
            try:
                self.registry.withdraw(self.id)
            except Exception:  # noqa: BLE001 - it expires on its own
                log.warning("could not withdraw instance %s", self.id)


def fair_share(total: int, n: int) -> int:
    """``ceil(total / n)`` with ``n`` floored at 1 (and at least 1 when ``total`` > 0)."""
    return max(1 if total > 0 else 0, math.ceil(int(total) / max(1, int(n))))


@dataclass(frozen=True, slots=True)
class Shares:
    """Promote's fair shares: ``want`` (routes this pass takes from the per-second budget) and
    ``engines`` (live check engines the pass's leases are spread over); ``beats`` counted."""

    want: int
    engines: int
    beats: int


def promote_shares(queue, budget: int) -> Shares:
    """Fair shares of one promote pass on ``queue`` (a :class:`magpie.queue.provider.ScheduleProvider`)
    with a per-second ``budget``: ``want = ceil(budget / live beats)`` and the number of live check
    engines. Never raises: when Redis cannot tell, one beat and one engine are assumed."""
    try:
        beats = InstanceRegistry(queue.redis, queue.prefix).count_live("beat")
        engines = len(queue.capacity_registry().engines())
    except redis_lib.RedisError:
        beats, engines = 1, 1
    return Shares(fair_share(budget, beats), max(1, engines), max(1, beats))


__all__ = ["BASE_FIELDS", "Heartbeat", "InstanceRegistry", "Shares", "fair_share", "new_id", "promote_shares",
           "register_cache_revision", "register_extra", "unregister_extra"]
