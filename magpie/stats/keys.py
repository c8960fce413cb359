"""Names on the results stream: its key, the dead-letter stream's key, the consumer group, the
ingestion's shared "database refuses writes" state.

Every module of :mod:`magpie.stats` takes its names from here, so the producer, the consumer, the status
read and the upkeep job cannot disagree on them.
"""

from __future__ import annotations

GROUP = "magpie-stats"
"""Consumer group name on the results stream."""

DEAD_MAXLEN = 100_000
"""Approximate cap on the dead-letter stream's length."""


def stream_key(prefix: str) -> str:
    """Key of the results stream: ``f"{prefix}stats:results"``."""
    return f"{prefix}stats:results"


def dead_key(prefix: str) -> str:
    """Key of the dead-letter stream: ``f"{prefix}stats:dead"``."""
    return f"{prefix}stats:dead"


def infra_key(prefix: str) -> str:
    """Key of the ingestion's infrastructure-failure state (a hash, see :mod:`magpie.stats.infra`):
    ``f"{prefix}stats:infra"``."""
    return f"{prefix}stats:infra"


def text(v) -> str:
    """A Redis reply value as ``str`` (``bytes`` decoded as UTF-8, bad bytes replaced)."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def id_parts(stream_id: str) -> tuple[int, int]:
    """``"<ms>-<seq>"`` as ``(ms, seq)`` ints (a missing ``seq`` reads as 0).

    Raises ``ValueError`` when a part is not numeric."""
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)
