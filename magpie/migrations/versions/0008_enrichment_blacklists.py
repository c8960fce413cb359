"""Route enrichment and blacklists.

Revision ID: 0008
Revises: 0007

* ``route_enrichment``: country, ASN, AS organisation, network-type guess, GeoIP revision and abuse score
  per route.
* ``blacklist_sources`` / ``blacklist_entries``: operator-managed sources and their addresses and ranges
  (``cidr``, GiST ``inet_ops`` index for containment).
* ``blacklist_policies``: per workspace ``flag`` / ``skip`` / ``remove``.
* ``route_blacklist``: listed routes with the matching source and range.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TSTZ = sa.DateTime(timezone=True)
NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "route_enrichment",
        sa.Column("route_id", sa.BigInteger, nullable=False),
        sa.Column("country", sa.Text, nullable=True),
        sa.Column("asn", sa.BigInteger, nullable=True),
        sa.Column("as_org", sa.Text, nullable=True),
        sa.Column("network_type", sa.Text, nullable=True),
        sa.Column("geo_revision", sa.Text, nullable=True),
        sa.Column("enriched_at", TSTZ, nullable=False, server_default=NOW),
        sa.Column("abuse_score", sa.SmallInteger, nullable=True),
        sa.Column("abuse_checked_at", TSTZ, nullable=True),
        sa.PrimaryKeyConstraint("route_id", name="pk_route_enrichment"),
        sa.ForeignKeyConstraint(["route_id"], ["routes.id"], ondelete="CASCADE",
                                name="fk_route_enrichment_route_id_routes"),
        sa.CheckConstraint("abuse_score IS NULL OR abuse_score BETWEEN 0 AND 100",
                           name="ck_route_enrichment_abuse_score"),
    )
    op.create_index("ix_route_enrichment_geo_revision", "route_enrichment", ["geo_revision"])

    op.create_table(
        "blacklist_sources",
        sa.Column("id", sa.Integer, sa.Identity(), nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("location", sa.Text, nullable=False),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("entries", sa.Integer, nullable=False, server_default="0"),
        sa.Column("content_hash", sa.Text, nullable=True),
        sa.Column("refreshed_at", TSTZ, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("last_error_at", TSTZ, nullable=True),
        sa.Column("created_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("id", name="pk_blacklist_sources"),
        sa.UniqueConstraint("name", name="uq_blacklist_sources_name"),
    )
    op.create_table(
        "blacklist_entries",
        sa.Column("id", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("source_id", sa.Integer, nullable=False),
        sa.Column("network", pg.CIDR, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_blacklist_entries"),
        sa.ForeignKeyConstraint(["source_id"], ["blacklist_sources.id"], ondelete="CASCADE",
                                name="fk_blacklist_entries_source_id_blacklist_sources"),
        sa.UniqueConstraint("source_id", "network", name="uq_blacklist_entries_source_id_network"),
    )
    op.create_index("ix_blacklist_entries_network", "blacklist_entries", ["network"], postgresql_using="gist",
                    postgresql_ops={"network": "inet_ops"})
    op.create_table(
        "blacklist_policies",
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("policy", sa.Text, nullable=False),
        sa.Column("updated_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("workspace_id", name="pk_blacklist_policies"),
        sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                name="fk_blacklist_policies_workspace_id_workspaces"),
        sa.CheckConstraint("policy IN ('flag', 'skip', 'remove')", name="ck_blacklist_policies_policy"),
    )
    op.create_table(
        "route_blacklist",
        sa.Column("route_id", sa.BigInteger, nullable=False),
        sa.Column("source_id", sa.Integer, nullable=False),
        sa.Column("network", pg.CIDR, nullable=False),
        sa.Column("unscheduled", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("flagged_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("route_id", name="pk_route_blacklist"),
        sa.ForeignKeyConstraint(["route_id"], ["routes.id"], ondelete="CASCADE",
                                name="fk_route_blacklist_route_id_routes"),
        sa.ForeignKeyConstraint(["source_id"], ["blacklist_sources.id"], ondelete="CASCADE",
                                name="fk_route_blacklist_source_id_blacklist_sources"),
    )
    op.create_index("ix_route_blacklist_source_id", "route_blacklist", ["source_id"])


def downgrade() -> None:
    op.drop_table("route_blacklist")
    op.drop_table("blacklist_policies")
    op.drop_table("blacklist_entries")
    op.drop_table("blacklist_sources")
    op.drop_table("route_enrichment")
