"""``magpie workspaces list|create|delete`` and ``magpie bulk remove-routes|reprocess-dead|retry-deliveries``:
the operator's bulk verbs (:mod:`magpie.admin.operations`). Each takes ``--dry-run`` (count, change nothing) and
``--json``; destructive ones ask on a terminal and need ``--yes`` elsewhere.
"""

from __future__ import annotations

import click

from magpie.cli.routes import PROTOCOL_CHOICE
from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json, rows_table

_DRY_RUN = click.option("--dry-run", is_flag=True, help="Count what would change; change nothing.")
_YES = click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed when stdin is not a terminal).")


def _emit(as_json: bool, result: dict, text: str) -> None:
    if as_json:
        echo_json({"ok": True, "result": result})
    else:
        click.echo(text)


def _counts(result: dict, keys: tuple[str, ...]) -> str:
    return " ".join(f"{k}={result[k]}" for k in keys)


@click.group()
def workspaces() -> None:
    """Workspaces: named sets of routes (imports add to them; deleting one removes its routes, fenced)."""


@workspaces.command("list")
@json_option
@pass_state
def workspaces_list(state: CliState, as_json: bool) -> None:
    """List workspaces with their route counts.

    \b
    Example:
      magpie workspaces list --json
    """
    from magpie.admin.operations import list_workspaces

    rows = list_workspaces(state.engine)
    if as_json:
        echo_json({"ok": True, "result": rows})
        return
    rows_table("workspaces", ["id", "name", "routes", "created"],
               [[r["id"], r["name"], r["routes"], r["created_at"]] for r in rows])


@workspaces.command("create")
@click.argument("name")
@_DRY_RUN
@json_option
@pass_state
def workspaces_create(state: CliState, name: str, dry_run: bool, as_json: bool) -> None:
    """Create workspace NAME (1-64 letters, digits, '_', '.', '-').

    \b
    Example:
      magpie workspaces create acme
    """
    from magpie.admin.operations import create_workspace

    out = create_workspace(state.engine, name, dry_run=dry_run)
    _emit(as_json, out, f"{'would create' if dry_run else 'created'} workspace {name!r}")


@workspaces.command("delete")
@click.argument("name")
@_DRY_RUN
@_YES
@json_option
@pass_state
def workspaces_delete(state: CliState, name: str, dry_run: bool, yes: bool, as_json: bool) -> None:
    """Delete workspace NAME: its routes leave it through the schedule's fenced calls; routes no other
    workspace owns are removed. A route under a live lease is left for the next run (exit 1).

    \b
    Example:
      magpie workspaces delete acme --dry-run
      magpie workspaces delete acme --yes --json
    """
    from magpie.cli.progress import confirm_destructive
    from magpie.admin.operations import delete_workspace, remove_routes

    if not dry_run:
        n = remove_routes(state.engine, state.queue, workspace=name, dry_run=True)["matched"]
        confirm_destructive(f"delete workspace {name!r} and take its {n} routes out of it", yes)
    out = delete_workspace(state.engine, state.queue, name, dry_run=dry_run)
    _emit(as_json, out, ("would take " if dry_run else "") + _counts(
        out, ("matched", "removed", "updated", "skipped_leased")) + ("" if dry_run else f" deleted={out['deleted']}"))
    if not dry_run and not out["deleted"]:
        raise SystemExit(1)


@workspaces.command("set-interval")
@click.argument("name")
@click.argument("interval", required=False)
@click.option("--dead-after", type=click.IntRange(1, 1_000_000),
              help="Dead-route policy: after this many dead checks in a row ...")
@click.option("--dead-factor", type=click.IntRange(2, 1000), default=4, show_default=True,
              help="... check every FACTOR x the interval until alive again.")
