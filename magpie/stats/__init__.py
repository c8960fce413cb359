"""Statistics ingestion: check results travel through a Redis Stream into PostgreSQL.

Results enter the stream only through the schedule's completion (``complete_with_results``: one fenced
call completes the leases and appends their results under the stream's bound and overflow policy).

One module per concern:

* :mod:`magpie.stats.entry`: the entry format, one codec from a check result to stream fields and back;
* :mod:`magpie.stats.consumer`: read through the consumer group, recover pending entries, dead-letter,
  acknowledge after commit;
* :mod:`magpie.stats.store`: the PostgreSQL transaction (history, current health, replay ledger);
* :mod:`magpie.stats.status`: backlog figures for status output and metrics;
* :mod:`magpie.stats.upkeep`: replay floor, ledger retirement, trimming, idle consumers;
* :mod:`magpie.stats.drain`: one ingestion run, consumer batches until the backlog is read;
* :mod:`magpie.stats.infra`: the shared backoff while the database refuses writes;
* :mod:`magpie.stats.redrive`: dead letters back into the stream (``magpie stats redrive``);
* :mod:`magpie.queue.streams` and :mod:`magpie.stats.scripts`: the names and the Lua scripts they share.
"""

from magpie.stats.consumer import IngestReport, ensure_group, ingest
from magpie.stats.entry import (
    DeadLetter,
    MalformedEntry,
    StreamEntry,
    decode_result,
    encode_result,
    entry_fields,
    parse_entry,
)
from magpie.queue.streams import GROUP, dead_key, stream_key
from magpie.stats.redrive import RedriveReport, redrive
from magpie.stats.status import pending_summary

__all__ = [
    "GROUP",
    "DeadLetter",
    "IngestReport",
    "MalformedEntry",
    "RedriveReport",
    "StreamEntry",
    "dead_key",
    "decode_result",
    "encode_result",
    "ensure_group",
    "entry_fields",
    "ingest",
    "parse_entry",
    "pending_summary",
    "redrive",
    "stream_key",
]
