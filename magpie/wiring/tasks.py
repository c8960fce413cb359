"""The Celery tasks: each body calls one function of the package that owns the work.

Importing this module registers the tasks on :data:`magpie.wiring.celery_app.app` and does nothing else (the
worker's hooks, check pool and metrics endpoint, are :mod:`magpie.wiring.worker`'s). Per-process resources
come from :mod:`magpie.wiring.runtime`; every import of work code is inside the task that needs it.
"""

from __future__ import annotations

from magpie.wiring import runtime
from magpie.wiring.celery_app import app


FORWARD_HOPS = 2
"""Times a check message's leases may be passed on by full processes before one waits for a slot."""


def _dispatch_checks(leases: list[dict], hops: int = 0) -> None:
    """Send one ``magpie.check_routes`` message with ``leases`` (:meth:`Lease.to_dict` dicts), sealed.

    The lease list (payloads carry credentials) is encrypted once per message (:mod:`magpie.queue.seal`);
    ``argsrepr``/``kwargsrepr`` keep task events and Flower down to a lease count. ``hops``: how many full
    processes already passed these leases on (0 from promote)."""
    from magpie.queue.seal import describe, get_seal

    sealed = get_seal(runtime.settings().encryption_key).seal(leases)
    args = [sealed] if not hops else [sealed, hops]
    check_routes.apply_async(args=args, queue="checks", argsrepr=describe(len(leases)), kwargsrepr="{}")


@app.task(name="magpie.promote", ignore_result=True)
def promote() -> int:
    """Beat-triggered: claim due routes (bounded by the check engines' free slots, the budget and
    MAGPIE_MAX_INFLIGHT) and dispatch check messages; returns the count claimed."""
    from magpie.pipeline.promote import promote_with_settings
    from magpie.coordination.ratelimit import WorkspaceBudget

    queue = runtime.route_queue()
    return promote_with_settings(queue, runtime.settings().schedule, _dispatch_checks,
                                 capacity=runtime.capacity_registry().total(),
                                 workspace_budget=WorkspaceBudget.from_settings(queue.redis, runtime.settings()))


@app.task(name="magpie.check_routes", ignore_result=True)
def check_routes(sealed: str, hops: int = 0) -> int:
    """Open one sealed check message (:func:`_dispatch_checks`) and admit its leases into this process's
    check pool; returns the count admitted here. A process without free slots for all of them passes the
    rest on in a new message at once (:meth:`CheckPool.offer`), so leases never wait behind one full
    process while another has slots; after :data:`FORWARD_HOPS` passes a process waits for slots
    (:meth:`CheckPool.submit`). Raises :class:`magpie.queue.seal.SealError` for a message not sealed under
    this worker's ``PROXY_ENCRYPTION_KEY`` (its leases expire and come back)."""
    from magpie.queue.seal import get_seal

    leases = get_seal(runtime.settings().encryption_key).unseal_leases(sealed)
    pool = runtime.check_pool()
    if hops >= FORWARD_HOPS:
        return pool.submit(leases)
    rest = pool.offer(leases)
    if rest:
        _dispatch_checks([le.to_dict() for le in rest], hops + 1)
    return len(leases) - len(rest)


@app.task(name="magpie.ingest_stats", ignore_result=True)
def ingest_stats() -> int:
    """Beat-triggered: move check results from the Redis Stream into PostgreSQL (acked after commit);
    returns the results committed."""
    from magpie.stats.drain import ingest_backlog

    return ingest_backlog(runtime.redis_client(), runtime.engine(), runtime.settings())


# -- maintenance -----------------------------------------------------------------------------------------

@app.task(name="magpie.maintenance.run", ignore_result=True)
def maintenance_run(job: str) -> dict:
    """Beat-triggered: one pass of maintenance job ``job`` under its leader lock, once per cadence slot
    however many beats trigger it (see magpie.maintenance.runner)."""
    from magpie.wiring.jobs import run_job

    return run_job(job, runtime.settings(), engine=runtime.engine(), redis=runtime.redis_client(),
                   once_per_slot=True)


@app.task(name="magpie.maintenance.rebuild_schedule", ignore_result=True)
def maintenance_rebuild_schedule() -> dict:
    """On demand: schedule every stored route again (keeps routes still present) under the rebuild lock."""
    from magpie.maintenance.rebuild import rebuild_schedule

    return rebuild_schedule(runtime.settings(), engine=runtime.engine(), queue=runtime.route_queue())


@app.task(name="magpie.maintenance.fetch_sources", ignore_result=True)
def maintenance_fetch_sources() -> dict:
    """Beat-triggered: claim due proxy-list sources, fetch and import them (magpie.sources.runner.run_due);
    returns the outcome counts."""
    from magpie.sources.runner import run_due

    out = run_due(runtime.settings(), runtime.engine(), runtime.redis_client(), runtime.route_queue())
    out.pop("results")
    return out


# -- alerts, webhook delivery and the email outbox ------------------------------------------------------

@app.task(name="magpie.alerts.evaluate", ignore_result=True)
def alerts_evaluate() -> dict | None:
    """Beat-triggered, once a minute: evaluate every enabled alert rule under the ``alerts`` leader lock,
    once per evaluation slot however many beats trigger it. Returns the report as a dict, or ``None``
    when another instance leads or the slot already ran."""
    from magpie.alerts.evaluate import run_evaluation

    rep = run_evaluation(runtime.redis_client(), runtime.engine(), runtime.settings(), once_per_slot=True)
    return None if rep is None else rep.as_json()


@app.task(name="magpie.delivery.drain", ignore_result=True)
def delivery_drain() -> dict:
    """Beat-triggered: send due webhook deliveries with MAGPIE_DELIVERY_WORKERS threads; outcome counts."""
    from magpie.alerts.delivery import run_delivery_workers

    return dict(run_delivery_workers(runtime.engine(), runtime.settings()))


@app.task(name="magpie.email.drain", ignore_result=True)
def email_drain() -> dict:
    """Beat-triggered: send due outbox emails with MAGPIE_EMAIL_WORKERS threads; outcome counts."""
    from magpie.outbox.service import run_outbox_workers

    return dict(run_outbox_workers(runtime.engine(), runtime.settings()))


@app.task(name="magpie.email.housekeeping", ignore_result=True)
def email_housekeeping() -> dict | None:
    """Beat-triggered: return expired outbox claims to pending (or failed) under the
    ``outbox-housekeeping`` leader lock. ``{"returned", "failed"}`` counts, ``None`` when another leads."""
    from magpie.outbox.service import run_housekeeping

    rep = run_housekeeping(runtime.redis_client(), runtime.engine(), runtime.settings(), once_per_slot=True)
    return None if rep is None else {"returned": rep.returned, "failed": rep.failed}
