"""``magpie stats status`` (results stream backlog, dead letters, ingestion backoff) and ``magpie stats
redrive`` (move dead-lettered results back into the stream; applied at most once through the ledger)."""

from __future__ import annotations

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json


@click.group("stats")
def stats() -> None:
    """Statistics ingestion: the results stream, its dead letters, redrive."""


@stats.command("status")
@json_option
@pass_state
def stats_status(state: CliState, as_json: bool) -> None:
    """Results stream backlog, pending and dead letters, and whether the database refuses writes."""
    from magpie.stats.status import pending_summary

    s = pending_summary(state.redis, state.settings.redis_prefix)
    if as_json:
        echo_json(s)
        return
    lag = "?" if s["lag"] is None else s["lag"]
    click.echo(f"stream={s['length']} undelivered={lag} pending={s['pending']} consumers={s['consumers']} "
               f"dead_letters={s['dead']}")
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

    rep = redrive(state.redis, state.settings.redis_prefix, limit=limit,
                  discard_unrecoverable=discard_unrecoverable)
    if as_json:
        echo_json(rep.as_json())
        return
    line = f"moved={rep.moved} unrecoverable={rep.unrecoverable} remaining={rep.remaining}"
    if discard_unrecoverable:
        line += f" discarded={rep.discarded}"
    click.echo(line)


COMMANDS = [stats]
