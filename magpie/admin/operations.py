"""Operator bulk verbs shared by the command line (``magpie workspaces``, ``magpie bulk``) and the
dashboard (``/api/bulk``): workspaces, removing routes by filter, reprocessing dead letters, retrying
failed deliveries.

Every verb takes ``dry_run``: it then counts what it would do and changes nothing. Route removal goes
through the schedule's fenced calls: the payload read is compared with the stored one
(``payload_changed``: read again and retry), a route under a live lease is left for the next run
(``skipped_leased``), and PostgreSQL is changed only after the schedule, so a crash in between leaves
what the orphan sweep of :mod:`magpie.maintenance.orphans` reconciles.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.db.deletion import delete_routes
from magpie.errors import MagpieError, Refusal
from magpie.base.protocols import PROTOCOLS

_WORKSPACE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_RETRIES = 5  # fenced attempts per route when a concurrent import keeps changing its payload


class OperationError(MagpieError, ValueError):
    """A bulk verb's input is wrong for the current data; nothing changed.

    Attributes:
        code: ``"unknown_workspace"``, ``"exists"``, ``"no_filter"`` or ``"bad_value"``.
    """

    def __init__(self, message: str, code: str = "bad_value"):
        super().__init__(message)
        self.code = code


# -- workspaces ------------------------------------------------------------------------------------
def check_workspace_name(name: str) -> str:
    """``name`` if it is a usable workspace name (1-64 of letters, digits, ``_.-``, starting with a letter
    or digit); else :class:`OperationError` naming the rule (control characters never pass)."""
    if not isinstance(name, str) or not _WORKSPACE_NAME.fullmatch(name):
        raise OperationError("bad workspace name: 1-64 letters, digits, '_', '.', '-', starting with a letter "
                             "or digit")
    return name


def list_workspaces(engine: Engine) -> list[dict]:
    """Every workspace, by name: ``[{"id", "name", "routes", "created_at"}]`` (``routes``: members)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT w.id, w.name, count(rw.route_id) AS routes, w.created_at FROM workspaces w "
            "LEFT JOIN route_workspaces rw ON rw.workspace_id = w.id GROUP BY w.id ORDER BY w.name")).mappings()
        return [dict(r) for r in rows]


def create_workspace(engine: Engine, name: str, *, dry_run: bool = False) -> dict:
    """Create workspace ``name``; returns ``{"name", "id" (None on a dry run), "created": bool}``.

    Raises :class:`OperationError` for a bad name or one that exists."""
    check_workspace_name(name)
    with engine.begin() as conn:
        if conn.execute(sa.text("SELECT 1 FROM workspaces WHERE name = :n"), {"n": name}).first():
            raise OperationError(f"workspace {name!r} exists", "exists")
        if dry_run:
            return {"name": name, "id": None, "created": False}
        wid = conn.execute(sa.text("INSERT INTO workspaces (name) VALUES (:n) ON CONFLICT DO NOTHING "
                                   "RETURNING id"), {"n": name}).scalar()
    if wid is None:
        raise OperationError(f"workspace {name!r} exists", "exists")
    return {"name": name, "id": int(wid), "created": True}


def _workspace_id(conn, name: str) -> int:
    wid = conn.execute(sa.text("SELECT id FROM workspaces WHERE name = :n"), {"n": name}).scalar()
    if wid is None:
        raise OperationError(f"no workspace named {name!r}", "unknown_workspace")
    return int(wid)


def delete_workspace(engine: Engine, queue, name: str, *, dry_run: bool = False, batch: int = 500) -> dict:
    """Delete workspace ``name``: every route leaves it (fenced, see the module doc), routes no other
    workspace owns leave the schedule and PostgreSQL, then the workspace row goes.

    Returns :func:`remove_routes`'s counts plus ``{"workspace", "deleted": bool}``; ``deleted`` is False
    (run again) while some route was under a live lease. Raises :class:`OperationError` for an unknown
    workspace."""
    check_workspace_name(name)
    out = remove_routes(engine, queue, workspace=name, dry_run=dry_run, batch=batch)
    out["workspace"] = name
    out["deleted"] = False
    if dry_run or out["skipped_leased"]:
        return out
    with engine.begin() as conn:
        wid = _workspace_id(conn, name)
        left = conn.execute(sa.text("SELECT count(*) FROM route_workspaces WHERE workspace_id = :w"),
                            {"w": wid}).scalar()
        if not left:  # an import may have added routes meanwhile: they stay, and so does the workspace
            conn.execute(sa.text("DELETE FROM workspaces WHERE id = :w"), {"w": wid})
            out["deleted"] = True
    return out


