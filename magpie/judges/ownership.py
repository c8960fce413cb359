"""Ownership off the hot path: auto-remove after N failures, batched verification, fenced application.

Three steps, none of them on a check's path:

1. **Auto-remove** (job ``route_ownership``): a workspace whose profile sets ``auto_remove_after = N``
   loses its ownership (``route_workspaces``) of every route with ``N`` consecutive failures under its
   profile (:data:`magpie.judges.failures.STREAK_SQL`, kept by ingestion); batched, ``FOR UPDATE SKIP
   LOCKED``.
2. **Verification** (same job): a batch of routes at a time (resume cursor in the job's state, and at once
   for the routes step 1 touched), the Redis payload's owners (read first) are compared with PostgreSQL's
   (read second, so an import that reached Redis has reached PostgreSQL too). Owners Redis has and
   PostgreSQL does not are recorded as *pending drops* in the hash ``<prefix>owners:drop`` (route hash ->
   workspace ids); owners PostgreSQL has and Redis lacks are merged back through the import's own
   schedule merge. A route no workspace owns that has left Redis is deleted from PostgreSQL.
3. **Application** (the check pool, :class:`OwnerChanges`): when a leased route with a pending drop
   finishes its check, its lease completes in the pool's one fenced completion call with the other
   finished leases, carrying the desired owners: only the delta is applied to the payload as stored now
   (workspaces a concurrent import added stay, and the route stays with them), a route left without
   owners is removed, and the results are appended in the same script call under the stream's bound and
   overflow policy. The pending drop is cleared only if unchanged meanwhile (compare-and-delete). One
   ``HMGET`` per completion flush.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import sqlalchemy as sa

from magpie.db.deletion import delete_routes
from magpie.judges.failures import STREAK_SQL
from magpie.maintenance.base import Job, JobContext

log = logging.getLogger(__name__)

_CAD = "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end return 0"

_AUTO_REMOVE = f"""
    WITH due AS (
        SELECT rw.workspace_id, rw.route_id FROM check_profiles p
        JOIN route_workspaces rw ON rw.workspace_id = p.workspace_id
        JOIN route_health h ON h.route_id = rw.route_id
        LEFT JOIN route_failures f ON f.workspace_id = rw.workspace_id AND f.route_id = rw.route_id
        WHERE p.auto_remove_after IS NOT NULL AND {STREAK_SQL} >= p.auto_remove_after
        ORDER BY rw.workspace_id, rw.route_id LIMIT :batch
        FOR UPDATE OF rw SKIP LOCKED
    ), cleared AS (
        DELETE FROM route_failures f USING due
        WHERE f.workspace_id = due.workspace_id AND f.route_id = due.route_id
    )
    DELETE FROM route_workspaces rw USING due
    WHERE rw.workspace_id = due.workspace_id AND rw.route_id = due.route_id
    RETURNING rw.route_id
"""
_BATCH = "SELECT id, route_hash FROM routes WHERE id > :after ORDER BY id LIMIT :batch"
_BY_IDS = "SELECT id, route_hash FROM routes WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id"
_OWNERS = ("SELECT route_id, array_agg(workspace_id) FROM route_workspaces "
           "WHERE route_id = ANY(CAST(:ids AS bigint[])) GROUP BY route_id")


def drops_key(prefix: str) -> str:
    """The hash of pending drops: route hash -> comma-separated workspace ids."""
    return f"{prefix}owners:drop"


def payload_owners(text: str | bytes) -> set[int] | None:
    """The workspace ids of a payload (any JSON encoding), or None when it is not one."""
    try:
        doc = json.loads(text)
        return {int(x) for x in (doc.get("w") or [])} if isinstance(doc, dict) else None
    except (ValueError, TypeError, AttributeError):
        return None


def _ids(text) -> set[int]:
    if isinstance(text, bytes):
        text = text.decode()
    return {int(x) for x in (text or "").split(",") if x.strip().isdigit()}


def with_owners(payload: str, owners) -> str:
    """``payload`` (stored, compact) with its ``"w"`` list replaced by ``owners``."""
    head, sep, _ = payload.rpartition('"w":')
    return head + sep + json.dumps(sorted(set(owners)), separators=(",", ":")) + "}" if sep else payload


def schedule_of(ctx: JobContext):
    """The deployment's schedule provider (Redis or PostgreSQL, ``MAGPIE_SCHEDULE_URL``)."""
    from magpie.queue.provider import create_provider

    return create_provider(None, ctx.settings, redis_client=ctx.redis)


def verify_routes(ctx: JobContext, rows, queue) -> dict:
    """Step 2 of the module doc for ``rows`` of ``(id, route_hash)``; returns counts."""
    out = {"verified": 0, "drops": 0, "readded": 0, "deleted": 0}
    if not rows:
        return out
    members = [h.strip() for _, h in rows]
    payloads = queue.payloads(members)  # the schedule first
    with ctx.engine.connect() as conn:
        owners = dict(conn.execute(sa.text(_OWNERS), {"ids": [r[0] for r in rows]}).all())
    key = drops_key(ctx.settings.redis_prefix)
    pending = ctx.redis.hmget(key, members)
    gone: list[int] = []
    readd: list[tuple[str, str]] = []
    for (rid, _), member, raw, old in zip(rows, members, payloads, pending):
        pg_owners = set(owners.get(rid) or ())
        out["verified"] += 1
        if raw is None:
            if not pg_owners:
                gone.append(rid)
            continue
        text = raw.decode() if isinstance(raw, bytes) else raw
        have = payload_owners(text)
        if have is None:
            continue
        drop = have - pg_owners
        if drop:
            merged = sorted(drop | (_ids(old) & have))
            ctx.redis.hset(key, member, ",".join(map(str, merged)))
            out["drops"] += 1
        if pg_owners - have:
            readd.append((member, with_owners(text, pg_owners - have)))
    if readd:
        queue.schedule(readd)
        out["readded"] += len(readd)
    if gone:
        with ctx.engine.begin() as conn:
            ctx.fence(conn)
            out["deleted"] += len(delete_routes(conn, gone))
    return out


