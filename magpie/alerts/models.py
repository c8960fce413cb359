"""SQLAlchemy models of the alert tables (schema owned by migration ``0003_alerts_outbox``).

* :class:`AlertRule` - one rule per row; ``revision`` grows on every edit (including enable/disable).
* :class:`AlertRuleState` - evaluation state per rule; ``generation`` grows on every applied evaluation.
* :class:`AlertIncident` - one row per opened incident; at most one ``open`` per rule.
* :class:`AlertChannel` - where a workspace's incident transitions go (``webhook`` or ``email``).
* :class:`AlertDelivery` - one webhook POST to make (per incident transition and webhook channel).

Email channels do not use :class:`AlertDelivery`: their messages go straight to the email outbox
(:class:`magpie.outbox.models.EmailOutbox`) in the same transaction as the incident transition.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.orm import Mapped, mapped_column

from magpie.claims.models import ClaimableRow
from magpie.db.models import Base
from magpie.rotator import models as _rotator_models  # noqa: F401 - the table rotator_id refers to

_now = sa.text("now()")
TSTZ = sa.DateTime(timezone=True)


class AlertRule(Base):
    """An alert rule of one workspace.

    ``kind``: ``usable_routes`` (breach when usable routes < ``threshold``), ``success_rate`` (breach when
    the success percentage over the window < ``threshold``) or ``latency`` (breach when the ``percentile``
    (50 or 95) of alive-check latency in ms over the window > ``threshold``). ``protocols`` (``None`` = all)
    narrows the routes considered; ``rotator_id`` scopes the rule to a rotator (usable routes of its
    eligible pool; history of its upstream protocols); ``min_samples`` is the fewest observations that give a verdict;
    ``freshness_s`` (usable rules; ``None`` = the setting) is how recent a check must be to count.
    """

    __tablename__ = "alert_rules"
    __table_args__ = (
        sa.UniqueConstraint("workspace_id", "name", name="uq_alert_rules_workspace_id"),
        sa.CheckConstraint("kind IN ('usable_routes', 'success_rate', 'latency')", name="kind"),
        sa.CheckConstraint(
            "(kind = 'latency' AND percentile IN (50, 95)) OR (kind <> 'latency' AND percentile IS NULL)",
            name="percentile",
        ),
        sa.CheckConstraint("min_samples >= 1", name="min_samples"),
        sa.CheckConstraint("freshness_s IS NULL OR freshness_s > 0", name="freshness"),
        sa.Index("ix_alert_rules_workspace_id", "workspace_id"),
        sa.Index("ix_alert_rules_rotator_id", "rotator_id"),
    )

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    workspace_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False
    )
    name: Mapped[str] = mapped_column(sa.Text, nullable=False)
    kind: Mapped[str] = mapped_column(sa.Text, nullable=False)
    threshold: Mapped[float] = mapped_column(sa.Float, nullable=False)
    percentile: Mapped[int | None] = mapped_column(sa.SmallInteger, nullable=True)
    protocols: Mapped[list[str] | None] = mapped_column(pg.ARRAY(sa.Text), nullable=True)
    min_samples: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="1")
    rotator_id: Mapped[int | None] = mapped_column(
        sa.Integer, sa.ForeignKey("rotators.id", ondelete="CASCADE"), nullable=True
    )
    freshness_s: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    enabled: Mapped[bool] = mapped_column(sa.Boolean, nullable=False, server_default=sa.true())
    revision: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="1")
    created_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class AlertIncident(Base):
    """An incident: opened after the rule's breach streak, ``recovered`` after its healthy streak."""

    __tablename__ = "alert_incidents"
    __table_args__ = (
        sa.CheckConstraint("status IN ('open', 'recovered')", name="status"),
        sa.Index("uq_alert_incidents_open_rule", "rule_id", unique=True,
                 postgresql_where=sa.text("status = 'open'")),
        sa.Index("ix_alert_incidents_workspace_id_opened_at", "workspace_id", sa.text("opened_at DESC")),
    )

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    rule_id: Mapped[int] = mapped_column(
        sa.BigInteger, sa.ForeignKey("alert_rules.id", ondelete="CASCADE"), nullable=False
    )
    workspace_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False
    )
    rule_revision: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    status: Mapped[str] = mapped_column(sa.Text, nullable=False, server_default="open")
    opened_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False)
    recovered_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    open_value: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    recover_value: Mapped[float | None] = mapped_column(sa.Float, nullable=True)


