"""The check cycle: promote claims due routes and hands out leases; a check batch checks, renews, completes.

Hot path only: claim (``pop.lua``), check, renew when under ``MAGPIE_RENEW_BELOW_SECONDS``, complete
(``complete.lua``), and one pipelined ``XADD`` of the results. No database writes here: the ``stats``
queue ingests the stream (DESIGN.md, "Celery").
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from magpie.backoff import Backoff
from magpie.queue import COMPLETED, Lease, Payload, PayloadError, QueueError, RouteQueue

log = logging.getLogger(__name__)


def promote(queue: RouteQueue, dispatch: Callable[[list[dict]], None], *, budget: int, max_inflight: int,
            pop_batch: int = 64, routes_per_task: int = 16) -> int:
    """Claim due routes and dispatch them, ``routes_per_task`` leases per message.

    Args:
        dispatch: called with a list of :meth:`Lease.to_dict` dicts (one check-task message).
        budget: most routes claimed in this pass (catch-up after downtime never bursts past it).
        max_inflight: cap on outstanding leases, enforced atomically inside ``pop.lua``.
    Returns the number of routes claimed. If ``dispatch`` raises, the claimed leases simply expire and
    the routes come back (Redis, not the broker, is the source of truth).
    """
    claimed = 0
    while claimed < budget:
        leases = queue.pop(min(pop_batch, budget - claimed), max_inflight=max_inflight)
        if not leases:
            break
        claimed += len(leases)
        for i in range(0, len(leases), routes_per_task):
            dispatch([le.to_dict() for le in leases[i: i + routes_per_task]])
    return claimed


@dataclass
class BatchReport:
    """Outcome counts of one check batch."""

    completed: int = 0
    lease_lost: int = 0
    aborted: int = 0
    malformed: int = 0
    retried: int = 0
    stale_completions: int = 0
    published: int = 0


def run_check_batch(queue: RouteQueue, checker, leases: Sequence[Lease], *,
                    publish: Callable[[list[dict[str, str]]], object], renew_below_ms: float,
                    backoff: Backoff | None = None, max_threads: int = 16) -> BatchReport:
    """Check each leased route (in parallel threads), complete the held leases, publish their results.

    A route whose lease is lost (renewal refused, or completion rejected as stale) is dropped: its
    result is not published and its schedule is left to the current holder. A failed check while the
    judge itself is unreachable directly is not the route's fault: the route is retried on the
    ``backoff`` curve (attempt = its retry count + 1) and no result is published. A payload that does
    not decode is left leased and logged; its lease expires and the stall path takes over.
    Returns a :class:`BatchReport`.
    """
    backoff = backoff or Backoff("exponential", 5_000, 300_000, 2.0, "full")
    report = BatchReport()  # the checker learns its own address lazily (checks claim no level before)

    def one(le: Lease):
        try:
            payload = Payload.decode(le.payload)
        except PayloadError as exc:
            log.error("route %s has a malformed payload: %s", le.member, exc)
            return le, None, None

        def before_attempt(_n: int) -> bool:
            if le.cancelled:
                return False
            if le.remaining_ms() < renew_below_ms:
                try:
                    queue.renew(le)
                except QueueError:
                    return False
            return True

        return le, payload, checker.check(payload.route, before_attempt=before_attempt)

    with ThreadPoolExecutor(max_workers=max(1, min(max_threads, len(leases)))) as pool:
        outcomes = list(pool.map(one, leases))

    judge_up: list[bool] = []

    def judge_reachable() -> bool:  # probed once per batch, only when something failed
        if not judge_up:
            judge_up.append(not hasattr(checker, "learn_own_address")
                            or checker.learn_own_address(refresh=True) is not None)
        return judge_up[0]

    held = []
    for le, payload, res in outcomes:
        if payload is None:
            report.malformed += 1
        elif res.error == "Aborted":
            report.aborted += 1
        elif not res.alive and not judge_reachable():
            try:
                queue.retry(le, backoff.delay(le.retry_attempts + 1))
                report.retried += 1
            except QueueError:
                report.lease_lost += 1
        else:
            held.append((le, payload, res))
    codes = queue.complete([le for le, _, _ in held])
    entries = []
    for (le, payload, res), code in zip(held, codes):
        if code == COMPLETED:
            report.completed += 1
            fields = res.to_fields()
            fields["route_id"] = str(payload.route_id)
            fields["route_hash"] = payload.route_hash
            entries.append(fields)
        else:
            report.lease_lost += 1
            report.stale_completions += 1
    if entries:
        publish(entries)
        report.published = len(entries)
    return report
