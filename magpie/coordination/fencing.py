"""Fencing tokens of leader locks, checked by the PostgreSQL writes leader work makes.

A leader lock (:mod:`magpie.coordination.leader`) hands every acquisition a *generation* that only grows. A holder
may go on running after its lease ended (paused past it, cut off from Redis), while a newer holder
already leads. :func:`fence`, called inside the transaction of a protected write, records the
generation in ``leader_fences`` and refuses (:class:`StaleLeader`, the transaction then rolls back) when
a newer generation of the same lock has written already. The row lock it takes also orders two leaders'
protected transactions one after the other.

Protected writes (those that decide what the next leader sees):

* maintenance run records: the start, success and failure of a pass and the saved resume cursor
  (``maintenance_runs``), and each batch of :func:`magpie.maintenance.base.batched_delete`
  (:mod:`magpie.maintenance.runner`, :mod:`magpie.maintenance.base`);
* the alert evaluation's per-workspace transaction: rule state, incidents and queued notifications
  (:func:`magpie.alerts.evaluate.apply_workspace`).
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from magpie.db.models import Base
from magpie.errors import MagpieError

_FENCE = sa.text(
    """
    INSERT INTO leader_fences (name, generation, updated_at) VALUES (:n, :g, now())
    ON CONFLICT (name) DO UPDATE SET generation = EXCLUDED.generation, updated_at = now()
    WHERE leader_fences.generation <= EXCLUDED.generation
    RETURNING generation
    """
)


class LeaderFence(Base):
    """The newest generation of the leader lock ``name`` (its Redis key) that made a protected write."""

    __tablename__ = "leader_fences"

    name: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    generation: Mapped[int] = mapped_column(sa.BigInteger, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
    )


class StaleLeader(MagpieError):
    """A protected write under a generation older than one already recorded: a newer leader wrote.

    Attributes:
        name: the lock's fence name; generation: the refused one; newest: the one recorded.
    """

    def __init__(self, name: str, generation: int, newest: int | None):
        self.name, self.generation, self.newest = name, generation, newest
        super().__init__(f"fenced: leader lock {name} generation {generation} is older than {newest}, "
                         "written by a newer leader")


def fence(conn: sa.Connection, name: str | None, generation: int | None) -> None:
    """Check and record ``generation`` for the lock ``name`` inside ``conn``'s transaction.

    Args:
        conn: a connection in the transaction of the protected write.
        name: the lock's fence name (:attr:`magpie.coordination.leader.LeaderLock.fence_name`); with ``name`` or
            ``generation`` None nothing is checked (work run without a leader lock, e.g. tests, tools).
        generation: the holder's :attr:`magpie.coordination.leader.LeaderLock.generation`.
    Raises:
        StaleLeader: a newer generation of ``name`` has written; roll the transaction back.
        sqlalchemy.exc.DBAPIError: database failure.
    """
    if name is None or generation is None:
        return
    if conn.execute(_FENCE, {"n": name, "g": int(generation)}).first() is None:
        newest = conn.execute(sa.text("SELECT generation FROM leader_fences WHERE name = :n"),
                              {"n": name}).scalar()
        raise StaleLeader(name, int(generation), newest)


def newest_generation(conn: sa.Connection, name: str) -> int | None:
    """The newest generation recorded for ``name``, or None."""
    return conn.execute(sa.text("SELECT generation FROM leader_fences WHERE name = :n"), {"n": name}).scalar()


__all__ = ["LeaderFence", "StaleLeader", "fence", "newest_generation"]
