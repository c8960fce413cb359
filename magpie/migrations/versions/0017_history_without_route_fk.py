"""``check_history`` without its foreign key to ``routes``: the code deletes a route's history itself.

Every ingested result inserted a ``check_history`` row whose foreign key fired a referential-integrity
trigger (a ``SELECT ... FOR KEY SHARE`` on ``routes``) per row, although ingestion already locks and
checks the referenced routes once per batch (:mod:`magpie.stats.store`). Without it, deleting a route
removes its history in the same transaction (:func:`magpie.db.deletion.delete_routes`) instead of
``ON DELETE CASCADE``.

The constraint is dropped on the partitioned parent, which drops its copy on every attached partition.
The downgrade first deletes history rows whose route no longer exists (rows the cascade would have
removed, and which the constraint could not validate), then adds the constraint back on the parent and
so on every partition; that scans the whole history once.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FK = "fk_check_history_route_id_routes"


def upgrade() -> None:
    op.execute(f"ALTER TABLE check_history DROP CONSTRAINT {FK}")


def downgrade() -> None:
    op.execute("DELETE FROM check_history h "
               "WHERE NOT EXISTS (SELECT 1 FROM routes r WHERE r.id = h.route_id)")
    op.execute(f"ALTER TABLE check_history ADD CONSTRAINT {FK} FOREIGN KEY (route_id) "
               "REFERENCES routes (id) ON DELETE CASCADE")
