"""SQLAlchemy 2 declarative models of magpie's durable data (docs/design.md, "Results and durable data").

The schema itself is owned by the Alembic migrations in ``magpie/migrations``; these classes mirror it
for queries and for ``alembic revision --autogenerate``. ``check_history`` is a PostgreSQL range-partitioned
table on ``checked_at`` (its partitions, starting with ``check_history_default``, are created by migrations
and maintenance, never by :meth:`MetaData.create_all`).

Times are ``timestamptz`` (timezone-aware :class:`datetime.datetime` in Python); latencies are milliseconds.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from magpie.base.protocols import sql_check

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base; ``Base.metadata`` is the Alembic ``target_metadata``."""

    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


_now = sa.text("now()")


class Workspace(Base):
    """A named set of routes; importing a list into a workspace adds membership."""

    __tablename__ = "workspaces"

    id: Mapped[int] = mapped_column(sa.Integer, sa.Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(sa.Text, nullable=False, unique=True)
    created_at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), nullable=False, server_default=_now
    )


class RouteRow(Base):
    """One proxy route, unique by its keyed ``route_hash`` (see :meth:`magpie.base.crypto.Keyring.route_hash`).

    ``username_enc`` / ``password_enc`` hold Fernet tokens from :meth:`magpie.base.crypto.Keyring.encrypt`;
    plaintext credentials are never stored.
    """

    __tablename__ = "routes"
    __table_args__ = (
        sa.CheckConstraint(sql_check("protocol"), name="protocol"),
        sa.CheckConstraint("port BETWEEN 1 AND 65535", name="port"),
    )

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    route_hash: Mapped[str] = mapped_column(sa.CHAR(24), nullable=False, unique=True)
    protocol: Mapped[str] = mapped_column(sa.Text, nullable=False)
    host: Mapped[str] = mapped_column(sa.Text, nullable=False)
    port: Mapped[int] = mapped_column(sa.Integer, nullable=False)
    username_enc: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    password_enc: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), nullable=False, server_default=_now
    )


class RouteWorkspace(Base):
    """Membership of a route in a workspace."""

    __tablename__ = "route_workspaces"
    __table_args__ = (sa.Index("ix_route_workspaces_workspace_id", "workspace_id"),)

    route_id: Mapped[int] = mapped_column(
        sa.BigInteger, sa.ForeignKey("routes.id", ondelete="CASCADE"), primary_key=True
    )
    workspace_id: Mapped[int] = mapped_column(
        sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), primary_key=True
    )
    added_at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), nullable=False, server_default=_now
    )


class CheckHistory(Base):
    """One check result. Range-partitioned on ``checked_at``; primary key ``(id, checked_at)``.

    ``stream_id`` is the Redis Stream entry id the row was ingested from (see :mod:`magpie.stats`).
    ``route_id`` names a ``routes.id`` but has no foreign key (migration ``0017``): ingestion locks and
    checks the routes of a batch itself, and deleting a route deletes its history in the same transaction
    (:func:`magpie.db.deletion.delete_routes`).
    """

    __tablename__ = "check_history"
    __table_args__ = (
        sa.Index("ix_check_history_route_id_checked_at", "route_id", sa.text("checked_at DESC")),
        # time-range scans of retention and compaction
        sa.Index("ix_check_history_checked_at_brin", "checked_at", postgresql_using="brin"),
        # rows that still carry a response body (body blanking walks it; a blanked row leaves it)
        sa.Index("ix_check_history_body_checked_at", "checked_at", postgresql_where=sa.text("body IS NOT NULL")),
        {"postgresql_partition_by": "RANGE (checked_at)"},
    )

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    checked_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), primary_key=True)
    route_id: Mapped[int] = mapped_column(sa.BigInteger, nullable=False)
    alive: Mapped[bool] = mapped_column(sa.Boolean, nullable=False)
    latency_ms: Mapped[float | None] = mapped_column(sa.REAL, nullable=True)
    status: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    attempts: Mapped[int] = mapped_column(sa.SmallInteger, nullable=False, server_default="0")
    error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    anonymity: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    body: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    judge: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    stream_id: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    exit_ip: Mapped[str | None] = mapped_column(sa.Text, nullable=True)


class RouteHealth(Base):
    """Current health of one route: the newest result plus running counters.

    ``consecutive_failures`` counts failed checks since the newest alive one (0 after an alive check);
    ``checks_total`` / ``alive_total`` count every ingested result, including ones that arrived late.
    ``exit_ip`` is the address the judge saw the newest answered check come from (kept across failed
    checks, which see none); ``exit_country`` / ``exit_asn`` its GeoIP enrichment at ``exit_geo_revision``.
    """

    __tablename__ = "route_health"
    __table_args__ = (
        sa.Index("ix_route_health_exit_country", "exit_country",
                 postgresql_where=sa.text("exit_country IS NOT NULL")),
    )

    route_id: Mapped[int] = mapped_column(
        sa.BigInteger, sa.ForeignKey("routes.id", ondelete="CASCADE"), primary_key=True
    )
    last_checked_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    alive: Mapped[bool | None] = mapped_column(sa.Boolean, nullable=True)
    latency_ms: Mapped[float | None] = mapped_column(sa.REAL, nullable=True)
    status: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    anonymity: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    attempts: Mapped[int | None] = mapped_column(sa.SmallInteger, nullable=True)
    checks_total: Mapped[int] = mapped_column(sa.BigInteger, nullable=False, server_default="0")
    alive_total: Mapped[int] = mapped_column(sa.BigInteger, nullable=False, server_default="0")
    consecutive_failures: Mapped[int] = mapped_column(sa.Integer, nullable=False, server_default="0")
    last_alive_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)
    exit_ip: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    exit_country: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    exit_asn: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    exit_geo_revision: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), nullable=False, server_default=_now
    )


class StatsLedger(Base):
    """Replay protection: one row per Redis Stream entry id whose result was applied (same transaction)."""

    __tablename__ = "stats_ledger"
    __table_args__ = (
        sa.Index("ix_stats_ledger_committed_at", "committed_at"),
        # the numeric order of stream ids (retirement below the replay floor)
        sa.Index("ix_stats_ledger_stream_order", sa.text("(split_part(stream_id, '-', 1)::bigint)"),
                 sa.text("(split_part(stream_id, '-', 2)::bigint)")),
    )

    stream_id: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    committed_at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), nullable=False, server_default=_now
    )


class DeploymentKey(Base):
    """The fingerprint of the ``PROXY_ENCRYPTION_KEY`` this database was first used with (one row, id 1).

    ``fingerprint`` is :func:`magpie.base.crypto.key_fingerprint` of the key, never the key itself; every
    process compares its own key's fingerprint with it at start (see :mod:`magpie.db.keycheck`).
    """

    __tablename__ = "deployment_keys"
    __table_args__ = (sa.CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(sa.SmallInteger, primary_key=True, autoincrement=False)
    fingerprint: Mapped[str] = mapped_column(sa.Text, nullable=False)
    created_at: Mapped[datetime] = mapped_column(
        sa.DateTime(timezone=True), nullable=False, server_default=_now
    )


__all__ = [
    "Base",
    "CheckHistory",
    "DeploymentKey",
    "RouteHealth",
    "RouteRow",
    "RouteWorkspace",
    "StatsLedger",
    "Workspace",
]
