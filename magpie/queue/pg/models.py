"""SQLAlchemy models of the PostgreSQL schedule (schema owned by migration ``0006_postgresql_schedule``).

One row per route in ``schedule_routes``; ``schedule_meta`` holds each schedule's pause flag and shard count;
``schedule_results`` is the outbox of check results written in the completing transaction and relayed to the
Redis results stream (:mod:`magpie.queue.pg.relay`). Times are ``timestamptz`` on the database server clock.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from magpie.db.models import Base

RANK_SQL = "CASE WHEN lease_expires_at IS NOT NULL THEN 1 WHEN retry THEN 0 ELSE 2 END"
"""Tie order of rows claimable from the same millisecond: a backoff retry, then an expired lease, then an
ordinary due time (the order of the Redis scores ``.25`` < ``.5`` < the next ``.0``)."""

FILLFACTOR = 70
"""Free space left in each heap page so heartbeat updates (no indexed column changes) stay HOT."""

schedule_routes = sa.Table(
    "schedule_routes", Base.metadata,
    sa.Column("schedule", sa.Text, nullable=False),  # schedule name (the deployment's key prefix)
    sa.Column("route", sa.Text(collation="C"), nullable=False),  # route hash
    sa.Column("shard", sa.Text(collation="C"), nullable=False),  # shard number as text (tie order)
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("due_at", sa.DateTime(timezone=True)),  # claimable from; NULL while dead-lettered
    sa.Column("retry", sa.Boolean, nullable=False, server_default=sa.false()),  # due_at is a backoff retry
    sa.Column("lease_expires_at", sa.DateTime(timezone=True)),  # set while a lease is out (live or expired)
    sa.Column("lease_token", sa.Text),  # fencing token of the current lease: '<expiry ms>.50'
    sa.Column("leased_at", sa.DateTime(timezone=True)),
    sa.Column("last_heartbeat_at", sa.DateTime(timezone=True)),
    sa.Column("stalls", sa.Integer, nullable=False, server_default="0"),  # counted stalls in a row
    # stalls of started leases since the last completion (>= 2: quarantine)
    sa.Column("suspect", sa.Integer, nullable=False, server_default="0"),
    sa.Column("start_mark", sa.Text),  # lease token the route started checking under
    sa.Column("retries", sa.Integer, nullable=False, server_default="0"),
    sa.Column("progress", sa.Text),
    sa.Column("logs", pg.ARRAY(sa.Text), nullable=False, server_default="{}"),
    sa.Column("last_silent_ms", sa.BigInteger),  # how long the last reaped lease had been silent
    sa.Column("dead_at", sa.DateTime(timezone=True)),
    sa.Column("dead_reason", pg.JSONB),  # dead-letter evidence {reason, stalls, claims, alone, at}
    sa.Column("rank", sa.SmallInteger, sa.Computed(RANK_SQL, persisted=True)),
    sa.PrimaryKeyConstraint("schedule", "route", name="pk_schedule_routes"),
    sa.Index("ix_schedule_routes_claim", "schedule", "due_at", "rank", "shard", "route",
             postgresql_where=sa.text("due_at IS NOT NULL")),
    sa.Index("ix_schedule_routes_lease", "schedule", "lease_expires_at",
             postgresql_where=sa.text("lease_expires_at IS NOT NULL")),
    sa.Index("ix_schedule_routes_dead", "schedule", "dead_at", postgresql_where=sa.text("dead_at IS NOT NULL")),
    postgresql_with={"fillfactor": FILLFACTOR},
)

schedule_meta = sa.Table(
    "schedule_meta", Base.metadata,
    sa.Column("schedule", sa.Text, primary_key=True),
    sa.Column("shards", sa.Integer, nullable=False),
    sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
)

schedule_results = sa.Table(
    "schedule_results", Base.metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("schedule", sa.Text, nullable=False),
    sa.Column("stream", sa.Text, nullable=False),  # Redis stream key
    sa.Column("grp", sa.Text, nullable=False),  # consumer group
    sa.Column("fields", pg.JSONB, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
    sa.Index("ix_schedule_results_schedule", "schedule", "id"),
)
