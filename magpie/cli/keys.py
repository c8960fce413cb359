"""``magpie keys status`` (does PROXY_ENCRYPTION_KEY match the database?) and ``magpie keys export``.

The key is never printed: ``status`` shows fingerprints (HMACs of a constant, cut to 12 hex characters).
Changing the key in place is not supported (see "The encryption key" in docs/operations.md): ``export``
writes every workspace's routes with their credentials to files that a new deployment under a new key
imports again.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import quote

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json
from magpie.errors import MagpieError


@click.group()
def keys() -> None:
    """PROXY_ENCRYPTION_KEY: check it against the database, export routes to move to a new key."""


@keys.command("status")
@json_option
@pass_state
def keys_status(state: CliState, as_json: bool) -> None:
    """Whether PROXY_ENCRYPTION_KEY matches the fingerprint recorded in PostgreSQL; exits 1 when not.

    Records nothing (a database without a fingerprint shows "unrecorded")."""
    from magpie.db.keycheck import read_status, short
    from magpie.db.session import get_engine

    st = read_status(get_engine(state.settings.database_url), state.settings.encryption_key)
    if as_json:
        echo_json(st.as_json())
    elif st.state == "match":
        click.echo("PROXY_ENCRYPTION_KEY matches the fingerprint recorded in PostgreSQL "
                   f"({short(st.recorded)})")
    elif st.state == "unrecorded":
        click.echo(f"no fingerprint recorded yet; PROXY_ENCRYPTION_KEY ({short(st.current)}) is recorded by "
                   "the first process that uses the database (or `magpie db upgrade`)")
    else:
        click.echo(f"PROXY_ENCRYPTION_KEY does NOT match: its fingerprint is {short(st.current)}, the "
                   f"database's is {short(st.recorded)}")
    sys.exit(1 if st.state == "mismatch" else 0)


def export_file_name(workspace: str) -> str:
    """File name of a workspace's export: its name percent-encoded (``/`` too, a leading ``.`` as
    ``%2E``), then ``.txt``."""
    name = quote(workspace, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    return name + ".txt"


@keys.command("export")
@click.argument("directory", type=click.Path(file_okay=False))
@pass_state
def keys_export(state: CliState, directory: str) -> None:
    """Write each workspace's routes, credentials included, to DIRECTORY/<workspace>.txt.

    One ``scheme://user:pass@host:port`` a line (percent-encoded), readable by ``magpie import``. The
    directory is created with mode 0700 and every file with 0600; an existing file is never overwritten.
    The files hold plaintext credentials: delete them once imported. Prints counts only."""
    import sqlalchemy as sa

    from magpie.base.routes import Route

    engine, keyring = state.engine, state.keyring  # the engine checks the key against the database
    out = Path(directory)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    with engine.connect() as conn:
        workspaces = conn.execute(sa.text("SELECT id, name FROM workspaces ORDER BY name")).all()
    for _, name in workspaces:
        if (out / export_file_name(name)).exists():
            raise MagpieError(f"refusing to overwrite {out / export_file_name(name)}: export into an empty "
                              "directory")
    sql = sa.text("SELECT r.protocol, r.host, r.port, r.username_enc, r.password_enc FROM routes r "
                  "JOIN route_workspaces rw ON rw.route_id = r.id WHERE rw.workspace_id = :w ORDER BY r.id")
    total = 0
    for ws_id, name in workspaces:
        path = out / export_file_name(name)
        n = 0
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w",
                       encoding="utf-8") as f, engine.connect() as conn:
            f.write(f"# magpie keys export: workspace {name!r}\n")
            rows = conn.execution_options(stream_results=True, yield_per=5000).execute(sql, {"w": ws_id})
            for proto, host, port, uenc, penc in rows:
                user = keyring.decrypt(uenc) if uenc is not None else None
                password = keyring.decrypt(penc) if penc is not None else None
                f.write(Route(proto, host, port, user, password).url() + "\n")
                n += 1
        total += n
        click.echo(f"{n} routes of workspace {name!r} -> {path}")
    click.echo(f"exported {total} routes of {len(workspaces)} workspaces; the files hold credentials in "
               "clear: delete them once imported")


COMMANDS = [keys]
