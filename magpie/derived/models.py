"""Tables of the derived data (schema in migration ``0009``): reputation, rollups and import sources.

* ``route_reputation``: the newest reputation score of a route with its five components.
* ``reputation_dirty``: routes whose reputation must be recomputed (marked by ingestion).
* ``route_sources``: which import file or list brought a route into a workspace.
* ``workspace_snapshots``: alive and total routes per workspace and protocol, one row per 10-minute slot.
* ``hourly_counts``: checks and routes checked per workspace and UTC hour.
* ``source_stats``: current figures per workspace and import source.
* ``workspace_usage``: per workspace and UTC day, routes owned, sources, checks run.

Every table is written by a maintenance job (:mod:`magpie.derived.jobs`) by recomputing and replacing
rows, never by adding to them, so a repeated pass changes nothing.
"""

from __future__ import annotations

from datetime import date, datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.orm import Mapped, mapped_column

from magpie.db.models import Base

_now = sa.text("now()")
TSTZ = sa.DateTime(timezone=True)


def _route_fk():
    return sa.ForeignKey("routes.id", ondelete="CASCADE")


def _workspace_fk():
    return sa.ForeignKey("workspaces.id", ondelete="CASCADE")


class RouteReputation(Base):
    """Reputation of one route: ``score`` 0-100 and its ``label`` (good, neutral, poor).

    The components (``uptime``, ``recency``, ``latency``, ``anonymity``, ``streak``) are each in [0, 1];
    see docs/derived-data.md for their formulas. ``checks`` is the number of checks in the window the
    score was computed from; ``computed_at`` when it was computed.
    """

    __tablename__ = "route_reputation"
    __table_args__ = (
        sa.CheckConstraint("label IN ('good', 'neutral', 'poor')", name="label"),
        sa.Index("ix_route_reputation_label_score", "label", "score"),
        sa.Index("ix_route_reputation_computed_at", "computed_at"),
    )

    route_id: Mapped[int] = mapped_column(sa.BigInteger, _route_fk(), primary_key=True)
    score: Mapped[float] = mapped_column(sa.REAL, nullable=False)
    label: Mapped[str] = mapped_column(sa.Text, nullable=False)
    uptime: Mapped[float] = mapped_column(sa.REAL, nullable=False)
    recency: Mapped[float] = mapped_column(sa.REAL, nullable=False)
    latency: Mapped[float] = mapped_column(sa.REAL, nullable=False)
    anonymity: Mapped[float] = mapped_column(sa.REAL, nullable=False)
    streak: Mapped[float] = mapped_column(sa.REAL, nullable=False)
    checks: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    computed_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class ReputationDirty(Base):
    """A route whose reputation is out of date (a result was ingested since it was last computed)."""

    __tablename__ = "reputation_dirty"

    route_id: Mapped[int] = mapped_column(sa.BigInteger, _route_fk(), primary_key=True)
    marked_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class RouteSource(Base):
    """A route was imported into a workspace from ``source`` (an import file's base name or a list name)."""

    __tablename__ = "route_sources"
    __table_args__ = (sa.Index("ix_route_sources_workspace_id_source", "workspace_id", "source"),)

    route_id: Mapped[int] = mapped_column(sa.BigInteger, _route_fk(), primary_key=True)
    workspace_id: Mapped[int] = mapped_column(sa.Integer, _workspace_fk(), primary_key=True)
    source: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    first_seen_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)
    last_seen_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class WorkspaceSnapshot(Base):
    """Routes of one workspace and protocol at one 10-minute slot (``taken_at``, slot start, UTC):
    ``alive`` (newest result alive) and ``total``."""

    __tablename__ = "workspace_snapshots"
    __table_args__ = (sa.Index("ix_workspace_snapshots_taken_at", "taken_at"),)

    workspace_id: Mapped[int] = mapped_column(sa.Integer, _workspace_fk(), primary_key=True)
    taken_at: Mapped[datetime] = mapped_column(TSTZ, primary_key=True)
    protocol: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    alive: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    total: Mapped[int] = mapped_column(sa.Integer, nullable=False)


class HourlyCount(Base):
    """Checks of one workspace's routes in one UTC hour (``hour``, hour start): ``checks``, ``alive``
    (alive checks), ``routes_checked`` and ``routes_alive`` (distinct routes with a check / an alive one)."""

    __tablename__ = "hourly_counts"
    __table_args__ = (sa.Index("ix_hourly_counts_hour", "hour"),)

    workspace_id: Mapped[int] = mapped_column(sa.Integer, _workspace_fk(), primary_key=True)
    hour: Mapped[datetime] = mapped_column(TSTZ, primary_key=True)
    checks: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    alive: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    routes_checked: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    routes_alive: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class SourceStat(Base):
    """Current figures of the routes one source brought into one workspace: ``routes``, ``alive``
    (newest result alive), ``checked`` (checked at least once), ``latency_avg_ms`` (ms, newest results
    that measured one), ``score_avg`` (mean reputation); ``refreshed_at`` of the pass that wrote it."""

    __tablename__ = "source_stats"
    __table_args__ = (sa.Index("ix_source_stats_refreshed_at", "refreshed_at"),)

    workspace_id: Mapped[int] = mapped_column(sa.Integer, _workspace_fk(), primary_key=True)
    source: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    routes: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    alive: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    checked: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    latency_avg_ms: Mapped[float | None] = mapped_column(sa.REAL, nullable=True)
    score_avg: Mapped[float | None] = mapped_column(sa.REAL, nullable=True)
    refreshed_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class WorkspaceUsage(Base):
    """Usage of one workspace on one UTC day: ``routes`` owned and ``sources`` at the last refresh of that
    day, ``checks`` and ``alive_checks`` run that day."""

    __tablename__ = "workspace_usage"
    __table_args__ = (sa.Index("ix_workspace_usage_day", "day"),)

    workspace_id: Mapped[int] = mapped_column(sa.Integer, _workspace_fk(), primary_key=True)
    day: Mapped[date] = mapped_column(sa.Date, primary_key=True)
    routes: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    sources: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    checks: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    alive_checks: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class DashboardSnapshot(Base):
    """One stored chart sample of the dashboard (job ``dashboard_snapshot``, migration ``0012``): the
    cumulative counters and schedule totals of :func:`magpie.observability.samples.take_sample` as JSON."""

    __tablename__ = "dashboard_snapshots"
    __table_args__ = (sa.Index("ix_dashboard_snapshots_taken_at", "taken_at"),)

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    taken_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)
    sample: Mapped[dict] = mapped_column(pg.JSONB, nullable=False)


__all__ = ["DashboardSnapshot", 
    "HourlyCount",
    "ReputationDirty",
    "RouteReputation",
    "RouteSource",
    "SourceStat",
    "WorkspaceSnapshot",
    "WorkspaceUsage",
]
