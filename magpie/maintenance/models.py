"""Tables owned by the maintenance work (schema in migration ``0002_maintenance``).

``maintenance_runs``: one row per job with its last start / success / error and run counters.
``route_daily``: per-route, per-UTC-day counts compacted from ``check_history``.
``password_reset_tokens`` and ``invitations``: minimal token tables whose expiry maintenance enforces
(``invitations`` keeps the shape agreed with the workspace-management work: id, workspace_id, email,
token_hash, created_at, expires_at, accepted_at, revoked_at).
"""

from __future__ import annotations

from datetime import date, datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.orm import Mapped, mapped_column

from magpie.db.models import Base

_now = sa.text("now()")
TSTZ = sa.DateTime(timezone=True)


class MaintenanceRun(Base):
    """Status of one maintenance job (one row per job name).

    ``runs_total`` counts passes started while holding the job's leader lock, ``failures_total`` passes
    that raised; ``state`` holds the job's resume cursor between passes (JSON object, job-specific);
    ``last_result`` the summary dict of the last successful pass; ``last_duration_s`` in seconds.
    """

    __tablename__ = "maintenance_runs"

    job: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    last_started_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    last_finished_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    last_success_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    last_error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    last_error_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    last_duration_s: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    last_result: Mapped[dict | None] = mapped_column(pg.JSONB, nullable=True)
    state: Mapped[dict] = mapped_column(pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb"))
    runs_total: Mapped[int] = mapped_column(sa.BigInteger, nullable=False, server_default="0")
    failures_total: Mapped[int] = mapped_column(sa.BigInteger, nullable=False, server_default="0")
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class RouteDaily(Base):
    """Checks of one route on one UTC day, compacted from ``check_history`` (recomputed, never added to).

    ``latency_sum_ms`` / ``latency_count`` cover checks that measured a latency (ms);
    ``latency_avg_ms`` is generated from them (NULL when none).
    """

    __tablename__ = "route_daily"
    __table_args__ = (sa.Index("ix_route_daily_day", "day"),)

    route_id: Mapped[int] = mapped_column(
        sa.BigInteger, sa.ForeignKey("routes.id", ondelete="CASCADE"), primary_key=True
    )
    day: Mapped[date] = mapped_column(sa.Date, primary_key=True)
    checks: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    alive: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    latency_sum_ms: Mapped[float] = mapped_column(sa.Float, nullable=False, server_default="0")
    latency_count: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="0")
    latency_avg_ms: Mapped[float | None] = mapped_column(
        sa.Float,
        sa.Computed("CASE WHEN latency_count > 0 THEN latency_sum_ms / latency_count END", persisted=True),
    )
    updated_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)


class PasswordResetToken(Base):
    """A password-reset token (only its hash is stored). Deleted by maintenance once expired or used
    for longer than ``MAGPIE_TOKEN_RETENTION_DAYS``."""

    __tablename__ = "password_reset_tokens"
    __table_args__ = (sa.Index("ix_password_reset_tokens_expires_at", "expires_at"),)

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    email: Mapped[str] = mapped_column(sa.Text, nullable=False)
    token_hash: Mapped[str] = mapped_column(sa.Text, nullable=False, unique=True)
    created_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)
    expires_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False)
    used_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)


class Invitation(Base):
    """An invitation to a workspace (only the token's hash is stored).

    Pending while ``accepted_at`` and ``revoked_at`` are NULL and ``expires_at`` is in the future.
    Maintenance deletes unaccepted invitations once expired or revoked for longer than
    ``MAGPIE_TOKEN_RETENTION_DAYS``; accepted ones are kept.
    """

    __tablename__ = "invitations"
    __table_args__ = (
        sa.Index("ix_invitations_workspace_id", "workspace_id"),
        sa.Index("ix_invitations_expires_at", "expires_at"),
    )

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    workspace_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False
    )
    email: Mapped[str] = mapped_column(sa.Text, nullable=False)
    token_hash: Mapped[str] = mapped_column(sa.Text, nullable=False, unique=True)
    created_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)
    expires_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False)
    accepted_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)


__all__ = ["Invitation", "MaintenanceRun", "PasswordResetToken", "RouteDaily"]
