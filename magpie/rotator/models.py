"""The ``rotators`` table: one rotating listener per row (see :mod:`magpie.rotator`)."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from magpie.db.models import Base

LISTEN_PROTOCOLS = ("http", "socks5")
"""What a listener speaks to its clients: an HTTP proxy (CONNECT and absolute-URI requests), SOCKS5."""

POLICIES = ("next", "sticky")
"""Rotation: ``next`` route per connection (round robin), or ``sticky`` per client address for N seconds."""


class Rotator(Base):
    """One rotating listener of a workspace.

    ``listen`` is a comma-separated subset of :data:`LISTEN_PROTOCOLS` (both on one port: the first byte
    of a connection tells SOCKS5 from HTTP). ``password_enc`` is a Fernet token
    (:meth:`magpie.base.crypto.Keyring.encrypt`); the password is never stored in clear. ``filters`` is JSON:
    ``{"protocols": [...], "anonymity": [...], "max_latency_ms": n, "reputation": "good"|..., "country":
    [...], "exit_country": [...]}`` (every key optional; ``exit_country`` is the country of the address the
    judge saw the route exit from). ``instance_id`` is the rotator process that runs it (None: unassigned);
    ``revision`` grows on every change, so a process applies each change once.
    """

    __tablename__ = "rotators"
    __table_args__ = (
        sa.CheckConstraint("port BETWEEN 1 AND 65535", name="port"),
        sa.CheckConstraint("policy IN ('next', 'sticky')", name="policy"),
        sa.Index("ix_rotators_instance_id", "instance_id"),
        sa.Index("ix_rotators_workspace_id", "workspace_id"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, sa.Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(sa.Text, nullable=False, unique=True)
    workspace_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False)
    listen: Mapped[str] = mapped_column(sa.Text, nullable=False, server_default="http,socks5")
    port: Mapped[int] = mapped_column(sa.Integer, nullable=False, unique=True)
    username: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    password_enc: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    filters: Mapped[dict] = mapped_column(JSONB, nullable=False, server_default=sa.text("'{}'::jsonb"))
    policy: Mapped[str] = mapped_column(sa.Text, nullable=False, server_default="next")
    sticky_seconds: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="0")
    enabled: Mapped[bool] = mapped_column(sa.Boolean, nullable=False, server_default=sa.true())
    instance_id: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    assigned_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    revision: Mapped[int] = mapped_column(sa.BigInteger, nullable=False, server_default="1")
    created_at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now())
    updated_at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now())
