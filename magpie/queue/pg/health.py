"""Readiness and vacuum health of the PostgreSQL schedule: the table exists, dead tuples stay bounded, and no
long transaction holds back the xmin horizon (a transaction open for long keeps every row version newer
than its snapshot alive, so vacuum removes nothing and each claim scans more dead tuples)."""

from __future__ import annotations

import sqlalchemy as sa

DEAD_RATIO_WARN = 2.0
"""Warn when the table holds more than this many dead tuples per live one ..."""
DEAD_MIN_WARN = 10_000
"""... and at least this many (a small schedule's churn between two autovacuum runs is normal)."""
HORIZON_WARN_S = 300.0
"""Warn when a transaction holding a snapshot in this database is older than this (seconds)."""

_STATS = sa.text(
    "SELECT n_live_tup, n_dead_tup, COALESCE(extract(epoch FROM now() - GREATEST(last_autovacuum, last_vacuum)), -1) "
    "FROM pg_stat_user_tables WHERE relname = 'schedule_routes'")
_HORIZON = sa.text(
    "SELECT COALESCE(max(extract(epoch FROM now() - xact_start)), 0), count(*) FILTER (WHERE xact_start IS NOT NULL "
    "AND now() - xact_start > make_interval(secs => :s)) FROM pg_stat_activity "
    "WHERE datname = current_database() AND backend_xmin IS NOT NULL AND pid <> pg_backend_pid()")


def schedule_health(conn: sa.Connection, name: str, *, horizon_s: float = HORIZON_WARN_S,
                    dead_min: int = DEAD_MIN_WARN, dead_ratio: float = DEAD_RATIO_WARN) -> tuple[str, bool]:
    """``(detail, warn)`` for schedule ``name`` on ``conn``: route count, dead tuples, oldest snapshot.
    ``warn`` when a snapshot is older than ``horizon_s`` seconds, or dead tuples number at least
    ``dead_min`` and more than ``dead_ratio`` per live tuple.

    Raises ``RuntimeError`` when the schedule tables are missing (run ``magpie db upgrade``)."""
    row = conn.execute(_STATS).first()
    if row is None:
        raise RuntimeError("schedule_routes table missing (run: magpie db upgrade)")
    live, dead, vac_age = int(row[0]), int(row[1]), float(row[2])
    routes = conn.execute(sa.text("SELECT count(*) FROM schedule_routes WHERE schedule = :s"), {"s": name}).scalar()
    oldest, long_tx = conn.execute(_HORIZON, {"s": float(horizon_s)}).first()
    detail = (f"postgresql schedule: {routes} routes; {dead} dead / {live} live tuples; "
              f"oldest snapshot {float(oldest):.0f} s")
    warn = False
    if long_tx:
        detail += (f"; {long_tx} transaction(s) open > {horizon_s:g} s hold the xmin horizon: vacuum "
                   "cannot remove dead tuples until they end")
        warn = True
    if dead >= dead_min and dead > dead_ratio * max(live, 1):
        detail += (f"; dead tuples outnumber live ones {dead / max(live, 1):.1f}:1"
                   + (f" (last vacuum {vac_age:.0f} s ago)" if vac_age >= 0 else " (never vacuumed)"))
        warn = True
    return detail, warn
