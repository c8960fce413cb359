"""Judge pools, check profiles, failure streaks per workspace and the check-config revision.

Revision ID: 0007
Revises: 0006

* ``judges``: judge URLs of the global pool (``workspace_id`` NULL) or of a workspace, with the refresh
  job's health verdict and resolved addresses; unique per scope and URL.
* ``check_profiles``: per workspace, protocols, timeout, attempts, judge pool, valid-answer rule and
  auto-remove threshold.
* ``route_failures``: consecutive failures per (workspace, route) while owners are checked differently.
* ``check_config_revisions``: the revision raised by every change of judges or profiles (row ``checks``).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TSTZ = sa.DateTime(timezone=True)
NOW = sa.text("now()")
RULES = "rule = 'echo' OR rule = 'status' OR rule LIKE 'contains:%'"


def upgrade() -> None:
    op.create_table(
        "judges",
        sa.Column("id", sa.Integer, sa.Identity(), nullable=False),
        sa.Column("workspace_id", sa.Integer, nullable=True),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("scheme", sa.Text, nullable=False),
        sa.Column("rule", sa.Text, nullable=False, server_default="echo"),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("healthy", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("last_checked_at", TSTZ, nullable=True),
        sa.Column("last_ok_at", TSTZ, nullable=True),
        sa.Column("addresses", pg.JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("addresses_until", TSTZ, nullable=True),
        sa.Column("created_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("id", name="pk_judges"),
        sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                name="fk_judges_workspace_id_workspaces"),
        sa.CheckConstraint("scheme IN ('http', 'https')", name="ck_judges_scheme"),
        sa.CheckConstraint(RULES, name="ck_judges_rule"),
    )
    op.create_index("ix_judges_scope_url", "judges", [sa.text("coalesce(workspace_id, 0)"), "url"], unique=True)
    op.create_index("ix_judges_workspace_id", "judges", ["workspace_id"])

    op.create_table(
        "check_profiles",
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("protocols", pg.ARRAY(sa.Text), nullable=True),
        sa.Column("timeout", sa.REAL, nullable=True),
        sa.Column("attempts", sa.SmallInteger, nullable=True),
        sa.Column("judge_pool", sa.Text, nullable=False, server_default="global"),
        sa.Column("rule", sa.Text, nullable=True),
        sa.Column("auto_remove_after", sa.Integer, nullable=True),
        sa.Column("updated_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("workspace_id", name="pk_check_profiles"),
        sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                name="fk_check_profiles_workspace_id_workspaces"),
        sa.CheckConstraint("judge_pool IN ('global', 'workspace')", name="ck_check_profiles_judge_pool"),
        sa.CheckConstraint("rule IS NULL OR " + RULES, name="ck_check_profiles_rule"),
        sa.CheckConstraint("timeout IS NULL OR timeout > 0", name="ck_check_profiles_timeout"),
        sa.CheckConstraint("attempts IS NULL OR attempts >= 1", name="ck_check_profiles_attempts"),
        sa.CheckConstraint("auto_remove_after IS NULL OR auto_remove_after >= 1",
                           name="ck_check_profiles_auto_remove_after"),
    )

    op.create_table(
        "route_failures",
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("route_id", sa.BigInteger, nullable=False),
        sa.Column("consecutive_failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_failed_at", TSTZ, nullable=True),
        sa.Column("last_checked_at", TSTZ, nullable=True),
        sa.Column("updated_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("workspace_id", "route_id", name="pk_route_failures"),
        sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                name="fk_route_failures_workspace_id_workspaces"),
        sa.ForeignKeyConstraint(["route_id"], ["routes.id"], ondelete="CASCADE",
                                name="fk_route_failures_route_id_routes"),
    )
    op.create_index("ix_route_failures_route_id", "route_failures", ["route_id"])
    op.create_index("ix_route_failures_workspace_id_consecutive_failures", "route_failures",
                    ["workspace_id", "consecutive_failures"])

    op.create_table(
        "check_config_revisions",
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column("revision", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("changed_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("scope", name="pk_check_config_revisions"),
    )
    op.execute("INSERT INTO check_config_revisions (scope, revision) VALUES ('checks', 1)")


def downgrade() -> None:
    op.drop_table("check_config_revisions")
    op.drop_index("ix_route_failures_workspace_id_consecutive_failures", table_name="route_failures")
    op.drop_index("ix_route_failures_route_id", table_name="route_failures")
    op.drop_table("route_failures")
    op.drop_table("check_profiles")
    op.drop_index("ix_judges_workspace_id", table_name="judges")
    op.drop_index("ix_judges_scope_url", table_name="judges")
    op.drop_table("judges")
