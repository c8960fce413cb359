"""The results-stream producer: append result entries under a bound, with an overflow policy.

Entries of :mod:`magpie.stats.entry` go to ``<prefix>stats:results`` in one script call per batch
(``lua/stats_publish.lua``). Check workers do not use this path: their completions append results in the
completion script itself (``lua/complete.lua``, the same bound and policies); this producer serves tools,
tests and any writer that has no lease to complete. The bound counts *unconsumed* entries: entries the consumer
group already acknowledged are trimmed first to make room, and only then does the policy decide what a
full stream loses. Losses are counted in :mod:`magpie.counters` (``stats_dropped:<policy>``), which the
metrics exporter reads; this module imports nothing above it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis as redis_lib

from magpie.counters import count_stats_drops
from magpie.stats import scripts
from magpie.stats.keys import GROUP, stream_key, text

OVERFLOW_POLICIES = ("block", "drop_new", "evict_oldest")
"""Producer policies when the stream holds ``maxlen`` unconsumed entries (``MAGPIE_STATS_OVERFLOW``)."""


@dataclass(slots=True)
class PublishReport:
    """What one :func:`publish_entries` call did.

    Attributes:
        ids: per input entry, its new stream id, or ``None`` when the entry was dropped.
        dropped: results lost to the bound: new entries refused (``drop_new``/``block``) plus unconsumed
            old entries evicted (``evict_oldest``). Counted in ``magpie_statistics_dropped_total``.
        trimmed: already consumed (acknowledged) entries removed to make room; not a loss.
        waited_s: seconds spent waiting for room (``block`` only).
    """

    ids: list[str | None]
    dropped: int = 0
    trimmed: int = 0
    waited_s: float = 0.0


def _publish_once(redis, key: str, entries: Sequence[Mapping[str, str]], maxlen: int, policy: str):
    args: list = [int(maxlen), policy, GROUP, len(entries)]
    for entry in entries:
        args.append(len(entry))
        for k, v in entry.items():
            args += [k, v]
    res = scripts.PUBLISH(redis, [key], args)
    ids = [text(i) or None for i in res[2:]]
    return ids, int(res[0]), int(res[1])


def publish_entries(
    redis: redis_lib.Redis,
    prefix: str,
    entries: list[dict[str, str]],
    maxlen: int,
    *,
    overflow: str = "evict_oldest",
    block_timeout: float = 2.0,
    poll_interval: float = 0.05,
) -> PublishReport:
    """Append result entries to the stream under a bound on its unconsumed entries.

    One script call (one round trip) per attempt. The bound counts unconsumed entries: when a batch does
    not fit, entries the consumer group already acknowledged are trimmed first (``XTRIM MINID`` at the
    replay floor, see :func:`magpie.stats.upkeep.replay_floor`); only then does ``overflow`` decide:

    * ``evict_oldest``: trim the oldest unconsumed entries (exact ``MAXLEN``); a pending one among them
      is dead-lettered by :func:`magpie.stats.consumer.ingest` as "trimmed".
    * ``drop_new``: store what fits, drop the rest of the batch.
    * ``block``: store what fits, retry the rest every ``poll_interval`` seconds for up to
      ``block_timeout`` seconds (ingestion makes room), then drop what still does not fit.

    Drops are added to the Redis counter read by the metrics exporter
    (``magpie_statistics_dropped_total{policy}``) in a second round trip, only when something was dropped.

    Args:
        redis: client (``decode_responses`` either way).
        prefix: key prefix (``MAGPIE_REDIS_PREFIX``).
        entries: flat ``str -> str`` dicts (see :mod:`magpie.stats.entry`).
        maxlen: most unconsumed entries the stream holds (``MAGPIE_STATS_STREAM_MAXLEN``).
        overflow: ``evict_oldest``, ``drop_new`` or ``block`` (``MAGPIE_STATS_OVERFLOW``).
        block_timeout: seconds (``MAGPIE_STATS_BLOCK_TIMEOUT``); ``block`` only.
        poll_interval: seconds between retries (``block`` only).
    Returns:
        :class:`PublishReport`.
    Raises:
        ValueError: unknown ``overflow`` or ``maxlen < 1``.
        redis.RedisError: Redis unreachable or rejecting the command.
    """
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if maxlen < 1:
        raise ValueError("maxlen must be at least 1")
    report = PublishReport(ids=[])
    if not entries:
        return report
    key = stream_key(prefix)
    policy = "evict_oldest" if overflow == "evict_oldest" else "drop_new"
    ids, dropped, trimmed = _publish_once(redis, key, entries, maxlen, policy)
    report.trimmed += trimmed
    if overflow == "block" and dropped:
        start = time.monotonic()
        deadline = start + block_timeout
        while dropped and time.monotonic() < deadline:
            time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))
            todo = [i for i, sid in enumerate(ids) if sid is None]
            more, dropped, trimmed = _publish_once(redis, key, [entries[i] for i in todo], maxlen, policy)
            report.trimmed += trimmed
            for i, sid in zip(todo, more):
                ids[i] = sid
        report.waited_s = time.monotonic() - start
    report.ids = ids
    report.dropped = dropped
    if dropped:
        count_stats_drops(redis, prefix, overflow, dropped)
    return report


def publish(
    redis: redis_lib.Redis,
    prefix: str,
    entries: list[dict[str, str]],
    maxlen: int,
    *,
    overflow: str = "evict_oldest",
    block_timeout: float = 2.0,
) -> list[str]:
    """Append result entries to the stream (see :func:`publish_entries` for the bound and policies).

    Args:
        redis: client (``decode_responses`` either way).
        prefix: key prefix (``MAGPIE_REDIS_PREFIX``).
        entries: flat ``str -> str`` dicts (see :mod:`magpie.stats.entry`).
        maxlen: most unconsumed entries kept (``MAGPIE_STATS_STREAM_MAXLEN``); consumed entries are
            trimmed to make room first.
        overflow: ``evict_oldest`` (default), ``drop_new`` or ``block`` (``MAGPIE_STATS_OVERFLOW``).
        block_timeout: seconds a ``block`` producer waits for room.
    Returns:
        The stream ids of the entries stored, in input order (dropped entries are left out).
    Raises:
        redis.RedisError: Redis unreachable or rejecting the command.
    """
    rep = publish_entries(redis, prefix, entries, maxlen, overflow=overflow, block_timeout=block_timeout)
    return [i for i in rep.ids if i is not None]


def publish_with_settings(redis: redis_lib.Redis, settings, entries: list[dict[str, str]]) -> PublishReport:
    """:func:`publish_entries` with the bound and policy of a :class:`magpie.config.StreamSettings`
    (``MAGPIE_STATS_STREAM_MAXLEN``, ``MAGPIE_STATS_OVERFLOW``, ``MAGPIE_STATS_BLOCK_TIMEOUT``), or of a whole
    :class:`magpie.config.Settings` whose ``stream`` slice is used."""
    st = getattr(settings, "stream", settings)
    return publish_entries(redis, st.prefix, entries, st.maxlen, overflow=st.overflow,
                           block_timeout=st.block_timeout)


__all__ = ["OVERFLOW_POLICIES", "PublishReport", "publish", "publish_entries", "publish_with_settings"]