# -- removing routes ---------------------------------------------------------------------------------
def _without(payload: str, wid: int | None) -> list[int]:
    ws = json.loads(payload).get("w") or []
    return [] if wid is None else sorted(w for w in ws if w != wid)


def _with_workspaces(payload: str, ws: Sequence[int]) -> str:
    d = json.loads(payload)
    d["w"] = sorted(set(ws))
    return json.dumps(d, separators=(",", ":"))


def _detach(queue, route_hash: str, wid: int | None) -> str:
    """Take route ``route_hash`` out of workspace ``wid`` (None: out of all) on the schedule.

    Returns ``"removed"`` (left the schedule), ``"updated"`` (other workspaces keep it), ``"gone"`` (not
    scheduled) or ``"leased"`` (a live lease: left for the next run)."""
    from magpie.queue import QueueError

    for _ in range(_RETRIES):
        current = queue.payload(route_hash)
        try:
            if current is None:
                queue.remove_route(route_hash)  # a dead letter's or a stray schedule entry
                return "removed"
            rest = _without(current, wid)
            if rest:
                queue.update(route_hash, _with_workspaces(current, rest), current, force=True)
                return "updated"
            queue.remove_route(route_hash, expected=current)
            return "removed"
        except QueueError as exc:
            if exc.code is Refusal.GONE:
                return "gone"
            if exc.code is Refusal.ACTIVE_LEASES:
                return "leased"
            if exc.code is not Refusal.PAYLOAD_CHANGED:
                raise
    return "leased"  # changing on every read: treated like a busy route, retried on the next run


_SELECT = """
SELECT r.id, r.route_hash FROM routes r
WHERE r.id > :after
  AND (CAST(:wid AS integer) IS NULL OR EXISTS (
       SELECT 1 FROM route_workspaces rw WHERE rw.route_id = r.id AND rw.workspace_id = :wid))
  AND (CAST(:protocol AS text) IS NULL OR r.protocol = :protocol)
  AND (CAST(:dead_days AS double precision) IS NULL OR EXISTS (
       SELECT 1 FROM route_health h WHERE h.route_id = r.id AND h.alive IS FALSE
         AND COALESCE(h.last_alive_at, r.created_at) < now() - make_interval(secs => :dead_days * 86400)))
ORDER BY r.id LIMIT :batch
"""


def remove_routes(engine: Engine, queue, *, workspace: str | None = None, protocol: str | None = None,
                  dead_days: float | None = None, dry_run: bool = False, batch: int = 500) -> dict:
    """Remove the routes matching every given filter.

    Args:
        workspace: only routes of this workspace, and only from it (other workspaces keep theirs); None:
            matching routes leave every workspace.
        protocol: one of :data:`magpie.base.protocols.PROTOCOLS`.
        dead_days: only routes whose latest check failed and that were last alive (or added, if never
            alive) more than this many days ago.
        dry_run: count the matches, change nothing.
        batch: routes per database read.
    Returns:
        ``{"matched", "removed" (left the schedule and PostgreSQL), "updated" (left the workspace only),
        "skipped_leased" (under a live lease: run again), "dry_run"}``.
    Raises:
        :class:`OperationError`: unknown workspace or protocol, negative ``dead_days``, no filter at all.
    """
    if workspace is None and protocol is None and dead_days is None:
        raise OperationError("name at least one filter: --workspace, --protocol or --dead-days", "no_filter")
    if protocol is not None and protocol not in PROTOCOLS:
        raise OperationError(f"protocol must be one of {', '.join(PROTOCOLS)}")
    if dead_days is not None and not 0 <= dead_days <= 36500:
        raise OperationError("dead days must be between 0 and 36500")
    with engine.connect() as conn:
        wid = _workspace_id(conn, workspace) if workspace is not None else None
    out = {"matched": 0, "removed": 0, "updated": 0, "skipped_leased": 0, "dry_run": dry_run}
    after = 0
    while True:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(_SELECT), {"after": after, "wid": wid, "protocol": protocol,
                                                   "dead_days": dead_days, "batch": int(batch)}).all()
        if not rows:
            return out
        after = rows[-1][0]
        out["matched"] += len(rows)
        if dry_run:
            continue
        unlink, drop = [], []
        for rid, rhash in rows:
            outcome = _detach(queue, rhash.strip(), wid)
            if outcome == "leased":
                out["skipped_leased"] += 1
                continue
            unlink.append(rid)
            if outcome in ("removed", "gone"):
                drop.append(rid)
        with engine.begin() as conn:
            if wid is not None and unlink:
                conn.execute(sa.text("DELETE FROM route_workspaces WHERE workspace_id = :w AND "
                                     "route_id = ANY(CAST(:ids AS bigint[]))"), {"w": wid, "ids": unlink})
            # a route that left the schedule goes when no workspace owns it any more (an import may have
            # added one since: then it stays, and the next rebuild schedules it again)
            ids = drop if wid is not None else unlink
            if ids:
                out["removed"] += len(delete_routes(conn, ids, owned=wid is None))  # with their history
            out["updated"] += len(unlink) - len(drop) if wid is not None else 0


