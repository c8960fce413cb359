"""Leader fencing: the newest generation of each leader lock that wrote shared state.

Revision ID: 0005
Revises: 0004

``leader_fences`` holds one row per leader lock (its Redis key): the newest generation (fencing token,
:attr:`magpie.coordination.leader.LeaderLock.generation`) that made a protected write. A write under an older
generation is refused (:func:`magpie.coordination.fencing.fence`).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "leader_fences",
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("name", name="pk_leader_fences"),
    )


def downgrade() -> None:
    op.drop_table("leader_fences")
