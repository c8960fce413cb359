"""Statistics ingestion: check results travel through a Redis Stream into PostgreSQL.

See :mod:`magpie.stats.stream` for the entry format, the consumer-group protocol and the guarantees
(ack after commit, replay ledger, pending recovery, dead letters).
"""

from magpie.stats.stream import (
    GROUP,
    CheckResult,
    IngestReport,
    MalformedEntry,
    dead_key,
    encode_result,
    ensure_group,
    ingest,
    parse_entry,
    pending_summary,
    publish,
    stream_key,
)

__all__ = [
    "GROUP",
    "CheckResult",
    "IngestReport",
    "MalformedEntry",
    "dead_key",
    "encode_result",
    "ensure_group",
    "ingest",
    "parse_entry",
    "pending_summary",
    "publish",
    "stream_key",
]
