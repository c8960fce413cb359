"""Fixtures of the fault suite: one private PostgreSQL server per session (``initdb`` on a free port;
every scenario creates and drops its own database on it, and the PostgreSQL scenario stops and restarts
it). Each scenario starts its own private Redis servers. Nothing here touches the shared services."""

from __future__ import annotations

import pytest

from magpie.lab.chaos.servers import PrivatePostgres, ServerError


@pytest.fixture(scope="session")
def private_pg():
    """A started :class:`PrivatePostgres`, destroyed (stopped by PID, directory removed) after the session."""
    try:
        pg = PrivatePostgres()
        pg.start()
    except ServerError as exc:
        pytest.skip(str(exc))
    yield pg
    pg.destroy()
