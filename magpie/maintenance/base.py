"""What every maintenance job shares: the :class:`Job` interface and the :class:`JobContext` a pass runs with.

A job does its work in batches, each batch in its own short transaction and idempotent, so a pass
killed at any point leaves nothing the next pass cannot finish. Between batches it asks
:meth:`JobContext.should_stop`, which turns true when the leader lock was lost, the pass ran out of
time (``MAGPIE_MAINTENANCE_MAX_RUN_SECONDS``) or of batches (``MAGPIE_MAINTENANCE_MAX_BATCHES``). A job
that stops early reports ``"complete": False`` and, where order matters, keeps a resume cursor in
:attr:`JobContext.state` (saved to ``maintenance_runs.state``).

Writes of a pass carry the leader lock's fencing token (:attr:`JobContext.generation`): the saved state
and every batch of :func:`batched_delete` call :meth:`JobContext.fence` in their transaction, so a pass
that goes on after a newer leader started is refused (:class:`magpie.coordination.fencing.StaleLeader`) instead of
writing over it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

import redis as redis_lib
import sqlalchemy as sa
from sqlalchemy.engine import Engine


@dataclass
class JobContext:
    """Everything one pass of a job may use.

    Attributes:
        job: the job's name.
        settings: :class:`magpie.config.Settings`.
        engine: engine on the magpie database.
        redis: client on the schedule's Redis.
        now: the pass's reference time (aware UTC datetime); cutoffs are computed from it.
        cancel: set when the leader lock is lost; stop at the next batch boundary.
        deadline: ``time.monotonic()`` value after which no new batch starts.
        batch_size: rows (or routes) per batch.
        max_batches: most batches in this pass.
        state: the job's resume state from the previous pass (JSON object); change it with
            :meth:`save_state`.
        batches: batches done so far (:meth:`tick` counts them).
        generation: the leader lock's fencing token for this pass (None without a lock).
        fence_name: the lock's fence name (its Redis key; None without a lock).
    """

    job: str
    settings: object
    engine: Engine
    redis: redis_lib.Redis
    now: datetime
    cancel: threading.Event
    deadline: float
    batch_size: int
    max_batches: int
    state: dict = field(default_factory=dict)
    batches: int = 0
    generation: int | None = None
    fence_name: str | None = None

    def stop_reason(self) -> str | None:
        """``"cancelled"``, ``"time"``, ``"batches"`` or ``None`` (go on)."""
        if self.cancel.is_set():
            return "cancelled"
        if time.monotonic() >= self.deadline:
            return "time"
        if self.batches >= self.max_batches:
            return "batches"
        return None

    def should_stop(self) -> bool:
        """True when no new batch may start (see :meth:`stop_reason`)."""
        return self.stop_reason() is not None

    def fence(self, conn: sa.Connection) -> None:
        """Check this pass's fencing token inside ``conn``'s transaction (:func:`magpie.coordination.fencing.fence`).

        Raises :class:`magpie.coordination.fencing.StaleLeader` when a newer leader of the job's lock has written."""
        from magpie.coordination.fencing import fence

        fence(conn, self.fence_name, self.generation)

    def tick(self, n: int = 1) -> None:
        """Count ``n`` finished batches."""
        self.batches += n

    def save_state(self, state: dict, conn: sa.Connection | None = None) -> None:
        """Persist the resume state (``maintenance_runs.state``); inside ``conn``'s transaction when
        given, so the cursor moves atomically with the batch it describes. Fenced (:meth:`fence`)."""
        self.state = dict(state)
        sql = sa.text(
            "UPDATE maintenance_runs SET state = CAST(:s AS jsonb), updated_at = now() WHERE job = :j"
        )
        params = {"s": json.dumps(self.state), "j": self.job}
        if conn is not None:
            self.fence(conn)
            conn.execute(sql, params)
            return
        with self.engine.begin() as c:
            self.fence(c)
            c.execute(sql, params)

    def queue(self):
        """The deployment's :class:`magpie.queue.RouteQueue` on :attr:`redis`."""
        from magpie.queue.provider import create_provider

        return create_provider(self.settings.schedule_url, self.settings, redis_client=self.redis)


class Job:
    """A maintenance job. Subclasses set :attr:`name`, :attr:`every` and :attr:`description` and
    implement :meth:`run`.

    Attributes:
        name: unique job name (``[a-z_]+``); also the leader-lock name unless :attr:`lock_name` says
            otherwise (key ``<prefix>leader:<lock_name>``) and the ``job`` metric label.
        every: default cadence in seconds (``MAGPIE_MAINTENANCE_CADENCES`` overrides it; 0 = not on beat).
        description: one line for ``magpie maintenance status``.
    """

    name: str = ""
    every: float = 3600.0
    description: str = ""
    lock_name: str | None = None

    @property
    def lock(self) -> str:
        return self.lock_name or self.name

    def run(self, ctx: JobContext) -> dict:
        """Run one pass. Returns a JSON-able summary that includes ``"complete": bool``.

        Raises whatever the work raises (the runner records the failure)."""
        raise NotImplementedError

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"<Job {self.name} every {self.every:g}s>"


def table_exists(conn: sa.Connection, name: str) -> bool:
    """True when ``public.<name>`` exists."""
    return conn.execute(sa.text("SELECT to_regclass(:n) IS NOT NULL"), {"n": f"public.{name}"}).scalar_one()


def batched_delete(ctx: JobContext, sql: str, params: dict) -> tuple[int, bool]:
    """Run a ``DELETE ... LIMIT :batch``-shaped statement until it deletes fewer than a batch.

    ``sql`` must take ``:batch`` and delete at most that many rows; each run is its own transaction,
    fenced with the pass's token (:meth:`JobContext.fence`). Returns ``(rows deleted, complete)``.
    """
    deleted = 0
    while not ctx.should_stop():
        with ctx.engine.begin() as conn:
            ctx.fence(conn)
            n = conn.execute(sa.text(sql), {**params, "batch": ctx.batch_size}).rowcount
        ctx.tick()
        deleted += n
        if n < ctx.batch_size:
            return deleted, True
    return deleted, False
