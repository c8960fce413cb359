"""The deployment key fingerprint: which ``PROXY_ENCRYPTION_KEY`` this database belongs to.

Revision ID: 0004
Revises: 0003

One row (``id = 1``) holding :func:`magpie.base.crypto.key_fingerprint` of the key the database was first used
with; written by ``magpie db upgrade`` or the first process that uses the database, compared by every
process at start (:mod:`magpie.db.keycheck`).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "deployment_keys",
        sa.Column("id", sa.SmallInteger, autoincrement=False, nullable=False),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("id", name="pk_deployment_keys"),
        sa.CheckConstraint("id = 1", name="ck_deployment_keys_single_row"),
    )


def downgrade() -> None:
    op.drop_table("deployment_keys")
