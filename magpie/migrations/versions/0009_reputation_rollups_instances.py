"""Reputation, rollups and import sources (models: :mod:`magpie.derived.models`).

Revision ID: 0009
Revises: 0008

* ``route_reputation`` (score, label, components) and ``reputation_dirty`` (routes to recompute).
* ``route_sources``: the import file or list each route came from, per workspace.
* Rollups: ``workspace_snapshots`` (10-minute slots), ``hourly_counts``, ``source_stats``,
  ``workspace_usage`` (per UTC day).

Instance heartbeats live in Redis only (:mod:`magpie.coordination.instances`): no table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TSTZ = sa.DateTime(timezone=True)
NOW = sa.text("now()")


def _route_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["route_id"], ["routes.id"], ondelete="CASCADE",
                                   name=f"fk_{table}_route_id_routes")


def _ws_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                   name=f"fk_{table}_workspace_id_workspaces")


def upgrade() -> None:
    op.create_table(
        "route_reputation",
        sa.Column("route_id", sa.BigInteger, nullable=False),
        sa.Column("score", sa.REAL, nullable=False),
        sa.Column("label", sa.Text, nullable=False),
        sa.Column("uptime", sa.REAL, nullable=False),
        sa.Column("recency", sa.REAL, nullable=False),
        sa.Column("latency", sa.REAL, nullable=False),
        sa.Column("anonymity", sa.REAL, nullable=False),
        sa.Column("streak", sa.REAL, nullable=False),
        sa.Column("checks", sa.Integer, nullable=False),
        sa.Column("computed_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("route_id", name="pk_route_reputation"),
        sa.CheckConstraint("label IN ('good', 'neutral', 'poor')", name="ck_route_reputation_label"),
        _route_fk("route_reputation"),
    )
    op.create_index("ix_route_reputation_label_score", "route_reputation", ["label", "score"])
    op.create_index("ix_route_reputation_computed_at", "route_reputation", ["computed_at"])

    op.create_table(
        "reputation_dirty",
        sa.Column("route_id", sa.BigInteger, nullable=False),
        sa.Column("marked_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("route_id", name="pk_reputation_dirty"),
        _route_fk("reputation_dirty"),
    )

    op.create_table(
        "route_sources",
        sa.Column("route_id", sa.BigInteger, nullable=False),
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("first_seen_at", TSTZ, nullable=False, server_default=NOW),
        sa.Column("last_seen_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("route_id", "workspace_id", "source", name="pk_route_sources"),
        _route_fk("route_sources"),
        _ws_fk("route_sources"),
    )
    op.create_index("ix_route_sources_workspace_id_source", "route_sources", ["workspace_id", "source"])

    op.create_table(
        "workspace_snapshots",
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("taken_at", TSTZ, nullable=False),
        sa.Column("protocol", sa.Text, nullable=False),
        sa.Column("alive", sa.Integer, nullable=False),
        sa.Column("total", sa.Integer, nullable=False),
        sa.PrimaryKeyConstraint("workspace_id", "taken_at", "protocol", name="pk_workspace_snapshots"),
        _ws_fk("workspace_snapshots"),
    )
    op.create_index("ix_workspace_snapshots_taken_at", "workspace_snapshots", ["taken_at"])

    op.create_table(
        "hourly_counts",
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("hour", TSTZ, nullable=False),
        sa.Column("checks", sa.Integer, nullable=False),
        sa.Column("alive", sa.Integer, nullable=False),
        sa.Column("routes_checked", sa.Integer, nullable=False),
        sa.Column("routes_alive", sa.Integer, nullable=False),
        sa.Column("updated_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("workspace_id", "hour", name="pk_hourly_counts"),
        _ws_fk("hourly_counts"),
    )
    op.create_index("ix_hourly_counts_hour", "hourly_counts", ["hour"])

    op.create_table(
        "source_stats",
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("routes", sa.Integer, nullable=False),
        sa.Column("alive", sa.Integer, nullable=False),
        sa.Column("checked", sa.Integer, nullable=False),
        sa.Column("latency_avg_ms", sa.REAL, nullable=True),
        sa.Column("score_avg", sa.REAL, nullable=True),
        sa.Column("refreshed_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("workspace_id", "source", name="pk_source_stats"),
        _ws_fk("source_stats"),
    )
    op.create_index("ix_source_stats_refreshed_at", "source_stats", ["refreshed_at"])

    op.create_table(
        "workspace_usage",
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("day", sa.Date, nullable=False),
        sa.Column("routes", sa.Integer, nullable=False),
        sa.Column("sources", sa.Integer, nullable=False),
        sa.Column("checks", sa.Integer, nullable=False),
        sa.Column("alive_checks", sa.Integer, nullable=False),
        sa.Column("updated_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("workspace_id", "day", name="pk_workspace_usage"),
        _ws_fk("workspace_usage"),
    )
    op.create_index("ix_workspace_usage_day", "workspace_usage", ["day"])


def downgrade() -> None:
    for table in ("workspace_usage", "source_stats", "hourly_counts", "workspace_snapshots", "route_sources",
                  "reputation_dirty", "route_reputation"):
        op.drop_table(table)
