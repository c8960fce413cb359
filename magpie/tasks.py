"""Thin Celery task wrappers; the work lives in :mod:`magpie.cycle` and :mod:`magpie.stats`."""

from __future__ import annotations

import os
import socket

from magpie import runtime
from magpie.celery_app import app


@app.task(name="magpie.promote", ignore_result=True)
def promote() -> int:
    """Beat-triggered: claim due routes (bounded by budget and MAGPIE_MAX_INFLIGHT), dispatch check tasks."""
    from magpie.cycle import promote as run_promote

    s = runtime.settings()

    def dispatch(leases: list[dict]) -> None:
        check_routes.apply_async(args=[leases], queue="checks")

    return run_promote(runtime.route_queue(), dispatch, budget=s.promote_budget, max_inflight=s.max_inflight,
                       pop_batch=s.pop_batch, routes_per_task=s.routes_per_task)


@app.task(name="magpie.check_routes", ignore_result=True)
def check_routes(leases: list[dict]) -> dict:
    """Check the leased routes of one message; returns the batch report as a dict."""
    from dataclasses import asdict

    from magpie.backoff import Backoff
    from magpie.cycle import run_check_batch
    from magpie.queue import Lease
    from magpie.stats import stream

    s = runtime.settings()
    r = runtime.redis_client()
    report = run_check_batch(
        runtime.route_queue(), runtime.checker(), [Lease.from_dict(d) for d in leases],
        publish=lambda entries: stream.publish(r, s.redis_prefix, entries, s.stats_stream_maxlen),
        renew_below_ms=s.renew_below_seconds * 1000,
        backoff=Backoff("exponential", int(s.retry_base * 1000), int(s.retry_cap * 1000), 2.0, "full"),
    )
    return asdict(report)


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
        rep = stream.ingest(r, runtime.engine(), s.redis_prefix, consumer, batch=s.stats_batch)
        total += rep.committed
        if rep.read == 0:
            break
    return total


# -- maintenance, statistics upkeep and metrics (issue 4) ----------------------------------------------


# -- alerts, webhook delivery and the email outbox (issue 5) ---------------------------------------------
