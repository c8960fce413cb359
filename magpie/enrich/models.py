"""The enrichment table (schema in migration ``0008_enrichment_blacklists``).

``route_enrichment``: one row per enriched route: ``country`` (ISO 3166-1 alpha-2), ``asn`` and
``as_org`` from the operator's MaxMind-format files, ``network_type`` (``datacenter``, ``isp``,
``residential`` or ``unknown``: a guess from the ASN organisation, see :mod:`magpie.enrich.geo`),
``geo_revision`` (the files' revision the row was computed from, so a newer file re-enriches it), and the
abuse provider's ``abuse_score`` (0-100) when abuse lookups are configured.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from magpie.db.models import Base

_now = sa.text("now()")
TSTZ = sa.DateTime(timezone=True)


class RouteEnrichment(Base):
    """Country, ASN, network-type guess and abuse score of one route (host names: not enriched)."""

    __tablename__ = "route_enrichment"
    __table_args__ = (
        sa.Index("ix_route_enrichment_geo_revision", "geo_revision"),
        sa.CheckConstraint("abuse_score IS NULL OR abuse_score BETWEEN 0 AND 100", name="abuse_score"),
    )

    route_id: Mapped[int] = mapped_column(
        sa.BigInteger, sa.ForeignKey("routes.id", ondelete="CASCADE"), primary_key=True
    )
    country: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    asn: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    as_org: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    network_type: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    geo_revision: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    enriched_at: Mapped[datetime] = mapped_column(TSTZ, nullable=False, server_default=_now)
    abuse_score: Mapped[int | None] = mapped_column(sa.SmallInteger, nullable=True)
    abuse_checked_at: Mapped[datetime | None] = mapped_column(TSTZ, nullable=True)


__all__ = ["RouteEnrichment"]
