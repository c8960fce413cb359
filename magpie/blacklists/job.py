"""Job ``blacklist_refresh``: re-read the sources, flag listed routes, apply each workspace's policy.

A pass, under the job's leader lock, every write fenced with its token:

1. **Sources.** Each enabled source is read (a file, or a URL through the egress guard) and parsed
   (:mod:`magpie.blacklists.sources`); when its content hash changed, its entries are replaced in one
   transaction. A source that cannot be read keeps its previous entries and records ``last_error``; the
   pass goes on and fails at its end (so the run record and ``magpie_maintenance_failures`` show it).
2. **Routes.** Routes whose host is an IP address are matched against every enabled source's ranges, in
   batches of ``MAGPIE_MAINTENANCE_BATCH_SIZE`` by route id (``FOR UPDATE SKIP LOCKED``: a route an import
   holds is left to the next sweep), resuming from the saved cursor. Host names are not matched. Per batch,
   one transaction: listed routes get a ``route_blacklist`` row, routes no longer listed lose theirs, then
   per owning workspace's policy (``blacklist_policies``, else ``MAGPIE_BLACKLIST_POLICY``):

   * ``flag``: nothing more (the route is still checked);
   * ``remove``: the workspace's membership is deleted; a route no workspace owns any more leaves the
     Redis schedule through the fenced operator removal (:meth:`magpie.queue.RouteQueue.remove_route`,
     refused while a check holds its lease: retried next pass) and then PostgreSQL, as
     :mod:`magpie.maintenance.orphans` does;
   * ``skip``: the membership stays; while no owning workspace has ``flag``, the route is taken off the
     schedule (same fenced removal, ``unscheduled`` set) and stays in PostgreSQL.

   A route that is no longer listed, or gains a ``flag`` workspace, goes back on the schedule. A schedule
   rebuild puts unscheduled routes back; the next sweep takes them off again.

Running a pass twice changes nothing the second time (same hashes, same flags).
"""

from __future__ import annotations

import sqlalchemy as sa

from magpie.db.deletion import delete_routes
from magpie.errors import MagpieError
from magpie.maintenance.base import Job, JobContext

_CHUNK = 10_000  # entries per INSERT

_IP_HOST = "(r.host ~ '^[0-9.]+$' OR strpos(r.host, ':') > 0)"
"""Hosts stored as IP addresses (normalised: names never hold ':' nor only digits and dots)."""

_BATCH = f"""
    SELECT r.id, r.route_hash, m.source_id, m.network
    FROM routes r
    LEFT JOIN LATERAL (
        SELECT e.source_id, e.network FROM blacklist_entries e
        JOIN blacklist_sources s ON s.id = e.source_id AND s.enabled
        WHERE e.network >>= CASE WHEN {_IP_HOST} THEN CAST(r.host AS inet) END
        ORDER BY e.source_id, masklen(e.network) DESC LIMIT 1
    ) m ON true
    WHERE r.id > :after AND {_IP_HOST}
    ORDER BY r.id LIMIT :batch
    FOR UPDATE OF r SKIP LOCKED
"""
_FLAG = """
    INSERT INTO route_blacklist (route_id, source_id, network)
    SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:sources AS int[]), CAST(:nets AS cidr[]))
    ON CONFLICT (route_id) DO UPDATE SET source_id = EXCLUDED.source_id, network = EXCLUDED.network
"""
_UNFLAG = """
    DELETE FROM route_blacklist WHERE route_id = ANY(CAST(:ids AS bigint[])) RETURNING route_id, unscheduled
"""
_MEMBERS = """
    SELECT rw.route_id, rw.workspace_id, coalesce(p.policy, :default) FROM route_workspaces rw
    LEFT JOIN blacklist_policies p ON p.workspace_id = rw.workspace_id
    WHERE rw.route_id = ANY(CAST(:ids AS bigint[]))
"""
_UNLINK = """
    DELETE FROM route_workspaces WHERE route_id = :r AND workspace_id = :w
"""


