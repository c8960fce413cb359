"""Rotating listeners: the ``rotators`` table (:class:`magpie.rotator.models.Rotator`) and rotator-scoped
alert rules (``alert_rules.rotator_id``).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rotators",
        sa.Column("id", sa.Integer, sa.Identity(), nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("listen", sa.Text, nullable=False, server_default="http,socks5"),
        sa.Column("port", sa.Integer, nullable=False),
        sa.Column("username", sa.Text, nullable=True),
        sa.Column("password_enc", sa.Text, nullable=True),
        sa.Column("filters", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("policy", sa.Text, nullable=False, server_default="next"),
        sa.Column("sticky_seconds", sa.Integer, nullable=False, server_default="0"),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("instance_id", sa.Text, nullable=True),
        sa.Column("assigned_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revision", sa.BigInteger, nullable=False, server_default="1"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("id", name="pk_rotators"),
        sa.UniqueConstraint("name", name="uq_rotators_name"),
        sa.UniqueConstraint("port", name="uq_rotators_port"),
        sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                name="fk_rotators_workspace_id_workspaces"),
        sa.CheckConstraint("port BETWEEN 1 AND 65535", name="ck_rotators_port"),
        sa.CheckConstraint("policy IN ('next', 'sticky')", name="ck_rotators_policy"),
    )
    op.create_index("ix_rotators_instance_id", "rotators", ["instance_id"])
    op.create_index("ix_rotators_workspace_id", "rotators", ["workspace_id"])
    op.add_column("alert_rules", sa.Column("rotator_id", sa.Integer, nullable=True))
    op.create_foreign_key("fk_alert_rules_rotator_id_rotators", "alert_rules", "rotators", ["rotator_id"], ["id"],
                          ondelete="CASCADE")
    op.create_index("ix_alert_rules_rotator_id", "alert_rules", ["rotator_id"])


def downgrade() -> None:
    op.drop_index("ix_alert_rules_rotator_id", table_name="alert_rules")
    op.drop_constraint("fk_alert_rules_rotator_id_rotators", "alert_rules", type_="foreignkey")
    op.drop_column("alert_rules", "rotator_id")
    op.drop_table("rotators")
