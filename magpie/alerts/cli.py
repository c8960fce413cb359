"""``magpie alerts ...`` and ``magpie outbox ...`` command groups (registered by :func:`register`).

Read commands take ``--json``. Mistakes a user can fix (unknown workspace, bad threshold, refused webhook
URL) exit with status 2 and a one-line message.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from datetime import datetime

import click

from magpie.cli_common import echo_json as _echo_json, load_settings_or_exit as _settings



def _engine(settings):
    from magpie.db.session import get_engine

    return get_engine(settings.database_url)



@contextmanager
def _user_errors():
    from magpie.alerts.rules import RuleConflict
    from magpie.alerts.webhook import WebhookRefused

    try:
        yield
    except (ValueError, LookupError, WebhookRefused, RuleConflict) as exc:
        raise click.ClickException(str(exc)) from None


def _table(title: str, cols: list[str], rows: list[list]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title)
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*[Text("-" if v is None else (v.strftime("%Y-%m-%d %H:%M:%S") if isinstance(v, datetime)
                                                else str(v))) for v in r])  # Text: user data is not markup
    Console().print(t)


def _run_until_interrupted(fn) -> dict:
    stop = threading.Event()
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(fn(stop)), daemon=True)
    th.start()
    try:
        while th.is_alive():
            th.join(0.5)
    except KeyboardInterrupt:
        stop.set()
        th.join()
    return result


# ------------------------------------------------------------------------------------------ alerts
@click.group()
def alerts() -> None:
    """Alert rules, channels, evaluation, incidents and webhook delivery."""


@alerts.group()
def rules() -> None:
    """Create, edit, enable/disable and list alert rules."""


@rules.command("list")
@click.option("--workspace", "-w", default=None)
@click.option("--json", "as_json", is_flag=True)
def rules_list(workspace, as_json) -> None:
    """List rules with their current status and last measurement."""
    from magpie.alerts.rules import list_rules

    with _user_errors():
        got = list_rules(_engine(_settings()), workspace)
    if as_json:
        _echo_json([r.as_json() for r in got])
        return
    _table("alert rules", ["id", "workspace", "name", "condition", "min samples", "enabled", "rev", "status",
                           "last", "value"],
           [[r.id, r.workspace, r.name, r.describe(), r.min_samples, r.enabled, r.revision, r.status,
             r.last_outcome, None if r.last_value is None else f"{r.last_value:.4g}"] for r in got])


_KIND = click.Choice(["usable_routes", "success_rate", "latency"])
_PROTO = click.Choice(["http", "https", "socks4", "socks5"])


@rules.command("create")
@click.option("--workspace", "-w", required=True)
@click.argument("name")
@click.option("--kind", required=True, type=_KIND)
@click.option("--threshold", required=True, type=float,
              help="usable_routes: routes; success_rate: percent; latency: ms.")
@click.option("--percentile", type=click.Choice(["50", "95"]), default=None, help="latency rules (default 95).")
@click.option("--protocol", "protocols", multiple=True, type=_PROTO, help="Only these protocols (repeatable).")
@click.option("--min-samples", type=int, default=None)
@click.option("--freshness", type=int, default=None, help="usable_routes: seconds a check stays fresh.")
@click.option("--disabled", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def rules_create(workspace, name, kind, threshold, percentile, protocols, min_samples, freshness, disabled,
                 as_json) -> None:
    """Create rule NAME in a workspace."""
    from magpie.alerts.rules import create_rule

    with _user_errors():
        r = create_rule(_engine(_settings()), workspace, name, kind, threshold,
                        percentile=int(percentile) if percentile else None, protocols=list(protocols) or None,
                        min_samples=min_samples, freshness_s=freshness, enabled=not disabled)
    _echo_json(r.as_json()) if as_json else click.echo(f"rule {r.id} created: {r.describe()}")


@rules.command("edit")
@click.argument("rule_id", type=int)
@click.option("--name", default=None)
@click.option("--threshold", type=float, default=None)
@click.option("--percentile", type=click.Choice(["50", "95"]), default=None)
@click.option("--protocol", "protocols", multiple=True, type=_PROTO)
@click.option("--all-protocols", is_flag=True, help="Remove the protocol filter.")
@click.option("--min-samples", type=int, default=None)
@click.option("--freshness", type=int, default=None)
@click.option("--expected-revision", type=int, default=None, help="Refuse if the rule changed meanwhile.")
@click.option("--json", "as_json", is_flag=True)
def rules_edit(rule_id, name, threshold, percentile, protocols, all_protocols, min_samples, freshness,
               expected_revision, as_json) -> None:
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
    with _user_errors():
        r = edit_rule(_engine(_settings()), rule_id, name=name, threshold=threshold, min_samples=min_samples,
                      expected_revision=expected_revision, **kw)
    _echo_json(r.as_json()) if as_json else click.echo(f"rule {r.id} at revision {r.revision}: {r.describe()}")


def _toggle(rule_id: int, enabled: bool) -> None:
    from magpie.alerts.rules import set_enabled

    with _user_errors():
        r = set_enabled(_engine(_settings()), rule_id, enabled)
    click.echo(f"rule {r.id} {'enabled' if r.enabled else 'disabled'} (revision {r.revision})")


@rules.command("enable")
@click.argument("rule_id", type=int)
def rules_enable(rule_id) -> None:
    """Enable rule RULE_ID."""
    _toggle(rule_id, True)


@rules.command("disable")
@click.argument("rule_id", type=int)
def rules_disable(rule_id) -> None:
    """Disable rule RULE_ID (an open incident stays open)."""
    _toggle(rule_id, False)


@rules.command("delete")
@click.argument("rule_id", type=int)
def rules_delete(rule_id) -> None:
    """Delete rule RULE_ID with its incidents and deliveries."""
    from magpie.alerts.rules import delete_rule

    if not delete_rule(_engine(_settings()), rule_id):
        raise click.ClickException(f"no such rule: {rule_id}")
    click.echo(f"rule {rule_id} deleted")


@alerts.group()
def channels() -> None:
    """Webhook and email channels of a workspace."""


@channels.command("list")
@click.option("--workspace", "-w", default=None)
@click.option("--json", "as_json", is_flag=True)
def channels_list(workspace, as_json) -> None:
    """List channels (secrets are never shown)."""
    from magpie.alerts.channels import list_channels

    with _user_errors():
        got = list_channels(_engine(_settings()), workspace)
    if as_json:
        _echo_json([c.as_json() for c in got])
        return
    _table("alert channels", ["id", "workspace", "name", "kind", "target", "enabled"],
           [[c.id, c.workspace_id, c.name, c.kind, c.target, c.enabled] for c in got])


@channels.command("add-webhook")
@click.option("--workspace", "-w", required=True)
@click.argument("name")
@click.argument("url")
@click.option("--secret", default=None, help="HMAC secret (default: generated and printed once).")
def channels_add_webhook(workspace, name, url, secret) -> None:
    """Add webhook channel NAME posting to URL (private addresses need MAGPIE_WEBHOOK_ALLOW_PRIVATE)."""
    from magpie.alerts.channels import create_webhook_channel

    s = _settings()
    with _user_errors():
        ch = create_webhook_channel(_engine(s), s, workspace, name, url, secret=secret)
    click.echo(f"channel {ch.id} created; signing secret (shown once): {ch.secret}")


@channels.command("add-email")
@click.option("--workspace", "-w", required=True)
@click.argument("name")
@click.argument("address")
def channels_add_email(workspace, name, address) -> None:
    """Add email channel NAME sending to ADDRESS through the outbox."""
    from magpie.alerts.channels import create_email_channel

    with _user_errors():
        ch = create_email_channel(_engine(_settings()), workspace, name, address)
    click.echo(f"channel {ch.id} created")


@channels.command("enable")
@click.argument("channel_id", type=int)
def channels_enable(channel_id) -> None:
    """Enable channel CHANNEL_ID."""
    from magpie.alerts.channels import set_channel_enabled

    with _user_errors():
        set_channel_enabled(_engine(_settings()), channel_id, True)
    click.echo(f"channel {channel_id} enabled")


@channels.command("disable")
@click.argument("channel_id", type=int)
def channels_disable(channel_id) -> None:
    """Disable channel CHANNEL_ID (its queued webhook deliveries fail)."""
    from magpie.alerts.channels import set_channel_enabled

    with _user_errors():
        set_channel_enabled(_engine(_settings()), channel_id, False)
    click.echo(f"channel {channel_id} disabled")


@channels.command("delete")
@click.argument("channel_id", type=int)
def channels_delete(channel_id) -> None:
    """Delete channel CHANNEL_ID and its deliveries."""
    from magpie.alerts.channels import delete_channel

    if not delete_channel(_engine(_settings()), channel_id):
        raise click.ClickException(f"no such channel: {channel_id}")
    click.echo(f"channel {channel_id} deleted")


@alerts.command("evaluate")
@click.option("--json", "as_json", is_flag=True)
def alerts_evaluate(as_json) -> None:
    """Run one evaluation pass now (under the alerts leader lock)."""
    from magpie.alerts.evaluate import run_evaluation
    from magpie.runtime import redis_client

    s = _settings()
    rep = run_evaluation(redis_client(), _engine(s), s)
    if rep is None:
        raise click.ClickException("another instance holds the alerts leader lock; nothing evaluated")
    if as_json:
        _echo_json(rep.as_json())
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
@click.option("--json", "as_json", is_flag=True)
def alerts_incidents(status, limit, as_json) -> None:
    """Newest incidents first."""
    from magpie.alerts.evaluate import incidents

    got = incidents(_engine(_settings()), status=status, limit=limit)
    if as_json:
        _echo_json(got)
        return
    _table("incidents", ["id", "workspace", "rule", "status", "opened", "recovered", "open value"],
           [[i["id"], i["workspace"], i["rule"], i["status"], i["opened_at"], i["recovered_at"], i["open_value"]]
            for i in got])


@alerts.command("deliveries")
@click.option("--status", type=click.Choice(["pending", "processing", "sent", "failed"]), default=None)
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def alerts_deliveries(status, limit, as_json) -> None:
    """Webhook deliveries, newest first."""
    from magpie.alerts.delivery import list_deliveries

    got = list_deliveries(_engine(_settings()), status=status, limit=limit)
    if as_json:
        _echo_json(got)
        return
    _table("webhook deliveries", ["id", "delivery id", "channel", "event", "status", "attempts", "next attempt",
                                  "last error"],
           [[d["id"], d["delivery_id"], d["channel"], d["event"], d["status"], f"{d['attempts']}/{d['max_attempts']}",
             d["next_attempt_at"], d["last_error"]] for d in got])


@alerts.command("retry")
@click.argument("row_id", type=int)
def alerts_retry(row_id) -> None:
    """Give failed webhook delivery ROW_ID (the numeric id) one more attempt."""
    from magpie.alerts.delivery import retry_delivery

    if not retry_delivery(_engine(_settings()), row_id):
        raise click.ClickException(f"delivery {row_id} does not exist or has not failed")
    click.echo(f"delivery {row_id} queued again")


@alerts.command("deliver")
@click.option("--workers", type=int, default=None, help="Parallel senders (default MAGPIE_DELIVERY_WORKERS).")
@click.option("--once", is_flag=True, help="Drain what is due and exit.")
@click.option("--poll", default=1.0, show_default=True, help="Idle poll interval in seconds.")
def alerts_deliver(workers, once, poll) -> None:
    """Run webhook delivery workers in this process (until Ctrl-C, or once with --once)."""
    from magpie.alerts.delivery import run_delivery_workers

    s = _settings()
    if once:
        got = dict(run_delivery_workers(_engine(s), s, workers))
    else:
        got = _run_until_interrupted(lambda stop: run_delivery_workers(_engine(s), s, workers, stop=stop,
                                                                       poll_s=poll))
    click.echo(" ".join(f"{k}={v}" for k, v in sorted(got.items())) or "nothing due")


# ------------------------------------------------------------------------------------------ outbox
@click.group()
def outbox() -> None:
    """The email outbox: status, sending workers, housekeeping."""


@outbox.command("status")
@click.option("--json", "as_json", is_flag=True)
def outbox_status(as_json) -> None:
    """Rows per status."""
    from magpie.outbox.service import outbox_counts

    got = outbox_counts(_engine(_settings()))
    _echo_json(got) if as_json else click.echo(" ".join(f"{k}={v}" for k, v in got.items()))


@outbox.command("list")
@click.option("--status", type=click.Choice(["pending", "processing", "sent", "failed"]), default=None)
@click.option("--kind", default=None)
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def outbox_list(status, kind, limit, as_json) -> None:
    """Outbox rows, newest first (bodies not shown)."""
    from magpie.outbox.service import list_outbox

    with _user_errors():
        got = list_outbox(_engine(_settings()), status=status, kind=kind, limit=limit)
    if as_json:
        _echo_json(got)
        return
    _table("email outbox", ["id", "kind", "recipient", "subject", "status", "attempts", "next attempt", "last error"],
           [[r["id"], r["kind"], r["recipient"], r["subject"], r["status"], f"{r['attempts']}/{r['max_attempts']}",
             r["next_attempt_at"], r["last_error"]] for r in got])


@outbox.command("send")
@click.argument("recipient")
@click.argument("subject")
@click.argument("body")
def outbox_send(recipient, subject, body) -> None:
    """Queue a test email (kind ``test``)."""
    from magpie.outbox.service import enqueue_email

    s = _settings()
    with _user_errors():
        row = enqueue_email(_engine(s), s, recipient, subject, body, kind="test")
    click.echo(f"outbox row {row} queued")


@outbox.command("retry")
@click.argument("row_id", type=int)
def outbox_retry(row_id) -> None:
    """Give failed outbox row ROW_ID one more attempt."""
    from magpie.outbox.service import retry_email

    if not retry_email(_engine(_settings()), row_id):
        raise click.ClickException(f"outbox row {row_id} does not exist or has not failed")
    click.echo(f"outbox row {row_id} queued again")


@outbox.command("work")
@click.option("--workers", type=int, default=None, help="Parallel senders (default MAGPIE_EMAIL_WORKERS).")
@click.option("--once", is_flag=True, help="Drain what is due and exit.")
@click.option("--poll", default=1.0, show_default=True, help="Idle poll interval in seconds.")
def outbox_work(workers, once, poll) -> None:
    """Run outbox senders in this process (until Ctrl-C, or once with --once)."""
    from magpie.outbox.service import run_outbox_workers

    s = _settings()
    if once:
        got = dict(run_outbox_workers(_engine(s), s, workers))
    else:
        got = _run_until_interrupted(lambda stop: run_outbox_workers(_engine(s), s, workers, stop=stop, poll_s=poll))
    click.echo(" ".join(f"{k}={v}" for k, v in sorted(got.items())) or "nothing due")


@outbox.command("housekeep")
def outbox_housekeep() -> None:
    """Run outbox housekeeping once (under its leader lock)."""
    from magpie.outbox.service import run_housekeeping
    from magpie.runtime import redis_client

    s = _settings()
    rep = run_housekeeping(redis_client(), _engine(s), s)
    if rep is None:
        raise click.ClickException("another instance holds the outbox-housekeeping leader lock")
    click.echo(f"returned={rep.returned} failed={rep.failed} deleted={rep.deleted}")


def register(main: click.Group) -> None:
    """Add the ``alerts`` and ``outbox`` groups to the ``magpie`` command line."""
    main.add_command(alerts)
    main.add_command(outbox)
