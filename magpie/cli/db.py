"""``magpie db upgrade``: create the PostgreSQL database if missing and migrate it (Alembic)."""

from __future__ import annotations

import click

from magpie.cli.context import CliState, pass_state
from magpie.errors import MagpieError


@click.group()
def db() -> None:
    """PostgreSQL schema (Alembic)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@pass_state
def db_upgrade(state: CliState, revision: str) -> None:
    """Create the database if missing and migrate it to --revision (default: head)."""
    from sqlalchemy.engine import make_url

    from magpie.db.migrate import current_revision, ensure_database, upgrade

    url = state.settings.database_url
    try:
        ensure_database(url)
        upgrade(url, revision, encryption_key=state.settings.encryption_key)  # records the key fingerprint
    except MagpieError:
        raise  # a key mismatch: already one line naming PROXY_ENCRYPTION_KEY
    except Exception as exc:  # noqa: BLE001 - any connection or migration failure, reported plainly
        safe = make_url(url).render_as_string(hide_password=True)
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        raise MagpieError(f"database upgrade failed ({safe}): {detail[0] if detail else type(exc).__name__}") \
            from None
    click.echo(f"database at revision {current_revision(url)}")


COMMANDS = [db]
