"""``magpie import``, ``status`` and ``routes``: load routes, read the schedule and route health."""

from __future__ import annotations

import sys
from datetime import datetime, timezone

import click

from magpie.cli.context import CliState, json_option, pass_state, user_errors
from magpie.cli.output import echo_json, print_table

PROTOCOL_CHOICE = click.Choice(["http", "https", "socks4", "socks5"])


@click.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--workspace", "-w", required=True, help="Workspace that will own the routes.")
@click.option("--protocol", default="http", show_default=True, type=PROTOCOL_CHOICE,
              help="For lines with no scheme.")
@click.option("--dry-run", is_flag=True, help="Parse and report without storing anything.")
@json_option
@pass_state
def import_cmd(state: CliState, file: str, workspace: str, protocol: str, dry_run: bool,
               as_json: bool) -> None:
    """Import the proxy list FILE into a workspace and schedule its routes.

    Malformed lines and routes the egress guard refuses (private, loopback... addresses: see
    MAGPIE_CHECK_ALLOW_PRIVATE) are reported with their line numbers and not stored.
    """
    from magpie.importer.service import import_file

    progress_cb = None
    prog = None
    if not as_json and sys.stdout.isatty():
        from rich.console import Console
        from rich.progress import Progress

        prog = Progress(console=Console(), transient=True)
        task = prog.add_task("importing", total=None)
        prog.start()

        def progress_cb(done, total):
            prog.update(task, completed=done, total=total)

    try:
        with user_errors(ValueError, OSError):  # an empty workspace name, an unreadable file
            report = import_file(file, workspace, state.settings, protocol=protocol, dry_run=dry_run,
                                 progress=progress_cb, queue=None if dry_run else state.queue,
                                 engine=state.engine)
    finally:
        if prog:
            prog.stop()
    if as_json:
        echo_json(report.as_json())
        return
    verb = "would import" if dry_run else "imported"
    click.echo(f"{verb} {report.imported if not dry_run else report.valid} routes into '{workspace}': "
               f"valid={report.valid} duplicates={report.duplicates} skipped={report.skipped} "
               f"invalid={len(report.invalid)}"
               + (f" (refused by the egress guard: {report.refused})" if report.refused else ""))
    for bad in report.invalid[:50]:
        click.echo(f"  line {bad['line']}: {bad['reason']}", err=True)
    if len(report.invalid) > 50:
        click.echo(f"  ... and {len(report.invalid) - 50} more (use --json for all)", err=True)


def _counts(s: dict) -> list[str]:
    """The table cells of one shard (or the totals) of :meth:`RouteQueue.status`."""
    return [str(s["scheduled"]), str(s["leased"]), str(s["expired_leases"]), str(s["due_now"]),
            _fmt_ms(s["next_due_ms"]), f"{s['oldest_lateness_s']:.1f}"]


def _fmt_ms(ms) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%H:%M:%S")


@click.command()
@json_option
@pass_state
def status(state: CliState, as_json: bool) -> None:
    """Per-shard schedule state: scheduled, leased, due now, next due, oldest lateness (s)."""
    from rich.table import Table

    st = state.queue.status()
    if as_json:
        echo_json(st)
        return
    t = Table(title="route schedule")
    for col in ("shard", "scheduled", "leased", "expired leases", "due now", "next due (UTC)", "lateness s"):
        t.add_column(col, justify="right" if col != "shard" else "left")
    for s in st["shards"]:
        t.add_row(s["shard"].rsplit(":", 1)[-1], *_counts(s))
    t.add_row("all", *_counts(st["totals"]), style="bold")
    print_table(t)


def health_table(rows: list[dict], title: str = "route health"):
    """A :class:`rich.table.Table` of :func:`magpie.db.repo.latest_health` rows (user text kept literal)."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title)
    for col in ("route", "protocol", "alive", "latency ms", "anonymity", "status", "checks", "last checked"):
        t.add_column(col)
    for r in rows:
        alive = {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[r["alive"]]
        user = f"{r['username']}@" if r.get("username") else ""
        host = f"[{r['host']}]" if ":" in r["host"] else r["host"]
        t.add_row(Text(f"{user}{host}:{r['port']}"), r["protocol"], alive,
                  f"{r['latency_ms']:.0f}" if r["latency_ms"] is not None else "-",
                  Text(r["anonymity"] or "-"), Text(str(r["status"] or r.get("error") or "-")),
                  str(r["checks_total"] or 0),
                  r["last_checked_at"].strftime("%H:%M:%S") if r["last_checked_at"] else "-")
    return t


@click.command()
@click.option("--workspace", "-w", default=None, help="Only this workspace's routes.")
@json_option
@pass_state
def routes(state: CliState, workspace: str | None, as_json: bool) -> None:
    """Latest health of each route (from PostgreSQL)."""
    from magpie.db.repo import latest_health

    rows = latest_health(state.engine, workspace, keyring=state.keyring)
    if as_json:
        echo_json(rows)
        return
    print_table(health_table(rows))


COMMANDS = [import_cmd, status, routes]
