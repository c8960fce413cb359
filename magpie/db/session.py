"""Engines and sessions: one pooled :class:`~sqlalchemy.engine.Engine` per database URL per process.

After ``fork()`` (Celery prefork workers) the child drops the parent's pooled connections without closing
them (``Engine.dispose(close=False)``), so parent and child never share a PostgreSQL socket.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

_lock = threading.Lock()
_engines: dict[str, Engine] = {}
_sessionmakers: dict[str, sessionmaker[Session]] = {}


def get_engine(url: str) -> Engine:
    """Return the process-wide engine for ``url`` (created on first use, ``pool_pre_ping=True``).

    Args:
        url: SQLAlchemy URL, e.g. ``postgresql+psycopg2://postgres@127.0.0.1:5432/magpie``.
    Returns:
        The same :class:`Engine` for every call with an equal ``url`` in this process.
    Raises:
        sqlalchemy.exc.ArgumentError: the URL cannot be parsed. Connecting is lazy: no error for an
        unreachable server until the engine is used.
    """
    engine = _engines.get(url)
    if engine is not None:
        return engine
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = sa.create_engine(url, pool_pre_ping=True, future=True)
            _engines[url] = engine
        return engine


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A :class:`Session` on :func:`get_engine` ``(url)``: committed on success, rolled back on error.

    Usage::

        with session_scope(settings.database_url) as s:
            s.add(Workspace(name="default"))

    Raises whatever the body or the commit raises (after rolling back); the session is always closed.
    """
    maker = _sessionmakers.get(url)
    if maker is None:
        maker = sessionmaker(bind=get_engine(url), expire_on_commit=False)
        _sessionmakers[url] = maker
    session = maker()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def dispose_engines() -> None:
    """Close every cached engine's pooled connections and forget the engines (tests, shutdown)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
        _sessionmakers.clear()


def _after_fork_in_child() -> None:
    for engine in list(_engines.values()):
        engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
