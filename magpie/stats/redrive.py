"""Redrive: move dead-lettered results back into the results stream (``magpie stats redrive``).

Dead letters present when the call starts are looked at, oldest first (one written while it runs waits
for the next call). Each dead letter that still holds its original fields is appended to the results
stream with
``origin_id`` (the id it was first published under) and deleted from the dead-letter stream in the same
script step (``lua/stats_redrive.lua``), so a repeated or concurrent redrive never appends it twice. The
consumer records ``origin_id`` in the replay ledger (:attr:`magpie.stats.entry.StreamEntry.ledger_id`):
an entry that had been applied before it was dead-lettered (its acknowledgement lost) is a replay, never
applied twice, as long as its ledger row is kept (``MAGPIE_STATS_LEDGER_MIN_AGE`` at least). An entry
that fails again is dead-lettered again, with its new reason.

A dead letter with nothing to re-ingest (the entry was trimmed from the stream before ingestion, or its
``entry`` field is not a JSON object of strings) is *unrecoverable*: kept, or deleted with
``discard_unrecoverable``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import redis as redis_lib

from magpie.stats import scripts
from magpie.queue.streams import dead_key, stream_key, tagged_for, text

CHUNK = 500
"""Dead letters looked at per script call (each call is atomic and short)."""


@dataclass(slots=True)
class RedriveReport:
    """What one :func:`redrive` call did.

    Attributes:
        moved: dead letters appended to the results stream (and deleted from the dead-letter stream).
        unrecoverable: dead letters with nothing to re-ingest (kept, unless discarded).
        discarded: of ``unrecoverable``, those deleted.
        remaining: entries left in the dead-letter stream afterwards.
    """

    moved: int = 0
    unrecoverable: int = 0
    discarded: int = 0
    remaining: int = 0

    def as_json(self) -> dict:
        """The report as a JSON-ready dict."""
        return asdict(self)


def redrive(
    redis: redis_lib.Redis,
    prefix: str,
    *,
    limit: int | None = None,
    discard_unrecoverable: bool = False,
    chunk: int = CHUNK,
    pairs: list[tuple[str, str]] | None = None,
) -> RedriveReport:
    """Move dead-lettered entries, oldest first, back into the results stream.

    Args:
        redis: client on the schedule's Redis.
        prefix: key prefix.
        limit: most dead letters to move (None: all); unrecoverable ones do not count.
        discard_unrecoverable: delete dead letters that hold nothing to re-ingest.
        chunk: dead letters looked at per script call.
        pairs: ``[(results stream, dead-letter stream)]`` (one per partition,
            :func:`magpie.queue.partitions.stream_pairs`): each dead-letter stream goes back into its own
            results stream (one slot per script call); the reports are summed, ``limit`` over all.
    Returns:
        :class:`RedriveReport`.
    Raises:
        ValueError: ``limit`` below 0 or ``chunk`` below 1.
        redis.RedisError: Redis unavailable (what was moved before stays moved, exactly once).
    """
    if limit is not None and limit < 0:
        raise ValueError("limit must be 0 or more")
    if chunk < 1:
        raise ValueError("chunk must be at least 1")
    if pairs is not None:
        total = RedriveReport()
        for results, dead in pairs:
            left = None if limit is None else limit - total.moved
            if left is not None and left <= 0:
                total.remaining += int(redis.xlen(dead))
                continue
            one = _redrive(redis, [dead, results], left, discard_unrecoverable, chunk)
            for k in ("moved", "unrecoverable", "discarded", "remaining"):
                setattr(total, k, getattr(total, k) + getattr(one, k))
        return total
    tagged = tagged_for(redis)
    return _redrive(redis, [dead_key(prefix, tagged), stream_key(prefix, tagged)], limit, discard_unrecoverable,
                    chunk)


def _redrive(redis, keys: list[str], limit: int | None, discard_unrecoverable: bool, chunk: int) -> RedriveReport:
    rep = RedriveReport()
    cursor = "-"
    newest = redis.xrevrange(keys[0], count=1)  # what is dead-lettered again meanwhile waits for next time
    end = text(newest[0][0]) if newest else None
    while end is not None and (limit is None or rep.moved < limit):
        want = chunk if limit is None else min(chunk, limit - rep.moved)
        moved, bad, last = scripts.REDRIVE(
            redis, keys, [cursor, want, "1" if discard_unrecoverable else "0", end]
        )
        rep.moved += int(moved)
        rep.unrecoverable += int(bad)
        if discard_unrecoverable:
            rep.discarded += int(bad)
        last = text(last)
        if not last or last == end or int(moved) + int(bad) < want:
            break
        cursor = last
    rep.remaining = int(redis.xlen(keys[0]))
    return rep


__all__ = ["CHUNK", "RedriveReport", "redrive"]
