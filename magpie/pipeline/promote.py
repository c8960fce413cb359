"""The check cycle's claiming side: promote claims due routes and hands out leases in check messages.

Promote runs on its own queue and worker, apart from the checks, so a busy check pool never starves it.
It claims no more routes than the running check engines have slots (their announced capacity, see
:mod:`magpie.queue.capacity`) and never more than ``MAGPIE_MAX_INFLIGHT`` leases outstanding; both caps
are enforced atomically inside ``pop.lua``, so two promote passes at once cannot claim twice. The checking
side, which runs the leases, completes them and publishes their results, is :mod:`magpie.pipeline.checkpool`.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import redis

from magpie.queue import RouteQueue

log = logging.getLogger(__name__)


def promote(queue: RouteQueue, dispatch: Callable[[list[dict]], None], *, budget: int, max_inflight: int,
            pop_batch: int = 64, routes_per_task: int = 250, capacity: int | None = None, admit=None) -> int:
    """Claim due routes and dispatch them, ``routes_per_task`` leases per message; a lease of a route in
    quarantine (:attr:`Lease.alone`) goes in a message of its own.

    Args:
        dispatch: called with a list of :meth:`Lease.to_dict` dicts (one check-task message; the
            Celery dispatch seals the list as one unit, :mod:`magpie.queue.seal`, so no payload or
            credential reaches the broker or task events in clear).
        budget: most routes claimed in this pass (catch-up after downtime never bursts past it).
        max_inflight: cap on outstanding leases (``MAGPIE_MAX_INFLIGHT``).
        pop_batch: routes per ``pop.lua`` call.
        routes_per_task: leases per check message.
        capacity: slots of the running check engines; outstanding leases never exceed it (0 claims
            nothing). None: no engine cap (tests and one-shot tools).
        admit: ``admit(leases) -> (go ahead, [(lease, defer ms)])``, e.g.
            :meth:`magpie.coordination.ratelimit.WorkspaceBudget.admit`; a deferred lease ends its cycle at once and
            comes back after its delay (``retry.lua``, not the route's fault). Deferred routes count
            against ``budget``, not in the result. None: every claim goes ahead.
    Returns the number of routes claimed and dispatched. If ``dispatch`` raises, the claimed leases simply expire and the
    routes come back (Redis, not the broker, is the source of truth).
    """
    if capacity is not None:
        max_inflight = min(max_inflight, capacity)
        if max_inflight <= 0:
            return 0
    claimed = 0
    popped = 0
    batch: list[dict] = []

    def send(dicts: list[dict]) -> None:
        now = time.time() * 1000
        for d in dicts:
            d["dispatched_ms"] = now
        dispatch(dicts)

    try:
        while popped < budget:
            leases = queue.pop(min(pop_batch, budget - popped), max_inflight=max_inflight)
            if not leases:
                break
            popped += len(leases)
            if admit is not None:
                leases, deferred = admit(leases)
                for le, delay_ms in deferred:
                    _defer(queue, le, delay_ms)
            claimed += len(leases)
            now = time.time() * 1000
            for le in leases:
                if not le.claimed_ms:
                    le.claimed_ms = now
                if le.alone:
                    send([le.to_dict()])
                else:
                    batch.append(le.to_dict())
            while len(batch) >= routes_per_task:
                send(batch[:routes_per_task])
                del batch[:routes_per_task]
    finally:
        if batch:
            send(batch)
    return claimed


def _defer(queue: RouteQueue, lease, delay_ms: int) -> None:
    """End ``lease``'s cycle unchecked and bring the route back after ``delay_ms`` (its lease expires
    instead when the call fails)."""
    from magpie.errors import MagpieError

    try:
        queue.retry(lease, delay_ms)
    except (MagpieError, redis.RedisError, OSError) as exc:
        log.debug("deferral of %s failed (%s); its lease expires instead", lease.member, type(exc).__name__)


def promote_with_settings(queue: RouteQueue, sched, dispatch: Callable[[list[dict]], None], *,
                          capacity: int | None, workspace_budget=None) -> int:
    """:func:`promote` with the deployment's limits: one beat-triggered promote pass.

    Args:
        queue: the deployment's route queue.
        sched: the schedule's :class:`magpie.config.ScheduleSettings` (promote's limits).
        dispatch: sends one check message (a list of :meth:`Lease.to_dict` dicts).
        capacity: check slots the running engines announce
            (:meth:`magpie.queue.capacity.CapacityRegistry.total`); see :func:`promote`.
        workspace_budget: a :class:`magpie.coordination.ratelimit.WorkspaceBudget` deferring claims of workspaces over
            their checks/s (None: no per-workspace limit).
    Returns the number of routes claimed.

    ``MAGPIE_PROMOTE_BUDGET`` holds per second across concurrent passes (two beats, a restart's burst):
    each pass takes its budget from a per-second bucket in Redis (:func:`take_promote_budget`) and hands
    back what it did not claim. Fair shares from the live instances (:func:`magpie.coordination.instances.promote_shares`):
    a pass asks for the budget divided by the live beats, and its leases go out in messages of at most
    the granted routes (or the engines' slots, when fewer) divided by the live check engines, so every
    engine gets a share.
    """
    from magpie.coordination.instances import fair_share, promote_shares

    shares = promote_shares(queue, sched.promote_budget)  # live beats and check engines (magpie.coordination.instances)
    granted, second = take_promote_budget(queue, sched.promote_budget, want=shares.want)
    if granted <= 0:
        return 0
    # every engine gets leases: a message carries at most an engine's share of what this pass can claim
    # (the budget, or the engines' slots when fewer), so one engine never takes a whole pass
    per_task = min(sched.routes_per_task,
                   fair_share(granted if capacity is None else min(granted, capacity), shares.engines))
    # If promote raises, nothing is handed back: the bucket errs on the safe side.
    claimed = promote(queue, dispatch, budget=granted, max_inflight=sched.max_inflight,
                      pop_batch=sched.pop_batch, routes_per_task=per_task, capacity=capacity,
                      admit=workspace_budget.admit if workspace_budget is not None else None)
    if claimed < granted:
        give_back_promote_budget(queue, granted - claimed, second)
    return claimed


@functools.cache
def _budget_text() -> str:
    from magpie.queue.scripts import LUA_DIR

    return (LUA_DIR / "promote_budget.lua").read_text(encoding="utf-8")


def budget_key(queue: RouteQueue) -> str:
    """Key of promote's per-second budget bucket, under the schedule's hash tag."""
    return queue.side_key("promote_budget")


def take_promote_budget(queue: RouteQueue, budget: int, want: int | None = None) -> tuple[int, int]:
    """Take up to ``want`` (default ``budget``) routes from this second's shared promote budget
    (``lua/promote_budget.lua``, Redis clock): ``(granted, second)``. Passes in the same second share
    ``budget`` between them.

    Raises ``redis.RedisError`` when Redis is unreachable."""
    granted, second = queue.redis.register_script(_budget_text())(
        keys=[budget_key(queue)], args=["take", int(budget if want is None else want), int(budget)])
    return int(granted), int(second)


def give_back_promote_budget(queue: RouteQueue, unused: int, second: int) -> None:
    """Hand ``unused`` routes of a grant taken in ``second`` back to the bucket (only while that second
    lasts). Raises ``redis.RedisError`` when Redis is unreachable."""
    queue.redis.register_script(_budget_text())(keys=[budget_key(queue)],
                                                args=["give", int(unused), int(second)])
