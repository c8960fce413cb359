"""Tables of judge pools, check profiles, failure streaks and the check-config revision (migration 0007).

``judges``: one judge URL per row, in the global pool (``workspace_id`` NULL) or a workspace's own pool;
the refresh job writes its health and resolved addresses. ``check_profiles``: one row per workspace that
checks differently from the defaults. ``route_failures``: consecutive failed checks per (workspace,
route), written by ingestion. ``check_config_revisions``: the revision every change of judges or profiles
raises in the same transaction (checkers compare their cached revision with it).
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.orm import Mapped, mapped_column

from magpie.db.models import Base

TSTZ = sa.DateTime(timezone=True)
_now = sa.text("now()")

RULES_CHECK = "rule = 'echo' OR rule = 'status' OR rule LIKE 'contains:%'"


class Judge(Base):
    """A judge URL of a pool.

    ``scheme`` is the URL's (``http``/``https``); ``rule`` what a valid answer is (``echo``, ``status``,
    ``contains:<text>``, see :mod:`magpie.checker.rules`); ``healthy`` / ``last_error`` the refresh job's
    last verdict; ``addresses`` the host name's resolved addresses (JSON list) until ``addresses_until``.
    """

    __tablename__ = "judges"
    __table_args__ = (
        sa.CheckConstraint("scheme IN ('http', 'https')", name="scheme"),
        sa.CheckConstraint(RULES_CHECK, name="rule"),
        sa.CheckConstraint("rate IS NULL OR rate >= 0", name="rate"),
        sa.Index("ix_judges_scope_url", sa.text("coalesce(workspace_id, 0)"), "url", unique=True),
        sa.Index("ix_judges_workspace_id", "workspace_id"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, sa.Identity(), primary_key=True)
    workspace_id: Mapped[int | None] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=True)
    url: Mapped[str] = mapped_column(sa.Text, nullable=False)
    scheme: Mapped[str] = mapped_column(sa.Text, nullable=False)
    rule: Mapped[str] = mapped_column(sa.Text, nullable=False, server_default="echo")
    rate: Mapped[float | None] = mapped_column(sa.REAL, nullable=True)  # requests/s; NULL: MAGPIE_JUDGE_RATE
    enabled: Mapped[bool] = mapped_column(sa.Boolean, nullable=False, server_default=sa.true())
    healthy: Mapped[bool] = mapped_column(sa.Boolean, nullable=False, server_default=sa.true())
    last_error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    last_checked_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    last_ok_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    addresses: Mapped[list] = mapped_column(pg.JSONB, nullable=False, server_default=sa.text("'[]'::jsonb"))
    addresses_until: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    created_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class CheckProfile(Base):
    """How one workspace's routes are checked; a NULL column takes the deployment's default.

    ``protocols``: protocols a route's host:port is tested as (NULL: the route's own); ``timeout`` per
    attempt in seconds; ``attempts``; ``judge_pool`` ``global`` or ``workspace`` (its own judges, the
    global pool when it has none); ``rule`` overrides the judges' valid-answer rule;
    ``auto_remove_after``: drop the workspace's ownership of a route after this many consecutive failures.
    ``check_interval`` (seconds) and ``dead_after`` / ``dead_factor`` (the dead-route policy, both or
    neither): the cadence of the workspace's routes on the Redis schedule (migration 0016; the schedule
    reads its copy in ``proxy_ws_cadence``, :mod:`magpie.queue.cadence`).
    """

    __tablename__ = "check_profiles"
    __table_args__ = (
        sa.CheckConstraint("judge_pool IN ('global', 'workspace')", name="judge_pool"),
        sa.CheckConstraint("rule IS NULL OR " + RULES_CHECK, name="rule"),
        sa.CheckConstraint("timeout IS NULL OR timeout > 0", name="timeout"),
        sa.CheckConstraint("attempts IS NULL OR attempts >= 1", name="attempts"),
        sa.CheckConstraint("auto_remove_after IS NULL OR auto_remove_after >= 1", name="auto_remove_after"),
        sa.CheckConstraint("check_interval IS NULL OR check_interval >= 1", name="check_interval"),
        sa.CheckConstraint("(dead_after IS NULL AND dead_factor IS NULL) OR (dead_after >= 1 AND dead_factor >= 2)",
                           name="dead_policy"),
    )

    workspace_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), primary_key=True)
    protocols: Mapped[list[str] | None] = mapped_column(pg.ARRAY(sa.Text), nullable=True)
    timeout: Mapped[float | None] = mapped_column(sa.REAL, nullable=True)
    attempts: Mapped[int | None] = mapped_column(sa.SmallInteger, nullable=True)
    judge_pool: Mapped[str] = mapped_column(sa.Text, nullable=False, server_default="global")
    rule: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    auto_remove_after: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    check_interval: Mapped[float | None] = mapped_column(sa.REAL, nullable=True)
    dead_after: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    dead_factor: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class RouteFailure(Base):
    """Consecutive failed checks of a route as one workspace's profile tested it (0 after an alive one).

    A row exists only while the route's owners are checked differently (per-owner outcomes); otherwise
    the owner's streak is the route's (``route_health.consecutive_failures``). ``last_checked_at`` is the
    newest outcome counted: a row older than the route's newest check is stale and the route's streak
    applies (:data:`magpie.judges.failures.STREAK_SQL`).
    """

    __tablename__ = "route_failures"
    __table_args__ = (
        sa.Index("ix_route_failures_route_id", "route_id"),
        sa.Index("ix_route_failures_workspace_id_consecutive_failures", "workspace_id", "consecutive_failures"),
    )

    workspace_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), primary_key=True)
    route_id: Mapped[int] = mapped_column(
        sa.BigInteger, sa.ForeignKey("routes.id", ondelete="CASCADE"), primary_key=True)
    consecutive_failures: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="0")
    last_failed_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    last_checked_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class CheckConfigRevision(Base):
    """The revision of judges and profiles (one row, scope ``checks``), raised by every change."""

    __tablename__ = "check_config_revisions"

    scope: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    revision: Mapped[int] = mapped_column(sa.BigInteger, nullable=False, server_default="0")
    changed_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


__all__ = ["CheckConfigRevision", "CheckProfile", "Judge", "RouteFailure"]
