"""The ``api_tokens`` table: one row per API token, holding the SHA-256 of the secret, never the secret."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from magpie.db.models import Base

ROLES = ("read", "operate", "admin")
"""Token roles, weakest first: ``read`` (GET requests), ``operate`` (also imports), ``admin`` (everything,
every workspace)."""


class ApiToken(Base):
    """One API token.

    ``token_hash`` is the hex SHA-256 of the whole secret (a 256-bit random value, so no salt or slow hash
    is needed); ``prefix`` is the secret's first characters, shown by ``magpie tokens list`` so that a
    person can tell tokens apart. ``workspace_id`` is NULL only for an admin token made without a
    workspace. ``revoked_at`` / ``expires_at`` end a token; ``last_used_at`` is refreshed at most once a
    minute.
    """

    __tablename__ = "api_tokens"
    __table_args__ = (
        sa.CheckConstraint("role IN ('read', 'operate', 'admin')", name="role"),
        sa.CheckConstraint("workspace_id IS NOT NULL OR role = 'admin'", name="workspace"),
        sa.Index("ix_api_tokens_workspace_id", "workspace_id"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, sa.Identity(), primary_key=True)
    name: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    token_hash: Mapped[str] = mapped_column(sa.Text, nullable=False, unique=True)
    prefix: Mapped[str] = mapped_column(sa.Text, nullable=False)
    workspace_id: Mapped[int | None] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=True)
    role: Mapped[str] = mapped_column(sa.Text, nullable=False)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), nullable=False,
                                                 server_default=sa.func.now())
    expires_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)


__all__ = ["ROLES", "ApiToken"]
