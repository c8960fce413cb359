"""PostgreSQL schedule: routes table, per-schedule state, results outbox.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RANK_SQL = "CASE WHEN lease_expires_at IS NOT NULL THEN 1 WHEN retry THEN 0 ELSE 2 END"


def upgrade() -> None:
    op.create_table(
        "schedule_routes",
        sa.Column("schedule", sa.Text, nullable=False),
        sa.Column("route", sa.Text(collation="C"), nullable=False),
        sa.Column("shard", sa.Text(collation="C"), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True)),
        sa.Column("retry", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True)),
        sa.Column("lease_token", sa.Text),
        sa.Column("leased_at", sa.DateTime(timezone=True)),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True)),
        sa.Column("stalls", sa.Integer, nullable=False, server_default="0"),
        sa.Column("suspect", sa.Integer, nullable=False, server_default="0"),
        sa.Column("start_mark", sa.Text),
        sa.Column("retries", sa.Integer, nullable=False, server_default="0"),
        sa.Column("progress", sa.Text),
        sa.Column("logs", pg.ARRAY(sa.Text), nullable=False, server_default="{}"),
        sa.Column("last_silent_ms", sa.BigInteger),
        sa.Column("dead_at", sa.DateTime(timezone=True)),
        sa.Column("dead_reason", pg.JSONB),
        sa.Column("rank", sa.SmallInteger, sa.Computed(RANK_SQL, persisted=True)),
        sa.PrimaryKeyConstraint("schedule", "route", name="pk_schedule_routes"),
        postgresql_with={"fillfactor": 70},
    )
    op.create_index("ix_schedule_routes_claim", "schedule_routes", ["schedule", "due_at", "rank", "shard", "route"],
                    postgresql_where=sa.text("due_at IS NOT NULL"))
    op.create_index("ix_schedule_routes_lease", "schedule_routes", ["schedule", "lease_expires_at"],
                    postgresql_where=sa.text("lease_expires_at IS NOT NULL"))
    op.create_index("ix_schedule_routes_dead", "schedule_routes", ["schedule", "dead_at"],
                    postgresql_where=sa.text("dead_at IS NOT NULL"))
    op.create_table(
        "schedule_meta",
        sa.Column("schedule", sa.Text, primary_key=True),
        sa.Column("shards", sa.Integer, nullable=False),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_table(
        "schedule_results",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("schedule", sa.Text, nullable=False),
        sa.Column("stream", sa.Text, nullable=False),
        sa.Column("grp", sa.Text, nullable=False),
        sa.Column("fields", pg.JSONB, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
    )
    op.create_index("ix_schedule_results_schedule", "schedule_results", ["schedule", "id"])


def downgrade() -> None:
    op.drop_table("schedule_results")
    op.drop_table("schedule_meta")
    op.drop_table("schedule_routes")
