"""Thin Celery task wrappers; the work lives in :mod:`magpie.cycle` and :mod:`magpie.stats`."""

from __future__ import annotations

import os
import socket

from magpie import runtime
from magpie.celery_app import app


@app.task(name="magpie.promote", ignore_result=True)
def promote() -> int:
    """Beat-triggered: claim due routes (bounded by the check engines' free slots, the budget and
    MAGPIE_MAX_INFLIGHT) and dispatch check messages."""
    from magpie.cycle import promote as run_promote

    s = runtime.settings()

    def dispatch(leases: list[dict]) -> None:
        check_routes.apply_async(args=[leases], queue="checks")

    return run_promote(runtime.route_queue(), dispatch, budget=s.promote_budget, max_inflight=s.max_inflight,
                       pop_batch=s.pop_batch, routes_per_task=s.routes_per_task,
                       capacity=runtime.capacity_registry().total())


@app.task(name="magpie.check_routes", ignore_result=True)
def check_routes(leases: list[dict]) -> int:
    """Admit the leases of one message into this process's check pool; returns the count admitted."""
    from magpie.queue import Lease

    return runtime.check_pool().submit([Lease.from_dict(d) for d in leases])


@app.task(name="magpie.ingest_stats", ignore_result=True)
def ingest_stats() -> int:
    """Beat-triggered: move check results from the Redis Stream into PostgreSQL (acked after commit)."""
    from magpie.stats import stream

    s = runtime.settings()
    r = runtime.redis_client()
    stream.ensure_group(r, s.redis_prefix)
    consumer = f"{socket.gethostname()}-{os.getpid()}"
    total = 0
    for _ in range(20):
        rep = stream.ingest(r, runtime.engine(), s.redis_prefix, consumer, batch=s.stats_batch,
                            max_deliveries=s.stats_max_deliveries)
        total += rep.committed
        if rep.read == 0:
            break
    return total


# -- maintenance, statistics upkeep and metrics ----------------------------------------------------------

@app.task(name="magpie.maintenance.run", ignore_result=True)
def maintenance_run(job: str) -> dict:
    """Beat-triggered: one pass of maintenance job ``job`` under its leader lock (see magpie.maintenance)."""
    from magpie.maintenance.runner import run_job

    return run_job(job, runtime.settings(), engine=runtime.engine(), redis=runtime.redis_client())


@app.task(name="magpie.maintenance.rebuild_schedule", ignore_result=True)
def maintenance_rebuild_schedule() -> dict:
    """On demand: schedule every stored route again (keeps routes still present) under the rebuild lock."""
    from magpie.maintenance.rebuild import rebuild_schedule

    return rebuild_schedule(runtime.settings(), engine=runtime.engine(), queue=runtime.route_queue())


# -- alerts, webhook delivery and the email outbox ------------------------------------------------------


@app.task(name="magpie.alerts.evaluate", ignore_result=True)
def alerts_evaluate() -> dict | None:
    """Beat-triggered, once a minute: evaluate every enabled alert rule under the ``alerts`` leader lock.
    Returns the report as a dict, or ``None`` when another instance leads."""
    from magpie.alerts.evaluate import run_evaluation

    rep = run_evaluation(runtime.redis_client(), runtime.engine(), runtime.settings())
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
    """Beat-triggered: outbox housekeeping under the ``outbox-housekeeping`` leader lock (expired claims
    back to pending or failed, sent rows past retention deleted). ``None`` when another instance leads."""
    from dataclasses import asdict

    from magpie.outbox.service import run_housekeeping

    rep = run_housekeeping(runtime.redis_client(), runtime.engine(), runtime.settings())
    return None if rep is None else asdict(rep)
