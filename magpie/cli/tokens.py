"""``magpie tokens``: API tokens for programs calling ``/api`` (create, list, revoke).

A token is scoped to one workspace and a role (``read``: GET requests; ``operate``: also imports;
``admin``: everything, every workspace). Its secret is printed once, by ``create``; PostgreSQL keeps only
its SHA-256, so a lost secret is replaced, never recovered.
"""

from __future__ import annotations

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json, rows_table


@click.group()
def tokens() -> None:
    """API tokens for /api: create (the secret is shown once), list, revoke."""


@tokens.command("create")
@click.option("--workspace", "-w", default=None, help="Workspace the token is scoped to (optional for admin).")
@click.option("--role", required=True, type=click.Choice(["read", "operate", "admin"]),
              help="read: GET requests; operate: also imports; admin: everything, every workspace.")
@click.option("--name", default=None, help="A label shown by `magpie tokens list`.")
@click.option("--expires", default=None, help="Lifetime such as 30d, 12h, 90m or 2w (default: never).")
@json_option
@pass_state
def tokens_create(state: CliState, workspace: str | None, role: str, name: str | None, expires: str | None,
                  as_json: bool) -> None:
    """Create an API token and print its secret, once: store it now, it cannot be shown again.

    Example: magpie tokens create --workspace acme --role operate --name ci --expires 30d
    """
    from magpie.apitokens.store import create_token, parse_expiry

    got = create_token(state.engine, role=role, workspace=workspace, name=name, expires_at=parse_expiry(expires))
    if as_json:
        echo_json(got)
        return
    scope = f"workspace {workspace!r}" if workspace else "every workspace"
    until = got["expires_at"].strftime("%Y-%m-%d %H:%M:%S UTC") if got["expires_at"] else "never"
    click.echo(f"token {got['id']} ({role}, {scope}, expires {until}); its secret, shown only now:", err=True)
    click.echo(got["secret"])


@tokens.command("list")
@json_option
@pass_state
def tokens_list(state: CliState, as_json: bool) -> None:
    """Every API token, newest first: id, name, prefix, role, workspace, state, dates (never a secret).

    Example: magpie tokens list --json
    """
    from magpie.apitokens.store import list_tokens

    rows = list_tokens(state.engine)
    if as_json:
        echo_json(rows)
        return
    rows_table("API tokens", ["id", "name", "prefix", "role", "workspace", "state", "created", "expires",
                              "last used"],
               [[r["id"], r["name"], r["prefix"] + "...", r["role"], r["workspace"] or "(all)", r["state"],
                 r["created_at"], r["expires_at"], r["last_used_at"]] for r in rows])


@tokens.command("revoke")
@click.argument("token_id", type=click.IntRange(1))
@json_option
@pass_state
def tokens_revoke(state: CliState, token_id: int, as_json: bool) -> None:
    """Revoke API token TOKEN_ID at once (its next request gets 401).

    Example: magpie tokens revoke 3
    """
    from magpie.apitokens.store import revoke_token

    changed = revoke_token(state.engine, token_id)
    if as_json:
        echo_json({"id": token_id, "revoked": True, "changed": changed})
        return
    click.echo(f"token {token_id} revoked" if changed else f"token {token_id} was already revoked")


COMMANDS = [tokens]
