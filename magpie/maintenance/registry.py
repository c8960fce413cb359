"""The registered maintenance jobs, in the order ``magpie maintenance run all`` runs them."""

from __future__ import annotations

from magpie.maintenance import bodies, history, ledger, orphans, outbox, partitions, rebuild, rollup, tokens
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
        # jobs: judges
        # jobs: enrichment, blacklists
        # jobs: reputation, rollups, instances
        # jobs: rotators
    )
}
"""Job name -> :class:`Job`. Rollup runs before history retention so counters are taken first."""

__all__ = ["JOBS"]
