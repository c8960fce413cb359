"""``magpie alerts ...``: alert rules, channels, evaluation, incidents and webhook delivery.

Read commands take ``--json``. Mistakes a user can fix (unknown workspace, bad threshold, refused webhook
URL, unknown rule) exit with status 2 and a one-line message (:mod:`magpie.cli`); the alert services
report a bad value with ``ValueError`` and an unknown id with ``LookupError``.
"""

from __future__ import annotations

from functools import partial

import click

from magpie.cli.routes import PROTOCOL_CHOICE
from magpie.cli.context import CliState, json_option, pass_state, run_workers, user_errors, worker_options
from magpie.cli.output import echo_json, rows_table
from magpie.errors import MagpieError


@click.group()
def alerts() -> None:
    """Alert rules, channels, evaluation, incidents and webhook delivery."""


@alerts.group()
def rules() -> None:
    """Create, edit, enable/disable and list alert rules."""


@rules.command("list")
@click.option("--workspace", "-w", default=None)
@json_option
@pass_state
def rules_list(state: CliState, workspace, as_json) -> None:
    """List rules with their current status and last measurement."""
    from magpie.alerts.rules import list_rules

    with user_errors(ValueError, LookupError):
        got = list_rules(state.engine, workspace)
    if as_json:
        echo_json([r.as_json() for r in got])
        return
    rows_table("alert rules",
               ["id", "workspace", "name", "condition", "min samples", "enabled", "rev", "status", "last",
                "value"],
               [[r.id, r.workspace, r.name, r.describe(), r.min_samples, r.enabled, r.revision, r.status,
                 r.last_outcome, None if r.last_value is None else f"{r.last_value:.4g}"] for r in got])


_KIND = click.Choice(["usable_routes", "success_rate", "latency"])


@rules.command("create")
@click.option("--workspace", "-w", required=True)
@click.argument("name")
@click.option("--kind", required=True, type=_KIND)
@click.option("--threshold", required=True, type=float,
              help="usable_routes: routes; success_rate: percent; latency: ms.")
@click.option("--percentile", type=click.Choice(["50", "95"]), default=None,
              help="latency rules (default 95).")
@click.option("--protocol", "protocols", multiple=True, type=PROTOCOL_CHOICE,
              help="Only these protocols (repeatable).")
@click.option("--min-samples", type=int, default=None)
@click.option("--freshness", type=int, default=None, help="usable_routes: seconds a check stays fresh.")
@click.option("--disabled", is_flag=True)
@click.option("--rotator", default=None, help="Scope the rule to this rotator of the workspace.")
@json_option
@pass_state
def rules_create(state: CliState, workspace, name, kind, threshold, percentile, protocols, min_samples,
                 freshness, disabled, rotator, as_json) -> None:
    """Create rule NAME in a workspace (with --rotator: scoped to one of its rotators)."""
    from magpie.alerts.rules import create_rule

    with user_errors(ValueError, LookupError):
        r = create_rule(state.engine, workspace, name, kind, threshold,
                        percentile=int(percentile) if percentile else None, protocols=list(protocols) or None,
                        min_samples=min_samples, freshness_s=freshness, enabled=not disabled, rotator=rotator)
    echo_json(r.as_json()) if as_json else click.echo(f"rule {r.id} created: {r.describe()}")


@rules.command("edit")
@click.argument("rule_id", type=int)
@click.option("--name", default=None)
@click.option("--threshold", type=float, default=None)
@click.option("--percentile", type=click.Choice(["50", "95"]), default=None)
@click.option("--protocol", "protocols", multiple=True, type=PROTOCOL_CHOICE)
@click.option("--all-protocols", is_flag=True, help="Remove the protocol filter.")
@click.option("--min-samples", type=int, default=None)
@click.option("--freshness", type=int, default=None)
@click.option("--expected-revision", type=int, default=None, help="Refuse if the rule changed meanwhile.")
@json_option
@pass_state
def rules_edit(state: CliState, rule_id, name, threshold, percentile, protocols, all_protocols, min_samples,
               freshness, expected_revision, as_json) -> None:
    """Edit rule RULE_ID (a new revision; its minute streaks restart)."""
    from magpie.alerts.rules import edit_rule

    kw: dict = {}
    if percentile:
        kw["percentile"] = int(percentile)
    if all_protocols:
        kw["protocols"] = None
    elif protocols:
        kw["protocols"] = list(protocols)
    if freshness is not None:
        kw["freshness_s"] = freshness
    with user_errors(ValueError, LookupError):
        r = edit_rule(state.engine, rule_id, name=name, threshold=threshold, min_samples=min_samples,
                      expected_revision=expected_revision, **kw)
    echo_json(r.as_json()) if as_json else click.echo(f"rule {r.id} at revision {r.revision}: {r.describe()}")


