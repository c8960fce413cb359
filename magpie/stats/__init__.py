"""Statistics ingestion: check results travel through a Redis Stream into PostgreSQL.

See :mod:`magpie.stats.stream` for the entry format, the consumer-group protocol and the guarantees
(ack after commit, replay ledger, pending recovery, dead letters, the producer's bound and overflow
policy) and :mod:`magpie.stats.upkeep` for the replay floor, ledger retirement and consumer cleanup.
"""

from magpie.stats.stream import (
    GROUP,
    OVERFLOW_POLICIES,
    CheckResult,
    IngestReport,
    MalformedEntry,
    PublishReport,
    dead_key,
    encode_result,
    ensure_group,
    ingest,
    parse_entry,
    pending_summary,
    publish,
    publish_entries,
    publish_with_settings,
    stream_key,
)

__all__ = [
    "GROUP",
    "CheckResult",
    "IngestReport",
    "MalformedEntry",
    "OVERFLOW_POLICIES",
    "PublishReport",
    "dead_key",
    "encode_result",
    "ensure_group",
    "ingest",
    "parse_entry",
    "pending_summary",
    "publish",
    "publish_entries",
    "publish_with_settings",
    "stream_key",
]
