"""The route schedule in Redis: payloads apart from sharded sorted sets of due times, leased by Lua scripts."""

from magpie.queue.keys import QueueKeys, fnv1a_32
from magpie.queue.payload import Payload, PayloadError
from magpie.queue.routequeue import (
    COMPLETED, GONE, LEASE_LOST, PAYLOAD_CHANGED, Lease, LeaseLost, QueueError, RouteQueue, is_lease_score,
)

__all__ = [
    "QueueKeys", "fnv1a_32", "Payload", "PayloadError", "Lease", "LeaseLost", "QueueError", "RouteQueue",
    "is_lease_score", "COMPLETED", "GONE", "LEASE_LOST", "PAYLOAD_CHANGED",
]
