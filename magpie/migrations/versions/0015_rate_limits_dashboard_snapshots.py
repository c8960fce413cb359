"""Judge rate limits and stored dashboard snapshots.

``judges.rate``: requests per second a judge takes from the whole deployment (NULL: ``MAGPIE_JUDGE_RATE``,
0: unlimited). ``dashboard_snapshots``: one row per pass of the ``dashboard_snapshot`` job (the chart
sample as JSON), kept for ``MAGPIE_DASHBOARD_SNAPSHOT_RETENTION_DAYS``.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("judges", sa.Column("rate", sa.REAL(), nullable=True))
    op.create_check_constraint("rate", "judges", "rate IS NULL OR rate >= 0")
    op.create_table(
        "dashboard_snapshots",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("sample", pg.JSONB(), nullable=False),
    )
    op.create_index("ix_dashboard_snapshots_taken_at", "dashboard_snapshots", ["taken_at"])


def downgrade() -> None:
    op.drop_index("ix_dashboard_snapshots_taken_at", table_name="dashboard_snapshots")
    op.drop_table("dashboard_snapshots")
    op.drop_constraint("rate", "judges", type_="check")
    op.drop_column("judges", "rate")