@click.option("--clear", is_flag=True, help="Drop the workspace's interval and dead-route policy.")
@json_option
@pass_state
def workspaces_set_interval(state: CliState, name: str, interval: str | None, dead_after: int | None,
                            dead_factor: int, clear: bool, as_json: bool) -> None:
    """Set workspace NAME's check interval (and optionally its dead-route policy), then move its routes
    into it (resumable: run it again after an interruption). A route in several workspaces takes the
    shortest interval; a route's own interval (`magpie queue set-interval`) wins, and so does a field the
    workspace's check profile sets (`magpie profiles set --interval/--dead-after`). Redis schedule only.

    \b
    Example:
      magpie workspaces set-interval acme 60s
      magpie workspaces set-interval acme 5m --dead-after 3 --dead-factor 4
      magpie workspaces set-interval acme --clear --json
    """
    from magpie.cli.progress import progress
    from magpie.cli.queue import Duration
    from magpie.judges.store import workspace_id

    if clear and (interval or dead_after):
        raise click.UsageError("--clear takes no INTERVAL or --dead-after")
    if not clear and not (interval or dead_after):
        raise click.UsageError("give INTERVAL (e.g. 60s), --dead-after N, or --clear")
    ms = Duration().convert(interval, None, None) if interval else 0
    with state.engine.connect() as conn:
        wid = workspace_id(conn, name)
    with progress("walking routes") as update:
        out = state.queue.set_workspace_cadence(
            wid, interval_ms=ms, dead_after=0 if clear else (dead_after or 0),
            dead_factor=dead_factor if dead_after and not clear else 0,
            progress=lambda c: update(c["shard"], state.queue.shards))
    out = {"workspace": name, "interval_ms": ms or None, "dead_after": dead_after if not clear else None, **out}
    _emit(as_json, out, f"workspace {name!r}: {out['routes']} routes, {out['moved']} moved into the new interval")


@click.group()
def bulk() -> None:
    """Bulk operator verbs: remove routes by filter, reprocess dead letters, retry failed deliveries."""


@bulk.command("remove-routes")
@click.option("--workspace", "-w", default=None, help="Only routes of this workspace (they leave it only).")
@click.option("--protocol", type=PROTOCOL_CHOICE, default=None)
@click.option("--dead-days", type=click.FloatRange(0, 36500), default=None,
              help="Only routes failing now and not alive for more than this many days.")
@_DRY_RUN
@_YES
@json_option
@pass_state
def bulk_remove_routes(state: CliState, workspace, protocol, dead_days, dry_run, yes, as_json) -> None:
    """Remove the routes matching every filter given (at least one), through the schedule's fenced calls.
    Routes under a live lease are left for the next run (exit 1).

    \b
    Example:
      magpie bulk remove-routes --protocol socks4 --dead-days 7 --dry-run
      magpie bulk remove-routes -w acme --dead-days 30 --yes --json
    """
    from magpie.cli.progress import confirm_destructive
    from magpie.admin.operations import remove_routes

    kw = dict(workspace=workspace, protocol=protocol, dead_days=dead_days)
    if not dry_run:
        n = remove_routes(state.engine, state.queue, dry_run=True, **kw)["matched"]
        confirm_destructive(f"remove {n} routes", yes)
    out = remove_routes(state.engine, state.queue, dry_run=dry_run, **kw)
    _emit(as_json, out, ("would remove: " if dry_run else "") + _counts(
        out, ("matched", "removed", "updated", "skipped_leased")))
    if out["skipped_leased"]:
        raise SystemExit(1)


@bulk.command("reprocess-dead")
@click.option("--reason", default=None, help="Only dead letters with this reason (e.g. stalled).")
@click.option("--older-than", type=click.FloatRange(0), default=None, metavar="SECONDS",
              help="Only those dead-lettered more than SECONDS ago.")
@_DRY_RUN
@json_option
@pass_state
def bulk_reprocess_dead(state: CliState, reason, older_than, dry_run, as_json) -> None:
    """Put every dead-lettered route (or those matching the filters) back, due now.

    \b
    Example:
      magpie bulk reprocess-dead --reason stalled --dry-run
      magpie bulk reprocess-dead --json
    """
    from magpie.admin.operations import reprocess_dead

    out = reprocess_dead(state.queue, reason=reason, older_than_s=older_than, dry_run=dry_run)
    _emit(as_json, out, ("would reprocess: " if dry_run else "") + _counts(out, ("matched", "reprocessed", "raced")))


@bulk.command("retry-deliveries")
@click.option("--kind", type=click.Choice(["webhook", "email"]), default="webhook", show_default=True)
@click.option("--channel", "channel_id", type=int, default=None, help="Webhook deliveries of this channel id only.")
@_DRY_RUN
@json_option
@pass_state
def bulk_retry_deliveries(state: CliState, kind, channel_id, dry_run, as_json) -> None:
    """Give every failed webhook delivery (or email) one more attempt, due now.

    \b
    Example:
      magpie bulk retry-deliveries --dry-run
      magpie bulk retry-deliveries --kind email --json
    """
    from magpie.admin.operations import retry_failed

    out = retry_failed(state.engine, kind=kind, channel_id=channel_id, dry_run=dry_run)
    _emit(as_json, out, ("would retry: " if dry_run else "") + _counts(out, ("matched", "retried", "raced")))


COMMANDS = [workspaces, bulk]
