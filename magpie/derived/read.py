"""Reads of the rollup tables for ``magpie stats`` (one query each, newest first, bounded by a window).

Every function takes an engine, an optional workspace name (``None``: every workspace; an unknown name
gives an empty list) and a window, and returns a list of dicts with ``workspace`` (name) and the table's
columns; times are aware UTC datetimes.

Raises ``sqlalchemy.exc.DBAPIError`` when the database is unavailable.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine


def _rows(engine: Engine, sql: str, params: dict) -> list[dict]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(sql), params).mappings()]


_WS = "(CAST(:ws AS text) IS NULL OR w.name = CAST(:ws AS text))"


def timeline(engine: Engine, workspace: str | None = None, hours: float = 24.0) -> list[dict]:
    """Snapshots of the last ``hours`` hours: ``workspace``, ``taken_at``, ``protocol``, ``alive``,
    ``total``; newest slot first."""
    since = datetime.now(UTC) - timedelta(hours=hours)
    return _rows(engine, f"""
        SELECT w.name AS workspace, s.taken_at, s.protocol, s.alive, s.total
        FROM workspace_snapshots s JOIN workspaces w ON w.id = s.workspace_id
        WHERE s.taken_at >= :since AND {_WS}
        ORDER BY s.taken_at DESC, w.name, s.protocol""", {"since": since, "ws": workspace})


def hourly(engine: Engine, workspace: str | None = None, hours: float = 24.0) -> list[dict]:
    """Hourly counts of the last ``hours`` hours: ``workspace``, ``hour``, ``checks``, ``alive``,
    ``routes_checked``, ``routes_alive``; newest hour first."""
    since = datetime.now(UTC) - timedelta(hours=hours)
    return _rows(engine, f"""
        SELECT w.name AS workspace, h.hour, h.checks, h.alive, h.routes_checked, h.routes_alive
        FROM hourly_counts h JOIN workspaces w ON w.id = h.workspace_id
        WHERE h.hour >= :since AND {_WS}
        ORDER BY h.hour DESC, w.name""", {"since": since, "ws": workspace})


def sources(engine: Engine, workspace: str | None = None) -> list[dict]:
    """Source statistics: ``workspace``, ``source``, ``routes``, ``alive``, ``checked``,
    ``latency_avg_ms`` (ms | None), ``score_avg`` (0-100 | None), ``refreshed_at``; most routes first."""
    return _rows(engine, f"""
        SELECT w.name AS workspace, s.source, s.routes, s.alive, s.checked, s.latency_avg_ms, s.score_avg,
               s.refreshed_at
        FROM source_stats s JOIN workspaces w ON w.id = s.workspace_id
        WHERE {_WS}
        ORDER BY w.name, s.routes DESC, s.source""", {"ws": workspace})


def usage(engine: Engine, workspace: str | None = None, days: int = 30) -> list[dict]:
    """Daily usage of the last ``days`` days: ``workspace``, ``day`` (date), ``routes``, ``sources``,
    ``checks``, ``alive_checks``; newest day first."""
    since = (datetime.now(UTC) - timedelta(days=days)).date()
    return _rows(engine, f"""
        SELECT w.name AS workspace, u.day, u.routes, u.sources, u.checks, u.alive_checks
        FROM workspace_usage u JOIN workspaces w ON w.id = u.workspace_id
        WHERE u.day >= :since AND {_WS}
        ORDER BY u.day DESC, w.name""", {"since": since, "ws": workspace})


__all__ = ["hourly", "sources", "timeline", "usage"]
