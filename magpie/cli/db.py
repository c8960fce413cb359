"""``magpie db ...``: the PostgreSQL schema (Alembic): upgrade, downgrade, current, history, check.

``upgrade`` creates the database if missing. ``check`` exits 1 when the database is not at the newest
revision or differs from the models (what ``alembic check`` reports); connection and migration failures
are one line, exit status 2.
"""

from __future__ import annotations

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json
from magpie.errors import MagpieError


def _failed(what: str, url: str, exc: BaseException) -> MagpieError:
    """One line naming the step, the database (password hidden) and the first line of the cause."""
    from sqlalchemy.engine import make_url

    safe = make_url(url).render_as_string(hide_password=True)
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return MagpieError(f"database {what} failed ({safe}): {detail[0] if detail else type(exc).__name__}")


def _describe(diff) -> str:
    """One Alembic diff entry as short text, e.g. ``remove_index ix_name`` or ``modify_nullable t.c``."""
    if isinstance(diff, list):  # column modifications come grouped
        return "; ".join(_describe(d) for d in diff)
    op, *args = diff
    if op in ("modify_nullable", "modify_type", "modify_default", "modify_comment"):
        return f"{op} {args[1]}.{args[2]}"
    obj = args[-1] if op.endswith("_column") else args[0]
    table = getattr(obj, "table", None)
    name = getattr(obj, "name", None) or str(obj)
    return f"{op} {name}" + (f" on {table.name}" if table is not None and hasattr(table, "name") else "")


@click.group()
def db() -> None:
    """PostgreSQL schema (Alembic)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@pass_state
def db_upgrade(state: CliState, revision: str) -> None:
    """Create the database if missing and migrate it to --revision (default: head)."""
    from magpie.db.migrate import current_revision, ensure_database, upgrade

    url = state.settings.database_url
    try:
        ensure_database(url)
        upgrade(url, revision, encryption_key=state.settings.encryption_key)  # records the key fingerprint
    except MagpieError:
        raise  # a key mismatch: already one line naming PROXY_ENCRYPTION_KEY
    except Exception as exc:  # noqa: BLE001 - any connection or migration failure, reported plainly
        raise _failed("upgrade", url, exc) from None
    click.echo(f"database at revision {current_revision(url)}")


@db.command("downgrade", context_settings={"ignore_unknown_options": True})  # REVISION may be "-1"
@click.argument("revision")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_state
def db_downgrade(state: CliState, revision: str, yes: bool) -> None:
    """Migrate down to REVISION (e.g. 0005, -1, or base: drops every table and its data)."""
    from magpie.db.migrate import current_revision, downgrade

    url = state.settings.database_url
    if not yes:
        click.confirm(f"downgrade the database to {revision}? Tables of later revisions and their data are "
                      "dropped", abort=True)
    try:
        downgrade(url, revision)
        now = current_revision(url)
    except Exception as exc:  # noqa: BLE001
        raise _failed("downgrade", url, exc) from None
    click.echo(f"database at revision {now or 'base'}")


@db.command("current")
@json_option
@pass_state
def db_current(state: CliState, as_json: bool) -> None:
    """The database's revision and the newest one this code ships."""
    from magpie.db.migrate import current_revision, head_revision

    url = state.settings.database_url
    try:
        current = current_revision(url)
    except Exception as exc:  # noqa: BLE001
        raise _failed("read", url, exc) from None
    head = head_revision()
    if as_json:
        echo_json({"current": current, "head": head, "at_head": current == head})
    else:
        state_text = "at head" if current == head else f"head is {head}: run magpie db upgrade"
        click.echo(f"{current or 'base (never migrated)'} ({state_text})")


@db.command("history")
@json_option
def db_history(as_json: bool) -> None:
    """The shipped revisions, newest first (no database needed)."""
    from magpie.db.migrate import history

    revs = history()
    if as_json:
        echo_json(revs)
        return
    for rev in revs:
        first = rev["doc"].splitlines()[0] if rev["doc"] else ""
        click.echo(f"{rev['down_revision'] or 'base'} -> {rev['revision']}{' (head)' if rev['head'] else ''}: "
                   f"{first}")


@db.command("check")
@json_option
@pass_state
def db_check(state: CliState, as_json: bool) -> None:
    """Exit 1 unless the database is at head and matches the models (autogenerate finds nothing)."""
    from magpie.db.migrate import current_revision, head_revision, schema_diff

    url = state.settings.database_url
    try:
        current = current_revision(url)
        diffs = [_describe(d) for d in schema_diff(url)] if current is not None else []
    except Exception as exc:  # noqa: BLE001
        raise _failed("check", url, exc) from None
    head = head_revision()
    ok = current == head and not diffs
    if as_json:
        echo_json({"ok": ok, "current": current, "head": head, "differences": diffs})
    elif ok:
        click.echo(f"at {head}; the schema matches the models")
    else:
        if current != head:
            click.echo(f"database at {current or 'base'}, code at {head}: run magpie db upgrade")
        for d in diffs:
            click.echo(f"differs: {d}")
    if not ok:
        raise click.exceptions.Exit(1)


COMMANDS = [db]
