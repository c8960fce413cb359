"""Schema management: create the database if missing and run the Alembic migrations.

Alembic is configured in code (no ini file needed): ``script_location`` is the package's ``migrations``
directory (``magpie/migrations``, which imports every package's models), so it works from a checkout and
from an installed package alike. These functions
back ``magpie db upgrade|downgrade|current|history|check`` and the test fixtures. The ``alembic.ini`` at
the repository root serves the plain ``alembic`` tool; both run the same ``env.py``.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import make_url

MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"


def alembic_config(url: str | None = None) -> Config:
    """A programmatic Alembic :class:`Config` for magpie's migrations.

    Args:
        url: database URL handed to ``env.py`` through ``config.attributes["url"]`` (kept out of the
            ini-style options so a ``%`` in a password needs no escaping). ``None`` for offline use
            such as :func:`head_revision`.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        cfg.attributes["url"] = url
    return cfg


def ensure_database(url: str) -> bool:
    """Create the database named in ``url`` if it does not exist.

    Connects to the ``postgres`` maintenance database on the same server with the same credentials.

    Args:
        url: SQLAlchemy PostgreSQL URL of the target database.
    Returns:
        ``True`` if the database was created, ``False`` if it already existed.
    Raises:
        sqlalchemy.exc.OperationalError: the server is unreachable or refuses the login.
        sqlalchemy.exc.ProgrammingError: the role may not create databases.
        ValueError: ``url`` names no database.
    """
    target = make_url(url)
    name = target.database
    if not name:
        raise ValueError(f"database URL names no database: {target.render_as_string(hide_password=True)}")
    admin = sa.create_engine(
        target.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )
    try:
        with admin.connect() as conn:
            exists = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            ).first()
            if exists:
                return False
            quoted = conn.dialect.identifier_preparer.quote_identifier(name)
            try:
                conn.execute(sa.text(f"CREATE DATABASE {quoted}"))
            except sa.exc.ProgrammingError as exc:  # created concurrently by another process
                if "already exists" in str(exc.orig):
                    return False
                raise
            return True
    finally:
        admin.dispose()


def upgrade(url: str, revision: str = "head", *, encryption_key: str | None = None) -> None:
    """Migrate the database at ``url`` up to ``revision`` (default: the newest).

    Safe to run from several processes at once: ``env.py`` serialises runs with an advisory lock, and
    a revision already applied is skipped. The database must exist (see :func:`ensure_database`).

    Args:
        url: SQLAlchemy PostgreSQL URL.
        revision: target revision.
        encryption_key: the ``PROXY_ENCRYPTION_KEY``; when given, its fingerprint is recorded if none is
            yet and compared otherwise (:func:`magpie.db.keycheck.verify_key`; skipped when the target
            revision predates ``deployment_keys``). ``None`` (fixtures, tools) records nothing.
    Raises:
        sqlalchemy.exc.OperationalError: the database is unreachable.
        alembic.util.exc.CommandError: ``revision`` is unknown.
        magpie.base.crypto.KeyMismatchError: ``encryption_key`` is not the database's key (the schema is
            migrated all the same: migrations do not depend on the key).
    """
    command.upgrade(alembic_config(url), revision)
    if encryption_key is not None:
        from magpie.db.keycheck import KeyTableMissing, verify_key

        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            verify_key(engine, encryption_key)
        except KeyTableMissing:
            pass  # migrated to a revision below the fingerprint table
        finally:
            engine.dispose()


def current_revision(url: str) -> str | None:
    """The revision the database at ``url`` is at, or ``None`` if it was never migrated.

    Raises ``sqlalchemy.exc.OperationalError`` if the database is unreachable.
    """
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    """The newest revision shipped with this code (e.g. ``"0001"``); no database access."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships revisions
        raise RuntimeError(f"no Alembic revisions found in {MIGRATIONS_DIR}")
    return head


def downgrade(url: str, revision: str) -> None:
    """Migrate the database at ``url`` down to ``revision`` (``"base"`` drops every table; ``"-1"`` one step).

    Raises:
        sqlalchemy.exc.OperationalError: the database is unreachable.
        alembic.util.exc.CommandError: ``revision`` is unknown or above the current one.
    """
    command.downgrade(alembic_config(url), revision)


def history() -> list[dict]:
    """The shipped revisions, newest first: ``[{"revision", "down_revision", "doc", "head"}]``; no database."""
    script = ScriptDirectory.from_config(alembic_config())
    heads = set(script.get_heads())
    return [
        {"revision": rev.revision, "down_revision": rev.down_revision, "doc": (rev.doc or "").strip(),
         "head": rev.revision in heads}
        for rev in script.walk_revisions()
    ]


def schema_diff(url: str) -> list:
    """What autogenerate would change to make the database at ``url`` match the models (empty: in step).

    Runs ``env.py`` (so every models module it imports, and its filter of ``check_history`` partitions,
    apply) and :func:`alembic.autogenerate.compare_metadata` on its migration context; changes nothing.

    Returns:
        Alembic diff tuples, e.g. ``[("remove_index", Index(...))]``; an empty list when in step.
    Raises:
        sqlalchemy.exc.OperationalError: the database is unreachable.
    """
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.environment import EnvironmentContext

    cfg = alembic_config(url)
    script = ScriptDirectory.from_config(cfg)
    found: list = []

    def _compare(_rev, context):
        found.extend(compare_metadata(context, context.opts["target_metadata"]))
        return []  # no migration steps: read only

    with EnvironmentContext(cfg, script, fn=_compare):
        script.run_env()
    return found
