"""One ingestion run, as the ``stats``-queue task does it: consumer batches until the stream is drained.

:func:`ingest_backlog` names this process's consumer, makes sure the group exists and calls
:func:`magpie.stats.consumer.ingest` until a batch reads nothing or ``MAX_PASSES`` batches ran, so one
run stays bounded however long the backlog is (the next beat trigger goes on). A run stops at the
first infrastructure failure of the database (the entries stay pending, their deliveries given back, see
:mod:`magpie.stats.infra`) and logs one warning when such a failure starts a backoff and one line when a
commit ends it.
"""

from __future__ import annotations

import logging
import os
import socket

import redis as redis_lib
from sqlalchemy.engine import Engine

from magpie.stats.consumer import ensure_group, ingest

log = logging.getLogger(__name__)

MAX_PASSES = 20
"""Most :func:`~magpie.stats.consumer.ingest` batches in one run."""


def consumer_name() -> str:
    """This process's consumer name in the group: ``<hostname>-<pid>`` (unique per process)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def ingest_backlog(redis: redis_lib.Redis, engine: Engine, settings, *, passes: int = MAX_PASSES) -> int:
    """Move check results from the stream into PostgreSQL, batch after batch, acknowledging after commit.

    Every partition's results stream is read (``MAGPIE_SCHEDULE_PARTITIONS``,
    :func:`magpie.queue.partitions.settings_stream_pairs`), a batch of each in turn, through the same group.

    Args:
        redis: client on the schedule's Redis.
        engine: engine on the magpie database.
        settings: :class:`magpie.config.Settings` (``redis_prefix``, ``stats_batch`` entries per batch,
            ``stats_max_deliveries``, ``stats_infra_backoff``, ``stats_infra_backoff_cap``; the GeoIP
            files, when set, enrich each exit address as it is written).
        passes: most batches in this run.
    Returns:
        Results committed in all batches.
    Raises:
        Whatever :func:`~magpie.stats.consumer.ingest` raises (entries of a failed batch stay pending);
        an infrastructure failure of the database is not raised: the run stops there.
    """
    from magpie.queue.partitions import settings_stream_pairs

    pairs = settings_stream_pairs(settings)  # one results stream per partition (one when unpartitioned)
    for stream, _ in pairs:
        ensure_group(redis, settings.redis_prefix, stream)
    consumer = consumer_name()
    geo = None
    if getattr(settings, "geoip_country_db", None) or getattr(settings, "geoip_asn_db", None):
        from magpie.enrich.geo import shared

        geo = shared(settings, redis)  # exit addresses are enriched as they are written
    total = 0
    live = list(pairs)
    answered = False  # the database committed a batch of this run: no SELECT 1 before the next one
    for _ in range(passes):
        drained = []
        for stream, dead in live:  # a batch of each stream in turn, same consumer group on every stream
            rep = ingest(redis, engine, settings.redis_prefix, consumer, batch=settings.stats_batch,
                         max_deliveries=settings.stats_max_deliveries, backoff_s=settings.stats_infra_backoff,
                         backoff_cap_s=settings.stats_infra_backoff_cap, geo=geo, stream=stream,
                         dead_stream=dead, probe=not answered)
            answered = answered or rep.committed > 0
            total += rep.committed
            if rep.infra_cleared:
                log.info("stats ingestion: the database accepts writes again after %d failed attempt(s)",
                         rep.infra_cleared)
            if rep.infra_error is not None:
                if not rep.skipped and rep.infra_failures == 1:
                    log.warning("stats ingestion: database failed a batch for infrastructure reasons (%s); "
                                "entries stay pending, next attempt in %.1f s", rep.infra_error, rep.backoff_s)
                return total
            if rep.read == 0:
                drained.append((stream, dead))
        live = [p for p in live if p not in drained]
        if not live:
            break
    return total
