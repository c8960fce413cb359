"""What the dashboard's pages and its JSON API share: clients, reads composed from their owners, actions.

Schedule figures are :meth:`magpie.queue.RouteQueue.status` / ``dead_letters`` / ``inspect`` (the same
reads as ``magpie status`` and the metrics exporter), readiness is :func:`magpie.observability.health.check_health`,
charts come from :mod:`magpie.observability.samples`, route health and alerts from :mod:`magpie.web.data`, rotators
(the merge of ``magpie rotators list``) and live instances through :mod:`magpie.web.fleet`. Actions
are the schedule's own verbs (``pause``, ``resume``, ``reprocess``, ``enqueue_in``), the same as the
``magpie queue`` commands.
"""

from __future__ import annotations

import threading
from functools import cached_property

import redis as redis_lib

from magpie.base import redisconn
from magpie.queue import QueueKeys, RouteQueue
from magpie.web import data, fleet
from magpie.observability.samples import read_samples, series


class Dashboard:
    """Settings and lazily built clients of one ``magpie web`` process.

    Args:
        settings: :class:`magpie.config.Settings`.
        redis: client to use (default one on ``MAGPIE_REDIS_URL`` with 5-second socket timeouts).
        engine: SQLAlchemy engine (default the process engine on ``MAGPIE_DATABASE_URL``, once
            ``PROXY_ENCRYPTION_KEY`` is known to be the database's key).
    """

    def __init__(self, settings, *, redis: redis_lib.Redis | None = None, engine=None):
        self.settings = settings
        self._redis = redis
        self._engine = engine
        self._lock = threading.Lock()

    @property
    def redis(self) -> redis_lib.Redis:
        """The Redis client (built on first use)."""
        if self._redis is None:
            with self._lock:
                if self._redis is None:
                    self._redis = redisconn.connect(
                        self.settings.redis_url, socket_timeout=5.0, socket_connect_timeout=5.0,
                        health_check_interval=30)
        return self._redis

    @property
    def engine(self):
        """The SQLAlchemy engine; raises :class:`magpie.base.crypto.KeyMismatchError` for another key."""
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    from magpie.db.keycheck import verify_key
                    from magpie.db.session import get_engine

                    engine = get_engine(self.settings.database_url)
                    verify_key(engine, self.settings.encryption_key)
                    self._engine = engine
        return self._engine

    @cached_property
    def queue(self) -> RouteQueue:
        """The schedule, built without the layout check so that reads never write (as the exporter does)."""
        from magpie.queue.partitioned import reader

        return reader(self.redis, self.settings)  # every partition when MAGPIE_SCHEDULE_PARTITIONS > 1

    # -- reads -------------------------------------------------------------------------------------------
    def status(self) -> dict:
        """:meth:`RouteQueue.status` with each shard's short name (``shard`` is the full key); a partitioned
        schedule adds ``partitions`` (per partition: name, paused and the counts) beside the totals."""
        st = self.queue.status()
        for sh in st["shards"]:
            sh["name"] = sh["shard"].rsplit(":", 1)[-1]
        return st

    def chart_points(self, limit: int | None = None) -> list[dict]:
        """Throughput and lateness points, oldest first: one per stored snapshot of the
        ``dashboard_snapshot`` job (:func:`magpie.derived.dashboard.history_points`) when PostgreSQL holds
        any, else per interval of this deployment's in-Redis ring (:func:`magpie.observability.samples.series`)."""
        stored = self.stored_points(limit)
        if stored:
            return stored
        keep = self.settings.web_sample_keep
        n = min(int(limit) + 1, keep) if limit else keep
        return series(read_samples(self.redis, self.settings.redis_prefix, n))

    def stored_points(self, limit: int | None = None) -> list[dict]:
        """Points of the stored snapshots (newest ``limit``, default ``MAGPIE_WEB_SAMPLE_KEEP``), oldest
        first; empty when none is stored or PostgreSQL cannot be read."""
        import sqlalchemy.exc

        from magpie.derived.dashboard import history_points, read_snapshots

        n = int(limit) if limit else self.settings.web_sample_keep
        try:
            points = history_points(read_snapshots(self.engine, n + 1))
        except (sqlalchemy.exc.SQLAlchemyError, OSError):  # PostgreSQL away: the Redis ring still draws
            return []
        return points[-n:]

    def dead_letters(self, limit: int) -> list[dict]:
        """Dead-lettered routes, oldest first, each with ``route`` (protocol, host, port) when stored."""
        rows = self.queue.dead_letters(limit)
        known = data.routes_by_hashes(self.engine, [r["member"] for r in rows]) if rows else {}
        for r in rows:
            r["route"] = known.get(r["member"])
        return rows

    def dead_count(self) -> int:
        """How many routes are dead-lettered (one ``ZCARD`` on Redis, one count on PostgreSQL)."""
        return int(self.queue.dead_count())

    def route(self, route_hash: str, history: int = 50) -> dict | None:
        """``{"route": dict | None, "history": [dict], "schedule": dict | None}`` or None when neither
        PostgreSQL nor the schedule knows the route. ``schedule`` is :meth:`RouteQueue.inspect` without the
        payload (credentials), the password masked in logs and progress."""
        from magpie.base.redact import mask_route_info as _masked

        row = data.route_by_hash(self.engine, route_hash)
        info = self.queue.inspect(route_hash)
        schedule = None
        if not (info["state"] == "gone" and info["payload"] is None):
            schedule = {k: v for k, v in _masked(info).items() if k != "payload"}
        if row is None and schedule is None:
            return None
        hist = data.route_history(self.engine, row["route_id"], history) if row else []
        return {"route": row, "history": hist, "schedule": schedule}

    def rotators(self) -> list[dict]:
        """Every rotator with its listener state (:func:`magpie.web.fleet.rotator_view` dicts, by port):
        the merge of ``magpie rotators list``, without user names or passwords."""
        from magpie.rotator.process import list_with_state

        rows = list_with_state(self.engine, self.redis, self.settings.redis_prefix)
        return [fleet.rotator_view(r) for r in rows]

    def instances(self, role: str | None = None) -> dict:
        """Live instances: ``{"total": n shown, "by_role": {role: count of all live}, "instances":
        [fleet.instance_view dicts of ``role`` only when given, by role then id]}``."""
        from magpie.coordination.instances import InstanceRegistry

        views = [fleet.instance_view(r) for r in InstanceRegistry(self.redis, self.settings.redis_prefix)
                 .list_live()]
        shown = [v for v in views if role is None or v["role"] == role]
        return {"total": len(shown), "by_role": fleet.by_role(views), "instances": shown}

    def health(self) -> dict:
        """:func:`magpie.observability.health.check_health` (every probe bounded by ``MAGPIE_HEALTH_TIMEOUT``)."""
        from magpie.observability.health import check_health

        return check_health(self.settings)

    # -- actions (the caller checked the token) ------------------------------------------------------
    def _acting_queue(self) -> RouteQueue:
        from magpie.queue.partitioned import check_partition_layout

        s = self.settings
        check_partition_layout(self.redis, s.redis_prefix, int(s.schedule_partitions))  # partition count
        self.queue.check_layout()  # refuses layout_mismatch before any write
        return self.queue

    def pause(self) -> str:
        """Stop all claiming (:meth:`RouteQueue.pause`); returns ``"paused"``."""
        self._acting_queue().pause()
        return "paused"

    def resume(self) -> str:
        """Resume claiming; returns ``"resumed"``."""
        self._acting_queue().resume()
        return "resumed"

    def reprocess(self, member: str) -> int:
        """Put a dead-lettered route back, due now; returns its due time (Unix ms).
        Raises :class:`magpie.errors.RefusedError` ``not_dead`` or ``gone``."""
        return self._acting_queue().reprocess(member)

    def check_now(self, member: str, delay_ms: int = 0) -> int:
        """Check a route now (``enqueue_in(member, delay_ms)``); returns its due time (Unix ms).
        Raises :class:`magpie.errors.RefusedError` ``gone``, ``leased`` or ``dead``."""
        return self._acting_queue().enqueue_in(member, int(delay_ms))

    def close(self) -> None:
        """Close the Redis connections this object opened."""
        if self._redis is not None:
            self._redis.close()


__all__ = ["Dashboard"]
