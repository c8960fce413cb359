"""``magpie stats status`` (results stream backlog, dead letters, ingestion backoff), ``magpie stats
redrive`` (move dead-lettered results back into the stream; applied at most once through the ledger) and
the rollups: ``stats timeline`` (10-minute snapshots), ``stats hourly``, ``stats sources``, ``stats usage``
(:mod:`magpie.derived.read`)."""

from __future__ import annotations

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json, rows_table


@click.group("stats")
def stats() -> None:
    """Statistics: ingestion (results stream, dead letters, redrive) and the rollups (timeline, hourly,
    sources, usage)."""


@stats.command("status")
@json_option
@pass_state
def stats_status(state: CliState, as_json: bool) -> None:
    """Results stream backlog, pending and dead letters, and whether the database refuses writes."""
    from magpie.queue.partitions import settings_stream_pairs
    from magpie.stats.status import pending_summary

    s = pending_summary(state.redis, state.settings.redis_prefix, settings_stream_pairs(state.settings))
    if as_json:
        echo_json(s)
        return
    lag = "?" if s["lag"] is None else s["lag"]
    click.echo(f"stream={s['length']} undelivered={lag} pending={s['pending']} consumers={s['consumers']} "
               f"dead_letters={s['dead']}")
    for one in s.get("streams", []):  # a partitioned schedule: each partition's stream
        one_lag = "?" if one["lag"] is None else one["lag"]
        click.echo(f"  {one['stream']}: stream={one['length']} undelivered={one_lag} "
                   f"pending={one['pending']} dead_letters={one['dead']}")
    inf = s["infra"]
    if inf is not None:
        click.echo(f"ingestion backing off: {inf['failures']} infrastructure failure(s) in a row, "
                   f"next attempt in {inf['retry_in_ms'] / 1000:.1f} s; last error: {inf['error']}")
    if s["dead"]:
        click.echo("dead letters present: inspect them, then `magpie stats redrive` moves them back")


@stats.command("redrive")
@click.option("--limit", type=click.IntRange(min=0), default=None,
              help="Most dead letters to move (default: all present when the command starts).")
@click.option("--discard-unrecoverable", is_flag=True,
              help="Delete dead letters that hold nothing to re-ingest (trimmed before ingestion).")
@json_option
@pass_state
def stats_redrive(state: CliState, limit: int | None, discard_unrecoverable: bool, as_json: bool) -> None:
    """Move dead-lettered results back into the results stream, oldest first.

    Idempotent: each one moves once, and the replay ledger applies a result that was applied before at
    most once. One that fails again is dead-lettered again with its new reason."""
    from magpie.stats.redrive import redrive

    from magpie.queue.partitions import settings_stream_pairs

    rep = redrive(state.redis, state.settings.redis_prefix, limit=limit,
                  discard_unrecoverable=discard_unrecoverable, pairs=settings_stream_pairs(state.settings))
    if as_json:
        echo_json(rep.as_json())
        return
    line = f"moved={rep.moved} unrecoverable={rep.unrecoverable} remaining={rep.remaining}"
    if discard_unrecoverable:
        line += f" discarded={rep.discarded}"
    click.echo(line)


_workspace = click.option("--workspace", "-w", default=None, help="Only this workspace.")
_hours = click.option("--hours", type=click.FloatRange(min=0.1, max=24 * 400), default=24.0,
                      show_default=True,
                      help="How far back, in hours.")


def _pct(part, whole) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


@stats.command("timeline")
@_workspace
@_hours
@json_option
@pass_state
def stats_timeline(state: CliState, workspace: str | None, hours: float, as_json: bool) -> None:
    """Alive and total routes per workspace and protocol, one row per 10-minute snapshot, newest first."""
    from magpie.derived.read import timeline

    rows = timeline(state.engine, workspace, hours)
    if as_json:
        echo_json(rows)
        return
    rows_table("workspace timeline (10-minute snapshots, UTC)", ["taken at", "workspace", "protocol", "alive",
                                                                 "total", "alive %"],
               [[r["taken_at"], r["workspace"], r["protocol"], r["alive"], r["total"],
                 _pct(r["alive"], r["total"])] for r in rows])


@stats.command("hourly")
@_workspace
@_hours
@json_option
@pass_state
def stats_hourly(state: CliState, workspace: str | None, hours: float, as_json: bool) -> None:
    """Checks, alive checks and distinct routes checked per workspace and UTC hour, newest first."""
    from magpie.derived.read import hourly

    rows = hourly(state.engine, workspace, hours)
    if as_json:
        echo_json(rows)
        return
    rows_table("hourly route counts (UTC)", ["hour", "workspace", "checks", "alive", "routes checked",
                                             "routes alive"],
               [[r["hour"], r["workspace"], r["checks"], r["alive"], r["routes_checked"], r["routes_alive"]]
                for r in rows])


@stats.command("sources")
@_workspace
@json_option
@pass_state
def stats_sources(state: CliState, workspace: str | None, as_json: bool) -> None:
    """Per import source (file or list name): routes, alive, checked, mean latency and reputation."""
    from magpie.derived.read import sources

    rows = sources(state.engine, workspace)
    if as_json:
        echo_json(rows)
        return
    rows_table("source statistics", ["workspace", "source", "routes", "alive", "checked", "latency ms",
                                     "score", "refreshed (UTC)"],
               [[r["workspace"], r["source"], r["routes"], r["alive"], r["checked"],
                 None if r["latency_avg_ms"] is None else f"{r['latency_avg_ms']:.0f}",
                 None if r["score_avg"] is None else f"{r['score_avg']:.1f}", r["refreshed_at"]]
                for r in rows])


@stats.command("usage")
@_workspace
@click.option("--days", type=click.IntRange(1, 3650), default=30, show_default=True,
              help="How far back, in days.")
@json_option
@pass_state
def stats_usage(state: CliState, workspace: str | None, days: int, as_json: bool) -> None:
    """Daily workspace usage: routes and sources owned, checks run, newest day first."""
    from magpie.derived.read import usage

    rows = usage(state.engine, workspace, days)
    if as_json:
        echo_json(rows)
        return
    rows_table("workspace usage (UTC days)",
               ["day", "workspace", "routes", "sources", "checks", "alive checks"],
               [[str(r["day"]), r["workspace"], r["routes"], r["sources"], r["checks"], r["alive_checks"]]
                for r in rows])


COMMANDS = [stats]


@stats.command("list-sources")
@_workspace
@json_option
@pass_state
def stats_list_sources(state: CliState, workspace: str | None, as_json: bool) -> None:
    """Per proxy-list source (`magpie sources`), live: routes it brought that are still in its workspace,
    how many are alive at their latest check, alive %.

    \b
    Example:
      magpie stats list-sources --workspace acme
    """
    from magpie.sources.store import source_stats

    rows = source_stats(state.engine, workspace)
    if as_json:
        echo_json(rows)
        return
    rows_table("proxy-list source statistics", ["id", "workspace", "url", "routes", "alive", "alive %",
                                                "last status"],
               [[r["id"], r["workspace"], r["url"], r["routes"], r["alive"], _pct(r["alive"], r["routes"]),
                 r["last_status"] + (" (dead-lettered)" if r["dead_lettered"] else "") if r["last_status"]
                 else None] for r in rows])
