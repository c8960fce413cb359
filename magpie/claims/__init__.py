"""Claimable rows: PostgreSQL tables used as work queues with ``SKIP LOCKED`` claims and claim tokens.

A worker claims due rows with ``SELECT ... FOR UPDATE SKIP LOCKED``, writing a fresh claim token and a
claim expiry, and commits before it sends anything; it records the outcome only while its token is still
the row's current one; housekeeping returns expired claims. Failures are retried on one curve
(:func:`retry_curve`) until ``max_attempts``.

* :mod:`magpie.claims.rows` - the SQL primitives (:func:`~magpie.claims.rows.claim`,
  :func:`~magpie.claims.rows.record`, :func:`~magpie.claims.rows.release_expired`, ...);
* :mod:`magpie.claims.table` - :class:`ClaimTable`: one table's worker step, housekeeping loop and
  operator list / counts / retry, and the :class:`Outcome` of one attempt;
* :mod:`magpie.claims.workers` - :func:`run_workers`, threads repeating a worker step;
* :mod:`magpie.claims.models` - :class:`ClaimableRow`, the shared columns as a model mixin.

Used by the email outbox (``email_outbox``, :mod:`magpie.outbox`) and webhook deliveries
(``alert_deliveries``, :mod:`magpie.alerts.delivery`).
"""

from magpie.claims.models import STATUSES, ClaimableRow
from magpie.claims.rows import Claim
from magpie.claims.table import ClaimTable, Outcome, retry_curve
from magpie.claims.workers import run_workers

__all__ = ["STATUSES", "Claim", "ClaimTable", "ClaimableRow", "Outcome", "retry_curve", "run_workers"]
