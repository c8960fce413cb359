"""``magpie outbox ...``: the email outbox (status, listing, test emails, sending workers, housekeeping)."""

from __future__ import annotations

from functools import partial

import click

from magpie.cli.context import CliState, json_option, pass_state, run_workers, user_errors, worker_options
from magpie.cli.output import echo_json, rows_table
from magpie.errors import MagpieError


@click.group()
def outbox() -> None:
    """The email outbox: status, sending workers, housekeeping."""


@outbox.command("status")
@json_option
@pass_state
def outbox_status(state: CliState, as_json) -> None:
    """Rows per status."""
    from magpie.outbox.service import outbox_counts

    got = outbox_counts(state.engine)
    echo_json(got) if as_json else click.echo(" ".join(f"{k}={v}" for k, v in got.items()))


@outbox.command("list")
@click.option("--status", type=click.Choice(["pending", "processing", "sent", "failed"]), default=None)
@click.option("--kind", default=None)
@click.option("--limit", default=50, show_default=True)
@json_option
@pass_state
def outbox_list(state: CliState, status, kind, limit, as_json) -> None:
    """Outbox rows, newest first (bodies not shown)."""
    from magpie.outbox.service import list_outbox

    with user_errors(ValueError, LookupError):
        got = list_outbox(state.engine, status=status, kind=kind, limit=limit)
    if as_json:
        echo_json(got)
        return
    rows_table("email outbox",
               ["id", "kind", "recipient", "subject", "status", "attempts", "next attempt", "last error"],
               [[r["id"], r["kind"], r["recipient"], r["subject"], r["status"],
                 f"{r['attempts']}/{r['max_attempts']}", r["next_attempt_at"], r["last_error"]] for r in got])


@outbox.command("send")
@click.argument("recipient")
@click.argument("subject")
@click.argument("body")
@pass_state
def outbox_send(state: CliState, recipient, subject, body) -> None:
    """Queue a test email (kind ``test``)."""
    from magpie.outbox.service import enqueue_email

    s = state.settings
    with user_errors(ValueError, LookupError):
        row = enqueue_email(state.engine, s, recipient, subject, body, kind="test")
    click.echo(f"outbox row {row} queued")


@outbox.command("retry")
@click.argument("row_id", type=int)
@pass_state
def outbox_retry(state: CliState, row_id) -> None:
    """Give failed outbox row ROW_ID one more attempt."""
    from magpie.outbox.service import retry_email

    if not retry_email(state.engine, row_id):
        raise MagpieError(f"outbox row {row_id} does not exist or has not failed")
    click.echo(f"outbox row {row_id} queued again")


@outbox.command("work")
@worker_options("MAGPIE_EMAIL_WORKERS")
@pass_state
def outbox_work(state: CliState, workers, once, poll) -> None:
    """Run outbox senders in this process (until Ctrl-C, or once with --once)."""
    from magpie.outbox.service import run_outbox_workers

    run_workers(partial(run_outbox_workers, state.engine, state.settings, workers), once=once, poll=poll)


@outbox.command("housekeep")
@pass_state
def outbox_housekeep(state: CliState) -> None:
    """Run outbox housekeeping once (under its leader lock)."""
    from magpie.outbox.service import run_housekeeping

    s = state.settings
    rep = run_housekeeping(state.redis, state.engine, s)
    if rep is None:
        raise MagpieError("another instance holds the outbox-housekeeping leader lock")
    click.echo(f"returned={rep.returned} failed={rep.failed}")


COMMANDS = [outbox]
