"""Failure streaks per (workspace, route), updated inside the ingestion transaction.

Every owner of a route checked the same way shares the route's streak, which ingestion keeps anyway
(``route_health.consecutive_failures``); nothing more is written for it. Only a route whose owners are
checked differently (several check variants) publishes each owner's outcome (the entry field ``wf``,
``"<workspace id>:<1|0>,..."``, see :attr:`magpie.checker.result.CheckResult.owners`), and
:func:`update_failures` keeps those streaks in ``route_failures``: an alive outcome resets, a failure
adds one, the entries of a route apply in stream order, only current owners get a row, rows are written
in (workspace, route) order (concurrent consumers do not deadlock on them).

:data:`STREAK_SQL` is the one definition of an owner's streak: its ``route_failures`` row while that row
is at least as new as the route's newest check, else the route's own streak.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from magpie.db.bulk import bool_array, int_array, timestamp_array

OWNERS_FIELD = "wf"

STREAK_SQL = ("CASE WHEN f.last_checked_at IS NOT NULL AND f.last_checked_at >= h.last_checked_at "
              "THEN f.consecutive_failures ELSE coalesce(h.consecutive_failures, 0) END")
"""An owner's streak, over ``route_failures f`` LEFT JOINed and ``route_health h`` (see the module doc)."""

_PAIRS = """
    SELECT u.ws, u.rid, u.reset, u.add, u.lf, u.lc
    FROM unnest(%s::integer[], %s::bigint[], %s::boolean[], %s::integer[], %s::timestamptz[],
                %s::timestamptz[]) AS u(ws, rid, reset, add, lf, lc)
    JOIN route_workspaces rw ON rw.workspace_id = u.ws AND rw.route_id = u.rid
"""
_UPSERT = """
    INSERT INTO route_failures AS f (workspace_id, route_id, consecutive_failures, last_failed_at,
                                     last_checked_at, updated_at)
    SELECT ws, rid, add, lf, lc, now() FROM ({source}) AS s WHERE s.reset = %s ORDER BY ws, rid
    ON CONFLICT (workspace_id, route_id) DO UPDATE SET
        consecutive_failures = {streak},
        last_failed_at = coalesce(EXCLUDED.last_failed_at, f.last_failed_at),
        last_checked_at = greatest(EXCLUDED.last_checked_at, f.last_checked_at),
        updated_at = now()
"""

_PAIR_ARRAYS = (int_array, int_array, bool_array, int_array, timestamp_array, timestamp_array)
"""Literal builders of :data:`_PAIRS`' arrays, in its order."""


def parse_owners(text: str) -> list[tuple[int, bool]]:
    """``"3:1,7:0"`` -> ``[(3, True), (7, False)]``; malformed parts are skipped."""
    out = []
    for part in (text or "").split(","):
        ws, _, flag = part.partition(":")
        if ws.strip().isdigit() and flag.strip() in ("0", "1"):
            out.append((int(ws), flag.strip() == "1"))
    return out


def _fold(outcomes: list[tuple[bool, object]]) -> tuple[bool, int, object, object]:
    """(reset, failures after the last alive outcome, time of the last failure, time of the last outcome)
    of ordered ``(alive, checked_at)`` outcomes."""
    reset, add, last_failed, last = False, 0, None, None
    for alive, at in outcomes:
        last = at
        if alive:
            reset, add = True, 0
        else:
            add += 1
            last_failed = at
    return reset, add, last_failed, last


def update_failures(conn: sa.Connection, entries: Sequence) -> None:
    """Apply the per-owner outcomes of ``entries`` (:class:`magpie.stats.entry.StreamEntry`) in
    ``conn``'s transaction: nothing for entries without ``wf``, else one or two statements per batch.
    Raises ``DBAPIError``."""
    per_pair: dict[tuple[int, int], list] = {}
    for e in entries:
        owners = e.fields.get(OWNERS_FIELD) if e.fields else None
        if owners:
            for ws, alive in parse_owners(owners):
                per_pair.setdefault((ws, e.route_id), []).append((e.order, alive, e.checked_at))
    if not per_pair:
        return
    cols: tuple[list, ...] = ([], [], [], [], [], [])
    for (ws, rid), outs in sorted(per_pair.items()):
        outs.sort(key=lambda o: o[0])
        for col, v in zip(cols, (ws, rid, *_fold([(a, t) for _, a, t in outs]))):
            col.append(v)
    arrays = tuple(f(col) for f, col in zip(_PAIR_ARRAYS, cols))  # each array one literal (magpie.db.bulk)
    for reset, streak in ((True, "EXCLUDED.consecutive_failures"),
                          (False, "f.consecutive_failures + EXCLUDED.consecutive_failures")):
        if reset in cols[2]:
            conn.exec_driver_sql(_UPSERT.format(source=_PAIRS, streak=streak), (*arrays, reset))
