"""Deleting routes from PostgreSQL: the one statement every removal path runs, and the route's history.

``check_history`` has no foreign key to ``routes`` (migration ``0017``: its trigger cost a
``SELECT ... FOR KEY SHARE`` per ingested row), so the history of a deleted route goes with it here, in
the caller's transaction, instead of through ``ON DELETE CASCADE``. Every other table keyed by a route
(membership, health, reputation, failures, sources, daily counters, blacklist flags) still cascades.

Why no result lands on a deleted route, and none is left behind:

* the ``DELETE FROM routes`` comes first and holds the rows' locks until commit. Ingestion
  (:mod:`magpie.stats.store`) locks every route of its batch ``FOR KEY SHARE`` before it writes history,
  so it waits for this transaction, finds the route gone and dead-letters the result;
* the history is deleted by a *second* statement: under ``READ COMMITTED`` it takes a new snapshot, so it
  also sees the rows of an ingestion transaction that held the route's lock when the first statement
  started (the ``DELETE`` waited for its commit). A single statement (one data-modifying ``WITH``) would
  run on the older snapshot and miss those rows.

The history delete walks ``ix_check_history_route_id_checked_at`` on every partition.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

_DELETE_ROUTES = """
    DELETE FROM routes r
    WHERE r.id = ANY(CAST(:ids AS bigint[]))
      AND (CAST(:owned AS boolean) OR NOT EXISTS (SELECT 1 FROM route_workspaces rw WHERE rw.route_id = r.id))
    RETURNING r.id
"""
_DELETE_HISTORY = "DELETE FROM check_history WHERE route_id = ANY(CAST(:ids AS bigint[]))"


def delete_routes(conn: sa.Connection, ids: Sequence[int], *, owned: bool = False) -> list[int]:
    """Delete the routes ``ids`` and their ``check_history`` rows in ``conn``'s transaction (which must be
    ``READ COMMITTED``, the default; see the module doc).

    Args:
        conn: a connection inside a transaction; nothing is committed here.
        ids: ``routes.id`` values; unknown ids are ignored.
        owned: also delete routes some workspace still owns. False (the default): a route a workspace
            owns (again: an import may have added one since the caller looked) is kept, with its history.
    Returns:
        The ids deleted, sorted.
    Raises:
        sqlalchemy.exc.DBAPIError: a database failure (the caller's transaction is then to be rolled back).
    """
    if not ids:
        return []
    gone = sorted(int(i) for i in conn.execute(
        sa.text(_DELETE_ROUTES), {"ids": sorted({int(i) for i in ids}), "owned": bool(owned)}).scalars())
    if gone:
        conn.execute(sa.text(_DELETE_HISTORY), {"ids": gone})
    return gone


__all__ = ["delete_routes"]
