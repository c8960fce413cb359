"""Where routes came from: ``route_sources`` rows written by imports (one per route, workspace, source).

A source is the base name of the imported file (``lists/fresh.txt`` -> ``fresh.txt``) or a list name the
caller gives. Re-importing the same source only moves ``last_seen_at``; a route imported from two sources
into one workspace has two rows and counts in both sources' statistics.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from sqlalchemy.engine import Engine

MAX_SOURCE = 200
"""Longest source name stored (characters); longer names are cut."""

_UPSERT = """
    INSERT INTO route_sources (route_id, workspace_id, source)
    SELECT r, %s, %s FROM unnest(%s::bigint[]) AS r ORDER BY r
    ON CONFLICT (route_id, workspace_id, source) DO UPDATE SET last_seen_at = now()
"""


def source_name(source) -> str:
    """The source name of an import: the base name of a path (``str`` or path-like), the ``name`` of an
    open stream (``<stdin>``), or a list name; stripped and cut to :data:`MAX_SOURCE`, ``"-"`` if empty."""
    if not isinstance(source, (str, os.PathLike)):
        source = getattr(source, "name", None) or "-"
        if not isinstance(source, (str, os.PathLike)):  # a file descriptor number
            source = "-"
    text = os.fspath(source)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    name = text if text.startswith("<") else os.path.basename(text.rstrip("/\\"))
    return name.strip()[:MAX_SOURCE] or "-"


def record_import_source(engine: Engine, workspace_id: int, route_ids: Sequence[int], source: str) -> int:
    """Record that ``route_ids`` were imported into ``workspace_id`` from ``source`` (one transaction,
    idempotent). Returns the number of distinct routes recorded.

    Raises ``sqlalchemy.exc.DBAPIError`` on a database failure."""
    ids = sorted(set(int(r) for r in route_ids))
    if not ids:
        return 0
    with engine.begin() as conn:
        conn.exec_driver_sql(_UPSERT, (int(workspace_id), source_name(source), ids))
    return len(ids)


__all__ = ["MAX_SOURCE", "record_import_source", "source_name"]
