"""One ingestion run, as the ``stats``-queue task does it: consumer batches until the stream is drained.

:func:`ingest_backlog` names this process's consumer, makes sure the group exists and calls
:func:`magpie.stats.consumer.ingest` until a batch reads nothing or ``MAX_PASSES`` batches ran, so one
run stays bounded however long the backlog is (the next beat trigger goes on).
"""

from __future__ import annotations

import os
import socket

import redis as redis_lib
from sqlalchemy.engine import Engine

from magpie.stats.consumer import ensure_group, ingest

MAX_PASSES = 20
"""Most :func:`~magpie.stats.consumer.ingest` batches in one run."""


def consumer_name() -> str:
    """This process's consumer name in the group: ``<hostname>-<pid>`` (unique per process)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def ingest_backlog(redis: redis_lib.Redis, engine: Engine, settings, *, passes: int = MAX_PASSES) -> int:
    """Move check results from the stream into PostgreSQL, batch after batch, acknowledging after commit.

    Args:
        redis: client on the schedule's Redis.
        engine: engine on the magpie database.
        settings: :class:`magpie.config.Settings` (``redis_prefix``, ``stats_batch`` entries per batch,
            ``stats_max_deliveries``).
        passes: most batches in this run.
    Returns:
        Results committed in all batches.
    Raises:
        Whatever :func:`~magpie.stats.consumer.ingest` raises (entries of a failed batch stay pending).
    """
    ensure_group(redis, settings.redis_prefix)
    consumer = consumer_name()
    total = 0
    for _ in range(passes):
        rep = ingest(redis, engine, settings.redis_prefix, consumer, batch=settings.stats_batch,
                     max_deliveries=settings.stats_max_deliveries)
        total += rep.committed
        if rep.read == 0:
            break
    return total
