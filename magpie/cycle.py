"""The check cycle's claiming side: promote claims due routes and hands out leases in check messages.

Promote runs on its own queue and worker, apart from the checks, so a busy check pool never starves it.
It claims no more routes than the running check engines have slots (their announced capacity, see
:mod:`magpie.queue.capacity`) and never more than ``MAGPIE_MAX_INFLIGHT`` leases outstanding; both caps
are enforced atomically inside ``pop.lua``, so two promote passes at once cannot claim twice. The checking
side, which runs the leases, completes them and publishes their results, is :mod:`magpie.checkpool`.
"""

from __future__ import annotations

from typing import Callable

from magpie.checkpool import BatchReport  # noqa: F401 (re-exported: the outcome counts of a flush)
from magpie.queue import RouteQueue


def promote(queue: RouteQueue, dispatch: Callable[[list[dict]], None], *, budget: int, max_inflight: int,
            pop_batch: int = 64, routes_per_task: int = 250, capacity: int | None = None) -> int:
    """Claim due routes and dispatch them, ``routes_per_task`` leases per message.

    Args:
        dispatch: called with a list of :meth:`Lease.to_dict` dicts (one check-task message).
        budget: most routes claimed in this pass (catch-up after downtime never bursts past it).
        max_inflight: cap on outstanding leases (``MAGPIE_MAX_INFLIGHT``).
        pop_batch: routes per ``pop.lua`` call.
        routes_per_task: leases per check message.
        capacity: slots of the running check engines; outstanding leases never exceed it (0 claims
            nothing). None: no engine cap (tests and one-shot tools).
    Returns the number of routes claimed. If ``dispatch`` raises, the claimed leases simply expire and the
    routes come back (Redis, not the broker, is the source of truth).
    """
    if capacity is not None:
        max_inflight = min(max_inflight, capacity)
        if max_inflight <= 0:
            return 0
    claimed = 0
    batch: list[dict] = []
    try:
        while claimed < budget:
            leases = queue.pop(min(pop_batch, budget - claimed), max_inflight=max_inflight)
            if not leases:
                break
            claimed += len(leases)
            batch.extend(le.to_dict() for le in leases)
            while len(batch) >= routes_per_task:
                dispatch(batch[:routes_per_task])
                del batch[:routes_per_task]
    finally:
        if batch:
            dispatch(batch)
    return claimed


def promote_with_settings(queue: RouteQueue, settings, dispatch: Callable[[list[dict]], None], *,
                          capacity: int | None) -> int:
    """:func:`promote` with the deployment's limits: one beat-triggered promote pass.

    Args:
        queue: the deployment's route queue.
        settings: the schedule's :class:`magpie.config.ScheduleSettings` (promote's limits), or a whole
            :class:`magpie.config.Settings` whose ``schedule`` slice is used.
        dispatch: sends one check message (a list of :meth:`Lease.to_dict` dicts).
        capacity: check slots the running engines announce
            (:meth:`magpie.queue.capacity.CapacityRegistry.total`); see :func:`promote`.
    Returns the number of routes claimed.
    """
    sched = getattr(settings, "schedule", settings)
    return promote(queue, dispatch, budget=sched.promote_budget, max_inflight=sched.max_inflight,
                   pop_batch=sched.pop_batch, routes_per_task=sched.routes_per_task, capacity=capacity)