class SourceRefreshFailed(MagpieError, RuntimeError):
    """Some blacklist sources could not be read this pass (their previous entries stay in use)."""


def refresh_sources(ctx: JobContext) -> dict:
    """Step 1 of the module docstring. Returns counts and ``errors`` (``[source name: reason]``)."""
    from magpie.blacklists.sources import SourceError, parse_entries, read_source

    out = {"sources": 0, "sources_changed": 0, "entries": 0, "invalid_entries": 0, "errors": []}
    with ctx.engine.connect() as conn:
        sources = conn.execute(sa.text(
            "SELECT id, name, location, content_hash FROM blacklist_sources WHERE enabled ORDER BY id")).all()
    for sid, name, location, old_hash in sources:
        if ctx.should_stop():
            break
        out["sources"] += 1
        try:
            parsed = parse_entries(read_source(location, ctx.settings), ctx.settings.blacklist_max_entries)
        except SourceError as exc:
            out["errors"].append(f"{name}: {exc}")
            with ctx.engine.begin() as conn:
                ctx.fence(conn)
                conn.execute(sa.text("UPDATE blacklist_sources SET last_error = :e, last_error_at = now() "
                                     "WHERE id = :i"), {"e": str(exc)[:500], "i": sid})
            ctx.tick()
            continue
        out["entries"] += len(parsed.networks)
        out["invalid_entries"] += parsed.invalid
        with ctx.engine.begin() as conn:
            ctx.fence(conn)
            if parsed.digest != old_hash:
                out["sources_changed"] += 1
                conn.execute(sa.text("DELETE FROM blacklist_entries WHERE source_id = :i"), {"i": sid})
                nets = [str(n) for n in parsed.networks]
                for off in range(0, len(nets), _CHUNK):
                    conn.execute(sa.text(
                        "INSERT INTO blacklist_entries (source_id, network) "
                        "SELECT :i, n FROM unnest(CAST(:nets AS cidr[])) AS n"), {"i": sid, "nets": nets[off:off + _CHUNK]})
            conn.execute(sa.text(
                "UPDATE blacklist_sources SET content_hash = :h, entries = :n, refreshed_at = now(), "
                "last_error = NULL WHERE id = :i"), {"h": parsed.digest, "n": len(parsed.networks), "i": sid})
        ctx.tick()
    return out


def _reschedule(ctx: JobContext, queue, conn, ids: list[int]) -> int:
    """Put routes ``ids`` (those some workspace owns) back on the schedule; returns how many were fed."""
    if not ids:
        return 0
    from magpie.base.crypto import get_keyring
    from magpie.db.repo import RouteRecord
    from magpie.queue.payload import schedule_item, write_cipher
    from magpie.base.routes import Route

    keyring = get_keyring(ctx.settings.encryption_key)
    rows = conn.execute(sa.text(
        "SELECT r.id, r.route_hash, r.protocol, r.host, r.port, r.username_enc, r.password_enc, "
        "array_agg(rw.workspace_id ORDER BY rw.workspace_id) FROM routes r "
        "JOIN route_workspaces rw ON rw.route_id = r.id WHERE r.id = ANY(CAST(:ids AS bigint[])) GROUP BY r.id"),
        {"ids": ids}).all()
    cipher = write_cipher(ctx.settings)
    items = []
    for rid, rhash, proto, host, port, uenc, penc, ws in rows:
        route = Route(proto, host, port, keyring.decrypt(uenc) if uenc else None,
                      keyring.decrypt(penc) if penc else None)
        items.append(schedule_item(RouteRecord(rid, rhash, route, list(ws)), cipher))
    if items:
        queue.schedule(items)
    return len(items)


def _remove_from_schedule(queue, route_hash: str) -> bool:
    """Fenced operator removal; False while a check holds the route's lease (retried next pass)."""
    from magpie.errors import Refusal
    from magpie.queue import QueueError

    try:
        queue.remove_route(route_hash.strip())
    except QueueError as exc:
        if exc.code is Refusal.ACTIVE_LEASES:
            return False
        if exc.code is not Refusal.GONE:
            raise
    return True