# -- dead letters --------------------------------------------------------------------------------------
def reprocess_dead(queue, *, reason: str | None = None, older_than_s: float | None = None,
                   limit: int = 100_000, dry_run: bool = False) -> dict:
    """Put dead-lettered routes back, due now.

    Args:
        reason: only dead letters with this recorded reason (e.g. ``stalled``).
        older_than_s: only those dead-lettered more than this many seconds ago.
        limit: most dead letters looked at (oldest first).
    Returns:
        ``{"matched", "reprocessed", "raced" (no longer dead when reached), "dry_run"}``.
    """
    from magpie.queue import QueueError

    if older_than_s is not None and older_than_s < 0:
        raise OperationError("older-than must not be negative")
    now = queue.server_time_ms()
    dead = [d for d in queue.dead_letters(limit=int(limit))
            if (reason is None or d.get("reason") == reason)
            and (older_than_s is None or d["dead_at_ms"] <= now - older_than_s * 1000)]
    out = {"matched": len(dead), "reprocessed": 0, "raced": 0, "dry_run": dry_run}
    if dry_run:
        return out
    for d in dead:
        try:
            queue.reprocess(d["member"])
            out["reprocessed"] += 1
        except QueueError as exc:
            if exc.code not in (Refusal.NOT_DEAD, Refusal.GONE):
                raise
            out["raced"] += 1
    return out


# -- failed deliveries ---------------------------------------------------------------------------------
def retry_failed(engine: Engine, *, kind: str = "webhook", channel_id: int | None = None,
                 limit: int = 10_000, dry_run: bool = False) -> dict:
    """Give every failed delivery one more attempt, due now.

    Args:
        kind: ``webhook`` (alert deliveries) or ``email`` (the outbox).
        channel_id: webhook deliveries of this channel only.
        limit: most rows retried in one call.
    Returns:
        ``{"kind", "matched", "retried", "raced" (no longer failed when reached), "dry_run"}``.
    """
    if kind == "webhook":
        from magpie.alerts.delivery import list_deliveries, retry_delivery

        rows = list_deliveries(engine, status="failed", limit=int(limit))
        if channel_id is not None:
            rows = [r for r in rows if r.get("channel_id") == channel_id]
        retry = retry_delivery
    elif kind == "email":
        if channel_id is not None:
            raise OperationError("--channel applies to webhook deliveries only")
        from magpie.outbox.service import OUTBOX, retry_email

        rows = OUTBOX.list_rows(engine, status="failed", limit=int(limit))
        retry = retry_email
    else:
        raise OperationError("kind must be webhook or email")
    out = {"kind": kind, "matched": len(rows), "retried": 0, "raced": 0, "dry_run": dry_run}
    if dry_run:
        return out
    for r in rows:
        if retry(engine, int(r["id"])):
            out["retried"] += 1
        else:
            out["raced"] += 1
    return out


__all__ = ["OperationError", "check_workspace_name", "create_workspace", "delete_workspace", "list_workspaces",
           "remove_routes", "reprocess_dead", "retry_failed"]
