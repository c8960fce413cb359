"""The registered maintenance jobs, in the order ``magpie maintenance run all`` runs them."""

from __future__ import annotations

from magpie.maintenance import bodies, history, orphans, outbox, partitions, rebuild, rollup, tokens
from magpie.stats import ledger
from magpie.maintenance.base import Job

JOBS: dict[str, Job] = {
    j.name: j
    for j in (
        partitions.JOB,
        rollup.JOB,
        history.JOB,
        bodies.JOB,
        ledger.JOB,
        orphans.JOB,
        tokens.JOB,
        outbox.JOB,
        rebuild.JOB,
        # jobs: operations (interval respread)
        __import__("magpie.maintenance.interval", fromlist=["JOB"]).JOB,
        # jobs: judges
        *__import__("magpie.judges.jobs", fromlist=["JOBS"]).JOBS,
        # jobs: enrichment, blacklists
        __import__("magpie.blacklists.job", fromlist=["JOB"]).JOB,
        __import__("magpie.enrich.job", fromlist=["JOB"]).JOB,
        # jobs: reputation, rollups, instances
        *__import__("magpie.derived.jobs", fromlist=["JOBS"]).JOBS,
        # jobs: rotators
        # jobs: dashboard history
        __import__("magpie.derived.dashboard", fromlist=["JOB"]).JOB,
    )
}
"""Job name -> :class:`Job`. Rollup runs before history retention so counters are taken first."""

__all__ = ["JOBS"]