def apply_batch(ctx: JobContext, queue, conn, rows, counts: dict) -> None:
    """Step 2 of the module docstring for one batch of ``(id, route_hash, source_id, network)`` rows."""
    listed = [r for r in rows if r[2] is not None]
    clear = [r[0] for r in rows if r[2] is None]
    hashes = {r[0]: r[1] for r in rows}
    if clear:
        dropped = conn.execute(sa.text(_UNFLAG), {"ids": clear}).all()
        counts["unflagged"] += len(dropped)
        back = [rid for rid, unscheduled in dropped if unscheduled]
        counts["rescheduled"] += _reschedule(ctx, queue, conn, back)
    if not listed:
        return
    ids = [r[0] for r in listed]
    conn.execute(sa.text(_FLAG), {"ids": ids, "sources": [r[2] for r in listed], "nets": [str(r[3]) for r in listed]})
    counts["listed"] += len(ids)
    members: dict[int, list[tuple[int, str]]] = {}
    for rid, wid, policy in conn.execute(sa.text(_MEMBERS), {"ids": ids, "default": ctx.settings.blacklist_policy}):
        members.setdefault(rid, []).append((wid, policy))
    orphaned, back = [], []
    for rid in ids:
        kept = []
        for wid, policy in members.get(rid, []):
            if policy == "remove":
                conn.execute(sa.text(_UNLINK), {"r": rid, "w": wid})
                counts["memberships_removed"] += 1
            else:
                kept.append(policy)
        if not kept:  # no workspace owns it (now, or since a pass its lease held up)
            orphaned.append(rid)
        elif "flag" not in kept:
            if _remove_from_schedule(queue, hashes[rid]):  # every sweep: a rebuild may have put it back
                counts["unscheduled"] += conn.execute(sa.text(
                    "UPDATE route_blacklist SET unscheduled = true WHERE route_id = :r AND NOT unscheduled"),
                    {"r": rid}).rowcount
            else:
                counts["skipped_leased"] += 1
        else:
            was = conn.execute(sa.text("UPDATE route_blacklist SET unscheduled = false WHERE route_id = :r "
                                       "AND unscheduled RETURNING route_id"), {"r": rid}).scalar()
            if was is not None:
                back.append(rid)
    counts["rescheduled"] += _reschedule(ctx, queue, conn, back)
    gone = [rid for rid in orphaned if _remove_from_schedule(queue, hashes[rid])]
    counts["skipped_leased"] += len(orphaned) - len(gone)
    if gone:
        counts["routes_removed"] += len(delete_routes(conn, gone))


class BlacklistRefreshJob(Job):
    name = "blacklist_refresh"
    every = 3600.0
    description = "re-read blacklist sources; flag listed routes, skip or remove them per workspace policy"

    def run(self, ctx: JobContext) -> dict:
        result = refresh_sources(ctx)
        errors = result.pop("errors")
        counts = {"scanned": 0, "listed": 0, "unflagged": 0, "memberships_removed": 0, "routes_removed": 0,
                  "unscheduled": 0, "rescheduled": 0, "skipped_leased": 0}
        queue = ctx.queue()
        after = int(ctx.state.get("after", 0))
        complete = False
        while not ctx.should_stop():
            with ctx.engine.begin() as conn:
                ctx.fence(conn)
                rows = conn.execute(sa.text(_BATCH), {"after": after, "batch": ctx.batch_size}).all()
                if rows:
                    apply_batch(ctx, queue, conn, rows, counts)
                    after = rows[-1][0]
                counts["scanned"] += len(rows)
                complete = len(rows) < ctx.batch_size
                ctx.save_state({"after": 0 if complete else after}, conn)
            ctx.tick()
            if complete:
                break
        result.update(counts, complete=complete)
        if errors:
            raise SourceRefreshFailed(f"{len(errors)} of {result['sources']} blacklist sources failed: "
                                      + "; ".join(errors)[:1500])
        return result


JOB = BlacklistRefreshJob()
