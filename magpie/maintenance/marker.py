"""The schedule's rebuild marker: set when the Redis schedule holds what PostgreSQL owns.

Redis losing its data loses the marker too, which is how the ``rebuild`` job
(:mod:`magpie.maintenance.rebuild`) knows to restore the schedule; the first import of a new deployment
sets it (:mod:`magpie.importer.service`).
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

_OWNED = (
    "SELECT count(*) FROM routes r WHERE EXISTS (SELECT 1 FROM route_workspaces rw WHERE rw.route_id = r.id)"
)


def marker_key(queue) -> str:
    """Key of the rebuild marker of ``queue``'s schedule (inside its hash tag)."""
    return queue.side_key("maintenance_marker")


def owned_routes(engine: Engine) -> int:
    """Routes that at least one workspace owns (what the schedule should hold)."""
    with engine.connect() as conn:
        return int(conn.execute(sa.text(_OWNED)).scalar_one())


def mark_bootstrapped(queue) -> None:
    """Set the schedule's rebuild marker (now, Unix ms): the schedule holds what PostgreSQL owns."""
    queue.redis.set(marker_key(queue), str(int(time.time() * 1000)))


def needs_rebuild(engine: Engine, queue) -> bool:
    """True when the schedule's marker is missing and PostgreSQL has owned routes."""
    if queue.redis.exists(marker_key(queue)):
        return False
    return owned_routes(engine) > 0