class RouteOwnershipJob(Job):
    name = "route_ownership"
    every = 60.0
    description = "auto-remove ownership after N failures; verify owners against Redis in batches"

    def run(self, ctx: JobContext) -> dict:
        queue = schedule_of(ctx)
        total = {"auto_removed": 0, "verified": 0, "drops": 0, "readded": 0, "deleted": 0}

        def add(counts):
            for k, v in counts.items():
                total[k] += v

        touched: set[int] = set()
        while not ctx.should_stop():  # step 1
            with ctx.engine.begin() as conn:
                ctx.fence(conn)
                ids = list(conn.execute(sa.text(_AUTO_REMOVE), {"batch": ctx.batch_size}).scalars())
            ctx.tick()
            total["auto_removed"] += len(ids)
            touched.update(ids)
            if len(ids) < ctx.batch_size:
                break
        for i in range(0, len(touched), ctx.batch_size):  # the touched routes at once
            chunk = sorted(touched)[i: i + ctx.batch_size]
            with ctx.engine.connect() as conn:
                rows = conn.execute(sa.text(_BY_IDS), {"ids": chunk}).all()
            add(verify_routes(ctx, rows, queue))
        after = int(ctx.state.get("after", 0))
        left = ctx.settings.ownership_verify_per_pass
        while left > 0 and not ctx.should_stop():  # step 2, resumable, a bounded share per pass
            batch = min(ctx.batch_size, left)
            with ctx.engine.connect() as conn:
                rows = conn.execute(sa.text(_BATCH), {"after": after, "batch": batch}).all()
            left -= batch
            add(verify_routes(ctx, rows, queue))
            ctx.tick()
            after = rows[-1][0] if len(rows) == batch else 0
            ctx.save_state({"after": after})
            if after == 0:
                return {**total, "complete": True}
        return {**total, "complete": False}


@dataclass(slots=True)
class OwnerPlan:
    """The ownership changes of one completion flush (:meth:`OwnerChanges.plan`).

    Attributes:
        desired: per finished lease, the holder's desired payload (``{"w": [...]}``) for the completion
            to apply, or None (no pending drop applies).
        pending: per finished lease, the pending drop as read (cleared after the change by
            compare-and-delete).
    """

    desired: list[str | None]
    pending: list


class OwnerChanges:
    """Step 3 of the module doc: the check pool's collaborator at each completion flush.

    The pool asks :meth:`plan` for the desired payloads of its finished leases, completes them all in its
    one atomic completion call (``complete_with_results`` with ``desired``: the fenced completion applies
    the ownership delta, or removes a route left without owners, and appends the results under the
    stream's bound and overflow policy), then hands the codes to :meth:`settle`.

    Args:
        redis: client on the Redis holding the pending drops.
        prefix: key prefix (``MAGPIE_REDIS_PREFIX``).
    """

    def __init__(self, redis, prefix: str) -> None:
        self.r = redis
        self.key = drops_key(prefix)
        self.applied = self.removed = self.kept_by_import = 0

    def plan(self, done: list) -> OwnerPlan | None:
        """The ownership changes of ``done`` (``(lease, payload, result)`` triples): one ``HMGET``. None
        when no pending drop applies (or Redis is away: the drops wait a cycle). A pending drop that
        names none of the lease's owners is cleared at once."""
        if not done:
            return None
        try:
            pending = self.r.hmget(self.key, [le.member for le, _, _ in done])
        except Exception:  # noqa: BLE001 - Redis trouble: complete as usual, the drop waits a cycle
            return None
        if not any(pending):
            return None
        desired: list[str | None] = []
        for (le, payload, _), raw in zip(done, pending):
            want = None
            if raw is not None:
                drop = _ids(raw)
                keep = [w for w in payload.workspaces if w not in drop]
                if len(keep) == len(payload.workspaces):
                    self._clear(le.member, raw)
                else:
                    want = json.dumps({"w": keep})  # the merge reads only "w", in any JSON encoding
            desired.append(want)
        return OwnerPlan(desired, list(pending)) if any(d is not None for d in desired) else None

    def settle(self, done: list, plan: OwnerPlan, codes: list[int]) -> None:
        """After the completion of ``done`` with ``plan``: clear the applied drops (only if unchanged
        meanwhile) and count them. A refused lease keeps its drop for its next cycle."""
        from magpie.queue import COMPLETED, REMOVED

        for (le, _, _), want, raw, code in zip(done, plan.desired, plan.pending, codes):
            if want is None or code not in (COMPLETED, REMOVED):
                if want is not None:
                    log.debug("owner change of %s not applied (code %s); it waits for the next cycle",
                              le.member, code)
                continue
            self.applied += 1
            if code == REMOVED:
                self.removed += 1
            elif not json.loads(want)["w"]:
                self.kept_by_import += 1  # an import added an owner after the claim: the route stays
            self._clear(le.member, raw)

    def _clear(self, member: str, raw) -> None:
        try:
            self.r.eval(_CAD, 1, self.key, member, raw)
        except Exception:  # noqa: BLE001 - the next flush clears it
            log.debug("pending drop of %s not cleared", member)


JOB = RouteOwnershipJob()
