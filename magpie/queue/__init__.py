"""The route schedule in Redis: payloads apart from sharded sorted sets of due times, leased by Lua scripts."""

from magpie.queue.keys import QueueKeys, fnv1a_32
from magpie.queue.lease import Lease, is_lease_score
from magpie.queue.payload import Payload, PayloadError
from magpie.queue.refusals import (
    COMPLETED, GONE, LEASE_LOST, PAYLOAD_CHANGED, REMOVED, LeaseLost, QueueError, refusal,
)
from magpie.queue.routequeue import RouteQueue

__all__ = [
    "QueueKeys", "fnv1a_32", "Payload", "PayloadError", "Lease", "LeaseLost", "QueueError", "RouteQueue",
    "is_lease_score", "refusal", "COMPLETED", "REMOVED", "GONE", "LEASE_LOST", "PAYLOAD_CHANGED",
]