class AlertRuleState(Base):
    """Evaluation state of one rule (created with the rule).

    ``breach_minutes`` / ``healthy_minutes`` count consecutive evaluation minutes with that outcome;
    ``last_minute`` is the Unix minute (epoch seconds // 60) of the last counted evaluation;
    ``rule_revision`` is the revision the streaks were counted under (an edit restarts them).
    """

    __tablename__ = "alert_rule_state"
    __table_args__ = (
        sa.CheckConstraint("status IN ('ok', 'open')", name="status"),
        sa.CheckConstraint("last_outcome IS NULL OR last_outcome IN ('breach', 'healthy', 'unknown')",
                           name="last_outcome"),
    )

    rule_id: Mapped[int] = mapped_column(
        sa.BigInteger, sa.ForeignKey("alert_rules.id", ondelete="CASCADE"), primary_key=True
    )
    generation: Mapped[int] = mapped_column(sa.BigInteger, nullable=False, server_default="0")
    rule_revision: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="1")
    status: Mapped[str] = mapped_column(sa.Text, nullable=False, server_default="ok")
    breach_minutes: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="0")
    healthy_minutes: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="0")
    last_minute: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    last_outcome: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    last_value: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    last_samples: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    last_reason: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    last_evaluated_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    open_incident_id: Mapped[int | None] = mapped_column(
        sa.BigInteger, sa.ForeignKey("alert_incidents.id", ondelete="SET NULL"), nullable=True
    )
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class AlertChannel(Base):
    """A destination for a workspace's incident transitions.

    ``kind`` ``webhook``: ``target`` is an http(s) URL and ``secret_enc`` the HMAC secret encrypted with
    :meth:`magpie.base.crypto.Keyring.encrypt`. ``kind`` ``email``: ``target`` is the recipient address.
    """

    __tablename__ = "alert_channels"
    __table_args__ = (
        sa.UniqueConstraint("workspace_id", "name", name="uq_alert_channels_workspace_id"),
        sa.CheckConstraint("kind IN ('webhook', 'email')", name="kind"),
        sa.CheckConstraint("kind <> 'webhook' OR secret_enc IS NOT NULL", name="secret"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, sa.Identity(), primary_key=True)
    workspace_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False
    )
    name: Mapped[str] = mapped_column(sa.Text, nullable=False)
    kind: Mapped[str] = mapped_column(sa.Text, nullable=False)
    target: Mapped[str] = mapped_column(sa.Text, nullable=False)
    secret_enc: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    enabled: Mapped[bool] = mapped_column(sa.Boolean, nullable=False, server_default=sa.true())
    created_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class AlertDelivery(ClaimableRow, Base):
    """One webhook POST owed for an incident transition on one channel.

    ``delivery_id`` (UUID text) is sent as ``X-Magpie-Delivery-ID`` and never changes across retries;
    ``payload`` is the exact JSON body (signed as is). Claim columns: :class:`magpie.claims.ClaimableRow`;
    how they are used: :mod:`magpie.alerts.delivery`.
    """

    __tablename__ = "alert_deliveries"
    __table_args__ = (
        sa.UniqueConstraint("delivery_id", name="uq_alert_deliveries_delivery_id"),
        sa.UniqueConstraint("incident_id", "channel_id", "event", name="uq_alert_deliveries_incident_id"),
        sa.CheckConstraint("event IN ('incident.opened', 'incident.recovered')", name="event"),
        sa.CheckConstraint("status IN ('pending', 'processing', 'sent', 'failed')", name="status"),
        sa.CheckConstraint("max_attempts >= 1 AND attempts >= 0", name="attempts"),
        sa.CheckConstraint(
            "(status = 'processing') = (claim_token IS NOT NULL AND claim_expires_at IS NOT NULL)", name="claim"
        ),
        sa.Index("ix_alert_deliveries_due", "next_attempt_at", postgresql_where=sa.text("status = 'pending'")),
        sa.Index("ix_alert_deliveries_claim_expires_at", "claim_expires_at",
                 postgresql_where=sa.text("status = 'processing'")),
    )

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    delivery_id: Mapped[str] = mapped_column(pg.UUID(as_uuid=False), nullable=False)
    incident_id: Mapped[int] = mapped_column(
        sa.BigInteger, sa.ForeignKey("alert_incidents.id", ondelete="CASCADE"), nullable=False
    )
    channel_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("alert_channels.id", ondelete="CASCADE"), nullable=False
    )
    event: Mapped[str] = mapped_column(sa.Text, nullable=False)
    payload: Mapped[str] = mapped_column(sa.Text, nullable=False)
    last_http_status: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)


__all__ = ["AlertChannel", "AlertDelivery", "AlertIncident", "AlertRule", "AlertRuleState"]
