"""Job ``stats_ledger``: replay-ledger retirement and results-stream upkeep (see :mod:`magpie.stats.upkeep`).

Each pass: read the replay floor; delete ``stats_ledger`` rows below it (and older than
``MAGPIE_STATS_LEDGER_MIN_AGE``) in batches; trim acknowledged entries from the stream; delete consumers
idle for ``MAGPIE_STATS_CONSUMER_IDLE`` that hold no pending entry. With no consumer group yet (nothing
ever ingested), nothing is retired.
"""

from __future__ import annotations

from magpie.maintenance.base import Job, JobContext
from magpie.stats import upkeep


class StatsLedgerJob(Job):
    name = "stats_ledger"
    every = 60.0
    description = "retire ledger rows below the replay floor; trim consumed entries; drop idle consumers"

    def run(self, ctx: JobContext) -> dict:
        from magpie.queue.partitions import settings_stream_pairs

        s = ctx.settings
        pairs = settings_stream_pairs(s)  # every partition's results stream
        floor = upkeep.replay_floor(ctx.redis, s.redis_prefix, pairs)
        out: dict = {"floor": None, "retired": 0, "complete": True}
        if floor is not None:
            out["floor"] = floor.stream_id
            out["floor_source"] = floor.source
            r = upkeep.retire_ledger(
                ctx.engine,
                floor,
                batch=ctx.batch_size,
                max_batches=max(0, ctx.max_batches - ctx.batches),
                min_age_s=float(s.stats_ledger_min_age),
                deadline=ctx.deadline,
                cancel=ctx.cancel,
            )
            ctx.tick(r["batches"])
            out["retired"] = r["deleted"]
            out["complete"] = r["complete"]
        out["trimmed"] = upkeep.trim_consumed(ctx.redis, s.redis_prefix, pairs)
        out["consumers_removed"] = upkeep.cleanup_consumers(
            ctx.redis, s.redis_prefix, int(s.stats_consumer_idle * 1000), pairs
        )
        return out


JOB = StatsLedgerJob()
