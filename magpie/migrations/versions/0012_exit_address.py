"""The exit address: what the judge saw a proxy connect from, apart from the route's entry address.

``check_history.exit_ip``; ``route_health.exit_ip`` with its GeoIP enrichment (``exit_country``,
``exit_asn``, ``exit_geo_revision``) and an index for the exit-country filter.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # adding a nullable column without a default is a catalogue change only (no table rewrite)
    op.add_column("check_history", sa.Column("exit_ip", sa.Text, nullable=True))
    op.add_column("route_health", sa.Column("exit_ip", sa.Text, nullable=True))
    op.add_column("route_health", sa.Column("exit_country", sa.Text, nullable=True))
    op.add_column("route_health", sa.Column("exit_asn", sa.BigInteger, nullable=True))
    op.add_column("route_health", sa.Column("exit_geo_revision", sa.Text, nullable=True))
    op.create_index("ix_route_health_exit_country", "route_health", ["exit_country"],
                    postgresql_where=sa.text("exit_country IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_route_health_exit_country", table_name="route_health")
    for col in ("exit_geo_revision", "exit_asn", "exit_country", "exit_ip"):
        op.drop_column("route_health", col)
    op.drop_column("check_history", "exit_ip")
