"""The suite's own fixtures: the database clean-up leaves what ``TRUNCATE ... RESTART IDENTITY`` of every
table would (empty tables, sequences from 1), truncating only the tables that hold rows."""

from __future__ import annotations

import sqlalchemy as sa
from conftest import empty_tables

from magpie.db.repo import ensure_workspace


def _workspace_id(engine, name: str) -> int:
    ensure_workspace(engine, name)
    with engine.connect() as c:
        return c.execute(sa.text("SELECT id FROM workspaces WHERE name = :n"), {"n": name}).scalar_one()


def test_clean_up_empties_written_tables_and_restarts_every_sequence(db):
    assert _workspace_id(db, "a") == 1 and _workspace_id(db, "b") == 2
    assert "workspaces" in empty_tables(db)
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM workspaces")).scalar_one() == 0
    assert _workspace_id(db, "c") == 1  # RESTART IDENTITY
    with db.begin() as c:
        c.execute(sa.text("DELETE FROM workspaces"))  # empty again, but its sequence moved on
    assert empty_tables(db) == []  # nothing to truncate ...
    assert _workspace_id(db, "d") == 1  # ... and the sequence starts again all the same
