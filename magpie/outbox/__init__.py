"""The email outbox (docs/design.md, "Layout"): durable emails in PostgreSQL, sent by per-instance workers.

Public API: :func:`enqueue` / :func:`enqueue_email`, :func:`send_one`, :func:`run_outbox_workers`,
:func:`housekeeping` / :func:`run_housekeeping`, :func:`list_outbox`, :func:`outbox_counts`,
:func:`retry_email`, and invitations (:func:`create_invitation`, :func:`find_valid_invitation`).
Claims, retries and listing use the shared :mod:`magpie.claims`; old sent and failed rows are deleted by
the ``outbox_cleanup`` maintenance job.
"""

from magpie.outbox.invitations import Invitation, create_invitation, find_valid_invitation
from magpie.outbox.service import (
    HousekeepingReport,
    enqueue,
    enqueue_email,
    housekeeping,
    list_outbox,
    outbox_counts,
    retry_email,
    run_housekeeping,
    run_outbox_workers,
    send_one,
)

__all__ = [
    "HousekeepingReport",
    "Invitation",
    "create_invitation",
    "enqueue",
    "enqueue_email",
    "find_valid_invitation",
    "housekeeping",
    "list_outbox",
    "outbox_counts",
    "retry_email",
    "run_housekeeping",
    "run_outbox_workers",
    "send_one",
]