def _toggle(state: CliState, rule_id: int, enabled: bool) -> None:
    from magpie.alerts.rules import set_enabled

    with user_errors(ValueError, LookupError):
        r = set_enabled(state.engine, rule_id, enabled)
    click.echo(f"rule {r.id} {'enabled' if r.enabled else 'disabled'} (revision {r.revision})")


@rules.command("enable")
@click.argument("rule_id", type=int)
@pass_state
def rules_enable(state: CliState, rule_id) -> None:
    """Enable rule RULE_ID."""
    _toggle(state, rule_id, True)


@rules.command("disable")
@click.argument("rule_id", type=int)
@pass_state
def rules_disable(state: CliState, rule_id) -> None:
    """Disable rule RULE_ID (an open incident stays open)."""
    _toggle(state, rule_id, False)


@rules.command("delete")
@click.argument("rule_id", type=int)
@pass_state
def rules_delete(state: CliState, rule_id) -> None:
    """Delete rule RULE_ID with its incidents and deliveries."""
    from magpie.alerts.rules import delete_rule

    if not delete_rule(state.engine, rule_id):
        raise MagpieError(f"no such rule: {rule_id}")
    click.echo(f"rule {rule_id} deleted")


@alerts.group()
def channels() -> None:
    """Webhook and email channels of a workspace."""


@channels.command("list")
@click.option("--workspace", "-w", default=None)
@json_option
@pass_state
def channels_list(state: CliState, workspace, as_json) -> None:
    """List channels (secrets are never shown)."""
    from magpie.alerts.channels import list_channels

    with user_errors(ValueError, LookupError):
        got = list_channels(state.engine, workspace)
    if as_json:
        echo_json([c.as_json() for c in got])
        return
    rows_table("alert channels", ["id", "workspace", "name", "kind", "target", "enabled"],
               [[c.id, c.workspace_id, c.name, c.kind, c.target, c.enabled] for c in got])


@channels.command("add-webhook")
@click.option("--workspace", "-w", required=True)
@click.argument("name")
@click.argument("url")
@click.option("--secret", default=None, help="HMAC secret (default: generated and printed once).")
@pass_state
def channels_add_webhook(state: CliState, workspace, name, url, secret) -> None:
    """Add webhook channel NAME posting to URL (private addresses need MAGPIE_WEBHOOK_ALLOW_PRIVATE)."""
    from magpie.alerts.channels import create_webhook_channel

    s = state.settings
    with user_errors(ValueError, LookupError):
        ch = create_webhook_channel(state.engine, s, workspace, name, url, secret=secret)
    click.echo(f"channel {ch.id} created; signing secret (shown once): {ch.secret}")


@channels.command("add-email")
@click.option("--workspace", "-w", required=True)
@click.argument("name")
@click.argument("address")
@pass_state
def channels_add_email(state: CliState, workspace, name, address) -> None:
    """Add email channel NAME sending to ADDRESS through the outbox."""
    from magpie.alerts.channels import create_email_channel

    with user_errors(ValueError, LookupError):
        ch = create_email_channel(state.engine, workspace, name, address)
    click.echo(f"channel {ch.id} created")


def _toggle_channel(state: CliState, channel_id: int, enabled: bool) -> None:
    from magpie.alerts.channels import set_channel_enabled

    with user_errors(ValueError, LookupError):
        set_channel_enabled(state.engine, channel_id, enabled)
    click.echo(f"channel {channel_id} {'enabled' if enabled else 'disabled'}")


@channels.command("enable")
@click.argument("channel_id", type=int)
@pass_state
def channels_enable(state: CliState, channel_id) -> None:
    """Enable channel CHANNEL_ID."""
    _toggle_channel(state, channel_id, True)


