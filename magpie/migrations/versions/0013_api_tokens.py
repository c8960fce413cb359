"""API tokens: the ``api_tokens`` table (:class:`magpie.apitokens.models.ApiToken`).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer, sa.Identity(), nullable=False),
        sa.Column("name", sa.Text, nullable=True),
        sa.Column("token_hash", sa.Text, nullable=False),
        sa.Column("prefix", sa.Text, nullable=False),
        sa.Column("workspace_id", sa.Integer, nullable=True),
        sa.Column("role", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_tokens"),
        sa.UniqueConstraint("token_hash", name="uq_api_tokens_token_hash"),
        sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                name="fk_api_tokens_workspace_id_workspaces"),
        sa.CheckConstraint("role IN ('read', 'operate', 'admin')", name="ck_api_tokens_role"),
        sa.CheckConstraint("workspace_id IS NOT NULL OR role = 'admin'", name="ck_api_tokens_workspace"),
    )
    op.create_index("ix_api_tokens_workspace_id", "api_tokens", ["workspace_id"])


def downgrade() -> None:
    op.drop_index("ix_api_tokens_workspace_id", table_name="api_tokens")
    op.drop_table("api_tokens")
