"""SQLAlchemy model of the email outbox (schema owned by migration ``0003_alerts_outbox``)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from magpie.claims.models import ClaimableRow
from magpie.db.models import Base


class EmailOutbox(ClaimableRow, Base):
    """One email to send.

    ``status``: ``pending`` (due at ``next_attempt_at``) -> ``processing`` (claimed: ``claim_token`` and
    ``claim_expires_at`` set, ``attempts`` already counted) -> ``sent`` | ``pending`` (retry) | ``failed``
    (``attempts`` reached ``max_attempts``, or a permanent SMTP refusal; ``last_error`` says why).
    ``message_id`` is the stable ``Message-ID`` header (the same on every attempt); ``dedupe_key``
    (optional, unique) makes enqueueing idempotent; ``kind`` is free text such as ``alert`` or ``invitation``.
    """

    __tablename__ = "email_outbox"
    __table_args__ = (
        sa.UniqueConstraint("message_id", name="uq_email_outbox_message_id"),
        sa.UniqueConstraint("dedupe_key", name="uq_email_outbox_dedupe_key"),
        sa.CheckConstraint("status IN ('pending', 'processing', 'sent', 'failed')", name="status"),
        sa.CheckConstraint("max_attempts >= 1 AND attempts >= 0", name="attempts"),
        sa.CheckConstraint(
            "(status = 'processing') = (claim_token IS NOT NULL AND claim_expires_at IS NOT NULL)", name="claim"
        ),
        sa.Index("ix_email_outbox_due", "next_attempt_at", postgresql_where=sa.text("status = 'pending'")),
        sa.Index("ix_email_outbox_claim_expires_at", "claim_expires_at",
                 postgresql_where=sa.text("status = 'processing'")),
        sa.Index("ix_email_outbox_sent_at", "sent_at", postgresql_where=sa.text("status = 'sent'")),
    )

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    recipient: Mapped[str] = mapped_column(sa.Text, nullable=False)
    subject: Mapped[str] = mapped_column(sa.Text, nullable=False)
    body: Mapped[str] = mapped_column(sa.Text, nullable=False)
    kind: Mapped[str] = mapped_column(sa.Text, nullable=False)
    message_id: Mapped[str] = mapped_column(sa.Text, nullable=False)
    dedupe_key: Mapped[str | None] = mapped_column(sa.Text, nullable=True)


__all__ = ["EmailOutbox"]
