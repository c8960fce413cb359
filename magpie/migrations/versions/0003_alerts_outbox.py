"""Alerts (rules, rule state, incidents, channels, webhook deliveries) and the email outbox.

Revision ID: 0003
Revises: 0002

Delivery-style tables (``alert_deliveries``, ``email_outbox``) carry ``status``, ``attempts`` /
``max_attempts``, ``next_attempt_at``, ``claim_token`` and ``claim_expires_at``: workers claim rows with
``FOR UPDATE SKIP LOCKED`` and only the holder of the current token may record an outcome.

``invitations`` (written by :func:`magpie.outbox.create_invitation`) is created by revision 0002.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TSTZ = sa.DateTime(timezone=True)
NOW = sa.text("now()")


def _delivery_columns() -> list[sa.Column]:
    """Columns shared by the claimable delivery tables."""
    return [
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("attempts", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.SmallInteger, nullable=False, server_default="4"),
        sa.Column("next_attempt_at", TSTZ, nullable=False, server_default=NOW),
        sa.Column("claim_token", pg.UUID(as_uuid=False), nullable=True),
        sa.Column("claim_expires_at", TSTZ, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("created_at", TSTZ, nullable=False, server_default=NOW),
        sa.Column("updated_at", TSTZ, nullable=False, server_default=NOW),
        sa.Column("sent_at", TSTZ, nullable=True),
    ]


def _delivery_checks(table: str) -> list[sa.CheckConstraint]:
    return [
        sa.CheckConstraint(
            "status IN ('pending', 'processing', 'sent', 'failed')", name=f"ck_{table}_status"
        ),
        sa.CheckConstraint("max_attempts >= 1 AND attempts >= 0", name=f"ck_{table}_attempts"),
        sa.CheckConstraint(
            "(status = 'processing') = (claim_token IS NOT NULL AND claim_expires_at IS NOT NULL)",
            name=f"ck_{table}_claim",
        ),
    ]


def upgrade() -> None:
    op.create_table(
        "alert_rules",
        sa.Column("id", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("threshold", sa.Float, nullable=False),
        sa.Column("percentile", sa.SmallInteger, nullable=True),
        sa.Column("protocols", pg.ARRAY(sa.Text), nullable=True),
        sa.Column("min_samples", sa.Integer, nullable=False, server_default="1"),
        sa.Column("freshness_s", sa.Integer, nullable=True),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("revision", sa.Integer, nullable=False, server_default="1"),
        sa.Column("created_at", TSTZ, nullable=False, server_default=NOW),
        sa.Column("updated_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("id", name="pk_alert_rules"),
        sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                name="fk_alert_rules_workspace_id_workspaces"),
        sa.UniqueConstraint("workspace_id", "name", name="uq_alert_rules_workspace_id"),
        sa.CheckConstraint("kind IN ('usable_routes', 'success_rate', 'latency')", name="ck_alert_rules_kind"),
        sa.CheckConstraint(
            "(kind = 'latency' AND percentile IN (50, 95)) OR (kind <> 'latency' AND percentile IS NULL)",
            name="ck_alert_rules_percentile",
        ),
        sa.CheckConstraint("min_samples >= 1", name="ck_alert_rules_min_samples"),
        sa.CheckConstraint("freshness_s IS NULL OR freshness_s > 0", name="ck_alert_rules_freshness"),
    )
    op.create_index("ix_alert_rules_workspace_id", "alert_rules", ["workspace_id"])

    op.create_table(
        "alert_incidents",
        sa.Column("id", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("rule_id", sa.BigInteger, nullable=False),
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("rule_revision", sa.Integer, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="open"),
        sa.Column("opened_at", TSTZ, nullable=False),
        sa.Column("recovered_at", TSTZ, nullable=True),
        sa.Column("open_value", sa.Float, nullable=True),
        sa.Column("recover_value", sa.Float, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_alert_incidents"),
        sa.ForeignKeyConstraint(["rule_id"], ["alert_rules.id"], ondelete="CASCADE",
                                name="fk_alert_incidents_rule_id_alert_rules"),
        sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                name="fk_alert_incidents_workspace_id_workspaces"),
        sa.CheckConstraint("status IN ('open', 'recovered')", name="ck_alert_incidents_status"),
    )
    # at most one open incident per rule
    op.create_index("uq_alert_incidents_open_rule", "alert_incidents", ["rule_id"], unique=True,
                    postgresql_where=sa.text("status = 'open'"))
    op.create_index("ix_alert_incidents_workspace_id_opened_at", "alert_incidents",
                    ["workspace_id", sa.text("opened_at DESC")])

    op.create_table(
        "alert_rule_state",
        sa.Column("rule_id", sa.BigInteger, nullable=False),
        sa.Column("generation", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("rule_revision", sa.Integer, nullable=False, server_default="1"),
        sa.Column("status", sa.Text, nullable=False, server_default="ok"),
        sa.Column("breach_minutes", sa.Integer, nullable=False, server_default="0"),
        sa.Column("healthy_minutes", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_minute", sa.BigInteger, nullable=True),
        sa.Column("last_outcome", sa.Text, nullable=True),
        sa.Column("last_value", sa.Float, nullable=True),
        sa.Column("last_samples", sa.Integer, nullable=True),
        sa.Column("last_reason", sa.Text, nullable=True),
        sa.Column("last_evaluated_at", TSTZ, nullable=True),
        sa.Column("open_incident_id", sa.BigInteger, nullable=True),
        sa.Column("updated_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("rule_id", name="pk_alert_rule_state"),
        sa.ForeignKeyConstraint(["rule_id"], ["alert_rules.id"], ondelete="CASCADE",
                                name="fk_alert_rule_state_rule_id_alert_rules"),
        sa.ForeignKeyConstraint(["open_incident_id"], ["alert_incidents.id"], ondelete="SET NULL",
                                name="fk_alert_rule_state_open_incident_id_alert_incidents"),
        sa.CheckConstraint("status IN ('ok', 'open')", name="ck_alert_rule_state_status"),
        sa.CheckConstraint("last_outcome IS NULL OR last_outcome IN ('breach', 'healthy', 'unknown')",
                           name="ck_alert_rule_state_last_outcome"),
    )

    op.create_table(
        "alert_channels",
        sa.Column("id", sa.Integer, sa.Identity(), nullable=False),
        sa.Column("workspace_id", sa.Integer, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("secret_enc", sa.Text, nullable=True),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("created_at", TSTZ, nullable=False, server_default=NOW),
        sa.Column("updated_at", TSTZ, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("id", name="pk_alert_channels"),
        sa.ForeignKeyConstraint(["workspace_id"], ["workspaces.id"], ondelete="CASCADE",
                                name="fk_alert_channels_workspace_id_workspaces"),
        sa.UniqueConstraint("workspace_id", "name", name="uq_alert_channels_workspace_id"),
        sa.CheckConstraint("kind IN ('webhook', 'email')", name="ck_alert_channels_kind"),
        sa.CheckConstraint("kind <> 'webhook' OR secret_enc IS NOT NULL", name="ck_alert_channels_secret"),
    )

    op.create_table(
        "alert_deliveries",
        sa.Column("id", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("delivery_id", pg.UUID(as_uuid=False), nullable=False),
        sa.Column("incident_id", sa.BigInteger, nullable=False),
        sa.Column("channel_id", sa.Integer, nullable=False),
        sa.Column("event", sa.Text, nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("last_http_status", sa.Integer, nullable=True),
        *_delivery_columns(),
        sa.PrimaryKeyConstraint("id", name="pk_alert_deliveries"),
        sa.UniqueConstraint("delivery_id", name="uq_alert_deliveries_delivery_id"),
        sa.UniqueConstraint("incident_id", "channel_id", "event", name="uq_alert_deliveries_incident_id"),
        sa.ForeignKeyConstraint(["incident_id"], ["alert_incidents.id"], ondelete="CASCADE",
                                name="fk_alert_deliveries_incident_id_alert_incidents"),
        sa.ForeignKeyConstraint(["channel_id"], ["alert_channels.id"], ondelete="CASCADE",
                                name="fk_alert_deliveries_channel_id_alert_channels"),
        sa.CheckConstraint("event IN ('incident.opened', 'incident.recovered')",
                           name="ck_alert_deliveries_event"),
        *_delivery_checks("alert_deliveries"),
    )
    op.create_index("ix_alert_deliveries_due", "alert_deliveries", ["next_attempt_at"],
                    postgresql_where=sa.text("status = 'pending'"))
    op.create_index("ix_alert_deliveries_claim_expires_at", "alert_deliveries", ["claim_expires_at"],
                    postgresql_where=sa.text("status = 'processing'"))

    op.create_table(
        "email_outbox",
        sa.Column("id", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("recipient", sa.Text, nullable=False),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("message_id", sa.Text, nullable=False),
        sa.Column("dedupe_key", sa.Text, nullable=True),
        *_delivery_columns(),
        sa.PrimaryKeyConstraint("id", name="pk_email_outbox"),
        sa.UniqueConstraint("message_id", name="uq_email_outbox_message_id"),
        sa.UniqueConstraint("dedupe_key", name="uq_email_outbox_dedupe_key"),
        *_delivery_checks("email_outbox"),
    )
    op.create_index("ix_email_outbox_due", "email_outbox", ["next_attempt_at"],
                    postgresql_where=sa.text("status = 'pending'"))
    op.create_index("ix_email_outbox_claim_expires_at", "email_outbox", ["claim_expires_at"],
                    postgresql_where=sa.text("status = 'processing'"))
    op.create_index("ix_email_outbox_sent_at", "email_outbox", ["sent_at"],
                    postgresql_where=sa.text("status = 'sent'"))


def downgrade() -> None:
    op.drop_table("email_outbox")
    op.drop_table("alert_deliveries")
    op.drop_table("alert_channels")
    op.drop_table("alert_rule_state")
    op.drop_table("alert_incidents")
    op.drop_table("alert_rules")
