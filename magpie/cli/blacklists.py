"""``magpie blacklists add|list|remove|refresh|policy``: operator-managed blacklist sources and policies.

A source is a file of addresses and CIDR ranges or an ``http(s)`` URL (fetched through the egress guard,
``MAGPIE_ENRICH_ALLOW_PRIVATE``). ``refresh`` runs one pass of the ``blacklist_refresh`` maintenance job
under its leader lock (exit 1 when the pass failed, e.g. a source could not be read).
"""

from __future__ import annotations

import sys

import click

from magpie.cli.context import CliState, json_option, pass_state, user_errors
from magpie.cli.output import echo_json, rows_table


@click.group()
def blacklists() -> None:
    """Blacklist sources (addresses and CIDR ranges) and what listed routes become per workspace."""


@blacklists.command("add")
@click.argument("name")
@click.argument("location")
@json_option
@pass_state
def add(state: CliState, name: str, location: str, as_json: bool) -> None:
    """Add source NAME reading LOCATION (a file path or an http(s) URL); the next refresh reads it."""
    from magpie.blacklists.sources import add_source

    with user_errors(ValueError):
        src = add_source(state.engine, name, location, settings=state.settings)
    if as_json:
        echo_json({"ok": True, "source": src})
    else:
        click.echo(f"source '{src['name']}' -> {src['location']} (read at the next `magpie blacklists refresh`)")


@blacklists.command("list")
@json_option
@pass_state
def list_cmd(state: CliState, as_json: bool) -> None:
    """Sources with their entries, flagged routes, last refresh and last error; workspace policies."""
    from magpie.blacklists.sources import list_sources, policies

    sources = list_sources(state.engine)
    pols = policies(state.engine, state.settings.blacklist_policy)
    if as_json:
        echo_json({"sources": sources, "policies": pols})
        return
    rows_table("blacklist sources", ["name", "location", "enabled", "entries", "flagged routes", "refreshed",
                                     "last error"],
               [[s["name"], s["location"], "yes" if s["enabled"] else "no", s["entries"], s["flagged"],
                 s["refreshed_at"], s["last_error"]] for s in sources])
    rows_table("blacklist policy per workspace", ["workspace", "policy"],
               [[p["workspace"], p["policy"] + (" (default)" if p["default"] else "")] for p in pols])


@blacklists.command("remove")
@click.argument("name")
@json_option
@pass_state
def remove(state: CliState, name: str, as_json: bool) -> None:
    """Delete source NAME with its entries; its flags go, unscheduled routes return at the next refresh."""
    from magpie.blacklists.sources import remove_source
    from magpie.errors import MagpieError

    if not remove_source(state.engine, name):
        raise MagpieError(f"no blacklist source {name!r}")
    if as_json:
        echo_json({"ok": True, "removed": name})
    else:
        click.echo(f"removed source '{name}'")


@blacklists.command("policy")
@click.argument("workspace")
@click.argument("policy", type=click.Choice(["flag", "skip", "remove"]))
@json_option
@pass_state
def policy_cmd(state: CliState, workspace: str, policy: str, as_json: bool) -> None:
    """Set what listed routes become in WORKSPACE: flag (still checked), skip (not checked) or remove."""
    from magpie.blacklists.sources import set_policy

    with user_errors(ValueError):
        set_policy(state.engine, workspace, policy)
    if as_json:
        echo_json({"ok": True, "workspace": workspace, "policy": policy})
    else:
        click.echo(f"workspace '{workspace}': listed routes {policy} (applied at the next refresh)")


@blacklists.command("refresh")
@json_option
@pass_state
def refresh(state: CliState, as_json: bool) -> None:
    """Run one pass of the blacklist_refresh job now, under its leader lock. Exits 1 if it failed."""
    from magpie.blacklists.job import JOB
    from magpie.maintenance.runner import run_job

    out = run_job(JOB, state.settings, engine=state.engine, redis=state.redis)
    if as_json:
        echo_json(out)
    elif out["status"] == "ok":
        r = out["result"]
        click.echo(f"refreshed {r['sources']} sources ({r['sources_changed']} changed, {r['entries']} entries); "
                   f"routes scanned={r['scanned']} listed={r['listed']} unflagged={r['unflagged']} "
                   f"memberships removed={r['memberships_removed']} routes removed={r['routes_removed']} "
                   f"unscheduled={r['unscheduled']} rescheduled={r['rescheduled']}"
                   + ("" if r.get("complete", True) else " (more next pass)"))
    elif out["status"] == "error":
        click.echo(f"refresh failed: {out['error']}", err=True)
    else:
        click.echo(f"skipped: {out.get('reason')}")
    if out["status"] == "error":
        sys.exit(1)


COMMANDS = [blacklists]
