"""Check profiles carry a cadence: ``check_profiles.check_interval`` (seconds) and the dead-route policy
``dead_after`` / ``dead_factor`` (both or neither), NULL: the workspace's or the deployment's.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("check_profiles", sa.Column("check_interval", sa.REAL(), nullable=True))
    op.add_column("check_profiles", sa.Column("dead_after", sa.Integer(), nullable=True))
    op.add_column("check_profiles", sa.Column("dead_factor", sa.Integer(), nullable=True))
    op.create_check_constraint("check_interval", "check_profiles", "check_interval IS NULL OR check_interval >= 1")
    op.create_check_constraint(
        "dead_policy", "check_profiles",
        "(dead_after IS NULL AND dead_factor IS NULL) OR (dead_after >= 1 AND dead_factor >= 2)")


def downgrade() -> None:
    op.drop_constraint("dead_policy", "check_profiles", type_="check")
    op.drop_constraint("check_interval", "check_profiles", type_="check")
    op.drop_column("check_profiles", "dead_factor")
    op.drop_column("check_profiles", "dead_after")
    op.drop_column("check_profiles", "check_interval")
