"""The columns every claimable table shares, as a SQLAlchemy declarative mixin.

The schema itself is owned by the Alembic migrations (``0003_alerts_outbox`` creates ``email_outbox`` and
``alert_deliveries`` with these columns); the mixin mirrors it for queries and autogenerate.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.orm import Mapped, mapped_column

STATUSES = ("pending", "processing", "sent", "failed")
"""Every status a claimable row can have (see :mod:`magpie.claims.rows` for the transitions)."""

_now = sa.text("now()")
TSTZ = sa.DateTime(timezone=True)


class ClaimableRow:
    """Columns of a row claimed with ``SKIP LOCKED`` and a claim token (see :mod:`magpie.claims.rows`).

    Mixed into :class:`magpie.outbox.models.EmailOutbox` and :class:`magpie.alerts.models.AlertDelivery`
    before ``Base``. ``attempts`` counts claims (1-based once claimed); ``claim_token`` and
    ``claim_expires_at`` are set exactly while ``status`` is ``processing``.
    """

    status: Mapped[str] = mapped_column(sa.Text, nullable=False, server_default="pending")
    attempts: Mapped[int] = mapped_column(sa.SmallInteger, nullable=False, server_default="0")
    max_attempts: Mapped[int] = mapped_column(sa.SmallInteger, nullable=False, server_default="4")
    next_attempt_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)
    claim_token: Mapped[str | None] = mapped_column(pg.UUID(as_uuid=False), nullable=True)
    claim_expires_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    last_error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)
    sent_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)


__all__ = ["STATUSES", "ClaimableRow"]
