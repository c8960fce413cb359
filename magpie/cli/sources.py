"""``magpie sources add|list|remove|refresh``: proxy-list URLs fetched on a schedule into a workspace.

Each source is fetched every ``--every`` through the egress guard (``MAGPIE_SOURCE_ALLOW_PRIVATE``), obeying
robots.txt unless ``--ignore-robots``, and its body is imported like ``magpie import`` (``--format``). URLs
are printed redacted (user information and secret-looking query values masked). See docs/sources.md.
"""

from __future__ import annotations

import sys

import click

from magpie.cli.routes import PROTOCOL_CHOICE
from magpie.cli.context import CliState, json_option, pass_state, user_errors
from magpie.cli.output import echo_json, rows_table


@click.group()
def sources() -> None:
    """Proxy-list sources: URLs fetched on a schedule and imported into a workspace."""


@sources.command("add")
@click.argument("url")
@click.option("--workspace", "-w", required=True, help="Workspace the lists are imported into.")
@click.option("--every", "every", default="6h", show_default=True,
              help="How often to fetch: a number with s, m, h, d or w (1m .. 30d).")
@click.option("--format", "fmt", default="auto", show_default=True,
              type=click.Choice(["auto", "ip:port:user:pass", "ip:port:country:anonymity"]),
              help="What host:port:a:b lines mean (as `magpie import --format`).")
@click.option("--protocol", default="http", show_default=True,
              type=PROTOCOL_CHOICE, help="Scheme of lines without one.")
@click.option("--browser", is_flag=True, help="Render the page in headless Chromium (lists built by script).")
@click.option("--ignore-robots", is_flag=True, help="Fetch even where robots.txt disallows it.")
@json_option
@pass_state
def add(state: CliState, url: str, workspace: str, every: str, fmt: str, protocol: str, browser: bool,
        ignore_robots: bool, as_json: bool) -> None:
    """Add URL as a source of WORKSPACE; it is first fetched at the next pass (or `magpie sources refresh`).

    \b
    Example:
      magpie sources add https://lists.example/socks5.txt --workspace acme --every 6h --protocol socks5
    """
    from magpie.errors import MagpieError
    from magpie.sources.store import add_source, parse_every

    if browser:
        from magpie.sources.browser import unavailable

        why = unavailable(state.settings.source_chromium)
        if why:
            raise MagpieError(why)
    with user_errors(ValueError):
        src = add_source(state.engine, state.settings, url, workspace, parse_every(every), fmt=fmt,
                         protocol=protocol, browser=browser, ignore_robots=ignore_robots)
    if as_json:
        echo_json({"ok": True, "source": src})
    else:
        click.echo(f"source {src['id']}: {src['url']} -> workspace '{src['workspace']}' every {src['every']}"
                   + (" (browser)" if src["browser"] else ""))


@sources.command("list")
@click.option("--workspace", "-w", default=None, help="Only this workspace.")
@json_option
@pass_state
def list_cmd(state: CliState, workspace: str | None, as_json: bool) -> None:
    """Sources with their period, last fetch (status, counts, error), failures and dead-letter flag.

    \b
    Example:
      magpie sources list --json
    """
    from magpie.sources.store import list_sources

    rows = list_sources(state.engine, workspace)
    if as_json:
        echo_json({"sources": rows})
        return
    rows_table("proxy-list sources", ["id", "workspace", "url", "every", "last fetch", "status", "imported",
                                      "failures", "dead", "last error"],
               [[r["id"], r["workspace"], r["url"], r["every"] + (" browser" if r["browser"] else ""),
                 r["last_fetch_at"], r["last_status"], r["last_imported"], r["consecutive_failures"],
                 "yes" if r["dead_lettered"] else "", r["last_error"]] for r in rows])


@sources.command("remove")
@click.argument("source_id", type=int)
@json_option
@pass_state
def remove(state: CliState, source_id: int, as_json: bool) -> None:
    """Delete source SOURCE_ID (its routes stay in the workspace) and take it off the schedule.

    \b
    Example:
      magpie sources remove 3
    """
    from magpie.errors import MagpieError
    from magpie.sources.runner import source_schedule, sync_schedule
    from magpie.sources.store import remove_source

    if not remove_source(state.engine, source_id):
        raise MagpieError(f"no source {source_id}")
    sync_schedule(state.engine, source_schedule(state.settings, state.redis))
    if as_json:
        echo_json({"ok": True, "removed": source_id})
    else:
        click.echo(f"removed source {source_id}")


@sources.command("refresh")
@click.argument("source_id", type=int)
@json_option
@pass_state
def refresh(state: CliState, source_id: int, as_json: bool) -> None:
    """Fetch source SOURCE_ID now (a dead-lettered one goes back on the schedule). Exits 1 if it failed.

    \b
    Example:
      magpie sources refresh 3 --json
    """
    from magpie.sources.runner import refresh_now
    from magpie.sources.store import SourceError

    with user_errors(SourceError):
        res = refresh_now(state.settings, state.engine, state.redis, source_id, route_queue=state.queue)
    if as_json:
        echo_json(res)
    elif res["status"] in ("ok", "not_modified"):
        extra = f": {res.get('valid', 0)} routes, {res.get('imported', 0)} new" if res["status"] == "ok" else ""
        click.echo(f"source {source_id}: {res['status']}{extra}")
    elif res["status"] == "pending":
        click.echo(f"source {source_id}: another process is fetching it; see `magpie sources list`")
    else:
        click.echo(f"source {source_id}: {res['status']}: {res.get('error', '')}", err=True)
    if res["status"] in ("error", "dead_lettered", "gone"):
        sys.exit(1)


COMMANDS = [sources]