@channels.command("disable")
@click.argument("channel_id", type=int)
@pass_state
def channels_disable(state: CliState, channel_id) -> None:
    """Disable channel CHANNEL_ID (its queued webhook deliveries fail)."""
    _toggle_channel(state, channel_id, False)


@channels.command("delete")
@click.argument("channel_id", type=int)
@pass_state
def channels_delete(state: CliState, channel_id) -> None:
    """Delete channel CHANNEL_ID and its deliveries."""
    from magpie.alerts.channels import delete_channel

    if not delete_channel(state.engine, channel_id):
        raise MagpieError(f"no such channel: {channel_id}")
    click.echo(f"channel {channel_id} deleted")


@alerts.command("evaluate")
@json_option
@pass_state
def alerts_evaluate(state: CliState, as_json) -> None:
    """Run one evaluation pass now (under the alerts leader lock)."""
    from magpie.alerts.evaluate import run_evaluation

    s = state.settings
    rep = run_evaluation(state.redis, state.engine, s)
    if rep is None:
        raise MagpieError("another instance holds the alerts leader lock; nothing evaluated")
    if as_json:
        echo_json(rep.as_json())
        return
    o = rep.outcomes
    click.echo(f"{rep.rules} rules in {rep.workspaces} workspaces: applied={rep.applied} stale={rep.stale} "
               f"breach={o['breach']} healthy={o['healthy']} unknown={o['unknown']} errors={rep.errors}")
    for t in rep.transitions:
        click.echo(f"  rule {t.rule_id}: {t.event} (incident {t.incident_id}, value {t.value}, "
                   f"{t.deliveries} webhooks, {t.emails} emails)")


@alerts.command("incidents")
@click.option("--status", type=click.Choice(["open", "recovered"]), default=None)
@click.option("--limit", default=50, show_default=True)
@json_option
@pass_state
def alerts_incidents(state: CliState, status, limit, as_json) -> None:
    """Newest incidents first."""
    from magpie.alerts.evaluate import incidents

    got = incidents(state.engine, status=status, limit=limit)
    if as_json:
        echo_json(got)
        return
    rows_table("incidents", ["id", "workspace", "rule", "status", "opened", "recovered", "open value"],
               [[i["id"], i["workspace"], i["rule"], i["status"], i["opened_at"], i["recovered_at"],
                 i["open_value"]] for i in got])


@alerts.command("deliveries")
@click.option("--status", type=click.Choice(["pending", "processing", "sent", "failed"]), default=None)
@click.option("--limit", default=50, show_default=True)
@json_option
@pass_state
def alerts_deliveries(state: CliState, status, limit, as_json) -> None:
    """Webhook deliveries, newest first."""
    from magpie.alerts.delivery import list_deliveries

    got = list_deliveries(state.engine, status=status, limit=limit)
    if as_json:
        echo_json(got)
        return
    rows_table("webhook deliveries",
               ["id", "delivery id", "channel", "event", "status", "attempts", "next attempt", "last error"],
               [[d["id"], d["delivery_id"], d["channel"], d["event"], d["status"],
                 f"{d['attempts']}/{d['max_attempts']}", d["next_attempt_at"], d["last_error"]] for d in got])


@alerts.command("retry")
@click.argument("row_id", type=int)
@pass_state
def alerts_retry(state: CliState, row_id) -> None:
    """Give failed webhook delivery ROW_ID (the numeric id) one more attempt."""
    from magpie.alerts.delivery import retry_delivery

    if not retry_delivery(state.engine, row_id):
        raise MagpieError(f"delivery {row_id} does not exist or has not failed")
    click.echo(f"delivery {row_id} queued again")


@alerts.command("deliver")
@worker_options("MAGPIE_DELIVERY_WORKERS")
@pass_state
def alerts_deliver(state: CliState, workers, once, poll) -> None:
    """Run webhook delivery workers in this process (until Ctrl-C, or once with --once)."""
    from magpie.alerts.delivery import run_delivery_workers

    run_workers(partial(run_delivery_workers, state.engine, state.settings, workers), once=once, poll=poll)


COMMANDS = [alerts]
