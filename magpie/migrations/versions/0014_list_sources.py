"""Proxy-list sources fetched on a schedule (list_sources, list_source_routes).

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TSTZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "list_sources",
        sa.Column("id", sa.Integer, sa.Identity(), nullable=False),
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("url_enc", sa.Text, nullable=False),
        sa.Column("url_shown", sa.Text, nullable=False),
        sa.Column("url_key", sa.Text, nullable=False),
        sa.Column("format", sa.Text, nullable=False, server_default="auto"),
        sa.Column("protocol", sa.Text, nullable=False, server_default="http"),
        sa.Column("every_s", sa.Integer, nullable=False),
        sa.Column("browser", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("ignore_robots", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("etag", sa.Text, nullable=True),
        sa.Column("last_modified", sa.Text, nullable=True),
        sa.Column("last_fetch_at", TSTZ, nullable=True),
        sa.Column("last_status", sa.Text, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("last_bytes", sa.Integer, nullable=True),
        sa.Column("last_valid", sa.Integer, nullable=True),
        sa.Column("last_imported", sa.Integer, nullable=True),
        sa.Column("last_invalid", sa.Integer, nullable=True),
        sa.Column("last_ok_at", TSTZ, nullable=True),
        sa.Column("consecutive_failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("dead_lettered", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("dead_lettered_at", TSTZ, nullable=True),
        sa.Column("created_at", TSTZ, nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("id", name="pk_list_sources"),
        sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                name="fk_list_sources_workspace_id_workspaces"),
        sa.UniqueConstraint("workspace_id", "url_key", name="uq_list_sources_workspace_id_url_key"),
        sa.CheckConstraint("every_s >= 60", name="ck_list_sources_every"),
    )
    op.create_table(
        "list_source_routes",
        sa.Column("source_id", sa.Integer, nullable=False),
        sa.Column("route_id", sa.BigInteger, nullable=False),
        sa.Column("last_seen_at", TSTZ, nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("source_id", "route_id", name="pk_list_source_routes"),
        sa.ForeignKeyConstraint(["source_id"], ["list_sources.id"], ondelete="CASCADE",
                                name="fk_list_source_routes_source_id_list_sources"),
        sa.ForeignKeyConstraint(["route_id"], ["routes.id"], ondelete="CASCADE",
                                name="fk_list_source_routes_route_id_routes"),
    )
    op.create_index("ix_list_source_routes_route_id", "list_source_routes", ["route_id"])


def downgrade() -> None:
    op.drop_index("ix_list_source_routes_route_id", table_name="list_source_routes")
    op.drop_table("list_source_routes")
    op.drop_table("list_sources")
