"""Tables of the proxy-list sources (schema in migration ``0012_list_sources``).

* ``list_sources``: one URL a proxy list is fetched from on a schedule, into one workspace. The URL is kept
  encrypted (``url_enc``, Fernet under ``PROXY_ENCRYPTION_KEY``: it may carry credentials or a token);
  ``url_shown`` is its redacted form, the only one ever printed; ``url_key`` is a keyed hash telling two
  sources of the same URL in one workspace apart. Beside it: the fetch options, the validators of the last
  good reply (``etag``, ``last_modified``) and the outcome of the last fetch.
* ``list_source_routes``: the routes a source's lists brought (one row per source and route), so the
  statistics can count per source.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from magpie.db.models import Base

_now = sa.text("now()")
TSTZ = sa.DateTime(timezone=True)


class ListSource(Base):
    """A proxy-list URL fetched every ``every_s`` seconds into ``workspace_id``."""

    __tablename__ = "list_sources"
    __table_args__ = (
        sa.UniqueConstraint("workspace_id", "url_key", name="uq_list_sources_workspace_id_url_key"),
        sa.CheckConstraint("every_s >= 60", name="every"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, sa.Identity(), primary_key=True)
    workspace_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False)
    url_enc: Mapped[str] = mapped_column(sa.Text, nullable=False)
    url_shown: Mapped[str] = mapped_column(sa.Text, nullable=False)
    url_key: Mapped[str] = mapped_column(sa.Text, nullable=False)
    format: Mapped[str] = mapped_column(sa.Text, nullable=False, server_default="auto")
    protocol: Mapped[str] = mapped_column(sa.Text, nullable=False, server_default="http")
    every_s: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    browser: Mapped[bool] = mapped_column(sa.Boolean, nullable=False, server_default=sa.false())
    ignore_robots: Mapped[bool] = mapped_column(sa.Boolean, nullable=False, server_default=sa.false())
    etag: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    last_modified: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    last_fetch_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    last_status: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    last_error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    last_bytes: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    last_valid: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    last_imported: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    last_invalid: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    last_ok_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    consecutive_failures: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="0")
    dead_lettered: Mapped[bool] = mapped_column(sa.Boolean, nullable=False, server_default=sa.false())
    dead_lettered_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    created_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class ListSourceRoute(Base):
    """A route some fetch of a source brought into the source's workspace."""

    __tablename__ = "list_source_routes"
    __table_args__ = (sa.Index("ix_list_source_routes_route_id", "route_id"),)

    source_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("list_sources.id", ondelete="CASCADE"), primary_key=True)
    route_id: Mapped[int] = mapped_column(
        sa.BigInteger, sa.ForeignKey("routes.id", ondelete="CASCADE"), primary_key=True)
    last_seen_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


__all__ = ["ListSource", "ListSourceRoute"]
