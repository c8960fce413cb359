"""Tables of the blacklists (schema in migration ``0008_enrichment_blacklists``).

* ``blacklist_sources``: one operator-managed source (a file path or an ``http(s)`` URL) with the outcome
  of its last refresh (content hash, entry count, error).
* ``blacklist_entries``: the addresses and CIDR ranges of a source (PostgreSQL ``cidr``; a GiST index with
  ``inet_ops`` answers "which range holds this address").
* ``blacklist_policies``: per workspace, what a listed route becomes: ``flag``, ``skip`` or ``remove``
  (a workspace without a row takes ``MAGPIE_BLACKLIST_POLICY``).
* ``route_blacklist``: the listed routes (the first matching source and range), kept by the refresh job;
  ``unscheduled`` marks a route taken off the schedule because no owning workspace wants it checked.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.orm import Mapped, mapped_column

from magpie.db.models import Base

_now = sa.text("now()")
TSTZ = sa.DateTime(timezone=True)
POLICIES = ("flag", "skip", "remove")


class BlacklistSource(Base):
    """A blacklist source; ``location`` is a file path or an ``http(s)://`` URL."""

    __tablename__ = "blacklist_sources"

    id: Mapped[int] = mapped_column(sa.Integer, sa.Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(sa.Text, nullable=False, unique=True)
    location: Mapped[str] = mapped_column(sa.Text, nullable=False)
    enabled: Mapped[bool] = mapped_column(sa.Boolean, nullable=False, server_default=sa.true())
    entries: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="0")
    content_hash: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    refreshed_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    last_error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    last_error_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    created_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class BlacklistEntry(Base):
    """One address (a /32 or /128) or range of a source."""

    __tablename__ = "blacklist_entries"
    __table_args__ = (
        sa.UniqueConstraint("source_id", "network", name="uq_blacklist_entries_source_id_network"),
        sa.Index("ix_blacklist_entries_network", "network", postgresql_using="gist",
                 postgresql_ops={"network": "inet_ops"}),
    )

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    source_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("blacklist_sources.id", ondelete="CASCADE"), nullable=False
    )
    network: Mapped[str] = mapped_column(pg.CIDR, nullable=False)


class BlacklistPolicy(Base):
    """What a listed route becomes in one workspace."""

    __tablename__ = "blacklist_policies"
    __table_args__ = (sa.CheckConstraint("policy IN ('flag', 'skip', 'remove')", name="policy"),)

    workspace_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), primary_key=True
    )
    policy: Mapped[str] = mapped_column(sa.Text, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class RouteBlacklist(Base):
    """A listed route: the first source (by id) whose range holds its address."""

    __tablename__ = "route_blacklist"
    __table_args__ = (sa.Index("ix_route_blacklist_source_id", "source_id"),)

    route_id: Mapped[int] = mapped_column(
        sa.BigInteger, sa.ForeignKey("routes.id", ondelete="CASCADE"), primary_key=True
    )
    source_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("blacklist_sources.id", ondelete="CASCADE"), nullable=False
    )
    network: Mapped[str] = mapped_column(pg.CIDR, nullable=False)
    unscheduled: Mapped[bool] = mapped_column(sa.Boolean, nullable=False, server_default=sa.false())
    flagged_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


__all__ = ["POLICIES", "BlacklistEntry", "BlacklistPolicy", "BlacklistSource", "RouteBlacklist"]
