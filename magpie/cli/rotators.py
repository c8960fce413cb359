"""Commands for rotating listeners: ``magpie rotators add|update|remove|list`` and ``magpie rotator``."""

from __future__ import annotations

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json, rows_table
from magpie.errors import MagpieError


def _filters(protocols, anonymity, max_latency, reputation, country, allowed_ports=None, exit_country=None) -> dict:
    out = {}
    if exit_country is not None:
        out["exit_country"] = exit_country
    if allowed_ports is not None:
        out["allowed_ports"] = allowed_ports
    if protocols is not None:
        out["protocols"] = protocols
    if anonymity is not None:
        out["anonymity"] = anonymity
    if max_latency is not None:
        out["max_latency_ms"] = max_latency
    if reputation is not None:
        out["reputation"] = reputation
    if country is not None:
        out["country"] = country
    return out


def _filter_options(f):
    for opt in reversed([
        click.option("--protocols", default=None, help="Upstream protocols, e.g. socks5,http."),
        click.option("--anonymity", default=None, help="Anonymity levels, e.g. elite,anonymous."),
        click.option("--max-latency", "max_latency", type=float, default=None, help="Most latency (ms)."),
        click.option("--reputation", default=None, type=click.Choice(["good", "neutral", "poor"])),
        click.option("--country", default=None, help="Two-letter country codes, e.g. DE,NL."),
        click.option("--exit-country", "exit_country", default=None,
                     help="Two-letter country codes of the exit address the judge saw, e.g. DE,NL."),
        click.option("--allowed-ports", "allowed_ports", default=None,
                     help="Destination ports clients may reach, e.g. 80,443,8000-8100 (default: "
                          "MAGPIE_ROTATOR_ALLOWED_PORTS)."),
    ]):
        f = opt(f)
    return f


@click.group()
def rotators() -> None:
    """Rotating listeners: a proxy endpoint per workspace over its healthy routes."""


@rotators.command("add")
@click.argument("name")
@click.option("--workspace", required=True, help="Workspace whose routes the rotator uses.")
@click.option("--listen", default="http,socks5", show_default=True, help="Client protocols: http, socks5.")
@click.option("--port", type=int, default=None, help="Port (default: the lowest free one of MAGPIE_ROTATOR_PORTS).")
@click.option("--username", default=None, help="Client username (needs --password-env or --password-stdin).")
@click.option("--password-env", default=None, metavar="VAR", help="Read the client password from env VAR.")
@click.option("--password-stdin", is_flag=True, help="Read the client password from stdin.")
@click.option("--policy", type=click.Choice(["next", "sticky"]), default="next", show_default=True)
@click.option("--sticky-seconds", type=int, default=0, help="With --policy sticky: seconds per client.")
@_filter_options
@json_option
@pass_state
def rotators_add(state: CliState, name, workspace, listen, port, username, password_env, password_stdin, policy,
                 sticky_seconds, protocols, anonymity, max_latency, reputation, country, exit_country,
                 allowed_ports, as_json) -> None:
    """Create a rotator NAME (refused: port_taken, range_exhausted, no_such_workspace).

    Without credentials it is open to anyone who reaches its port, so it is served on loopback only."""
    from magpie.rotator.service import add_rotator

    password = _password(password_env, password_stdin)
    got = add_rotator(state.engine, state.keyring, name=name, workspace=workspace, ports=state.settings.rotator_ports,
                      listen=listen, port=port, username=username, password=password,
                      filters=_filters(protocols, anonymity, max_latency, reputation, country, allowed_ports,
                                       exit_country),
                      policy=policy, sticky_seconds=sticky_seconds, redis=state.redis,
                      prefix=state.settings.redis_prefix)
    if as_json:
        echo_json(got)
        return
    click.echo(f"rotator {got['name']} on port {got['port']} ({'+'.join(got['listen'])}), workspace {workspace}")
    if not got["auth"]:
        click.echo(_open_note(state.settings.rotator_host), err=True)


def _open_note(host: str) -> str:
    from magpie.rotator.process import is_loopback_host

    if is_loopback_host(host):
        return "open rotator (no credentials): served on loopback only"
    return (f"open rotator (no credentials): refused on MAGPIE_ROTATOR_HOST {host}, which is not loopback; "
            "give it --username with --password-env or --password-stdin")


def _password(env_var: str | None, from_stdin: bool) -> str | None:
    import os

    from magpie.errors import MagpieError

    if env_var and from_stdin:
        raise MagpieError("give --password-env or --password-stdin, not both")
    if env_var:
        value = os.environ.get(env_var)
        if not value:
            raise MagpieError(f"--password-env: environment variable {env_var} is empty or not set")
        return value
    if from_stdin:
        value = click.get_text_stream("stdin").readline().rstrip("\r\n")
        if not value:
            raise MagpieError("--password-stdin: no password on stdin")
        return value
    return None


@rotators.command("update")
@click.argument("name")
@click.option("--listen", default=None)
@click.option("--port", type=int, default=None)
@click.option("--username", default=None)
@click.option("--password-env", default=None, metavar="VAR")
@click.option("--password-stdin", is_flag=True)
@click.option("--no-auth", is_flag=True, help="Remove the client credentials.")
@click.option("--policy", type=click.Choice(["next", "sticky"]), default=None)
@click.option("--sticky-seconds", type=int, default=None)
@click.option("--enable/--disable", "enabled", default=None)
@click.option("--clear-filters", is_flag=True, help="Drop every filter before applying the given ones.")
@_filter_options
@json_option
@pass_state
def rotators_update(state: CliState, name, listen, port, username, password_env, password_stdin, no_auth, policy,
                    sticky_seconds, enabled, clear_filters, protocols, anonymity, max_latency, reputation, country,
                    exit_country, allowed_ports, as_json) -> None:
    """Change rotator NAME; running listeners apply it without a restart."""
    from magpie.rotator.service import get_rotator, update_rotator

    changes: dict = {}
    if listen is not None:
        changes["listen"] = listen
    if port is not None:
        changes["port"] = port
    password = _password(password_env, password_stdin)
    if no_auth:
        changes.update(username=None, password=None)
    elif username is not None or password is not None:
        changes.update(username=username, password=password)
    if policy is not None:
        changes["policy"] = policy
    if sticky_seconds is not None:
        changes["sticky_seconds"] = sticky_seconds
    if enabled is not None:
        changes["enabled"] = enabled
    new = _filters(protocols, anonymity, max_latency, reputation, country, allowed_ports, exit_country)
    if new or clear_filters:
        base = {} if clear_filters else dict(get_rotator(state.engine, name)["filters"])
        base.update(new)
        changes["filters"] = base
    got = update_rotator(state.engine, state.keyring, name, ports=state.settings.rotator_ports, redis=state.redis,
                         prefix=state.settings.redis_prefix, **changes)
    if as_json:
        echo_json(got)
        return
    click.echo(f"rotator {got['name']} updated (revision {got['revision']})")
    if not got["auth"]:
        click.echo(_open_note(state.settings.rotator_host), err=True)


@rotators.command("remove")
@click.argument("name")
@pass_state
def rotators_remove(state: CliState, name) -> None:
    """Delete rotator NAME (its listener stops)."""
    from magpie.rotator.service import remove_rotator

    remove_rotator(state.engine, name, redis=state.redis, prefix=state.settings.redis_prefix)
    click.echo(f"rotator {name} removed")


@rotators.command("list")
@json_option
@pass_state
def rotators_list(state: CliState, as_json) -> None:
    """Every rotator with its instance, port, pool size and state."""
    from magpie.rotator.process import list_with_state

    rows = list_with_state(state.engine, state.redis, state.settings.redis_prefix)
    if as_json:
        echo_json(rows)
        return
    rows_table("rotators", ["name", "workspace", "port", "listen", "auth", "policy", "filters", "instance", "state",
                            "pool", "connections", "failures"],
               [[r["name"], r["workspace"], r["port"], "+".join(r["listen"]), "yes" if r["auth"] else "no",
                 r["policy"] + (f" {r['sticky_seconds']}s" if r["policy"] == "sticky" else ""),
                 ",".join(f"{k}={v}" for k, v in r["filters"].items()) or None, r["instance"],
                 r.get("error") or r["state"], r["pool"], r["connections"], r["upstream_failures"]] for r in rows])


@click.command("rotator")
@pass_state
def rotator(state: CliState) -> None:
    """Run a rotator process: serve the listeners assigned to this instance until SIGTERM/SIGINT."""
    import asyncio
    import logging
    import signal

    from magpie.rotator.process import RotatorProcess
    from magpie.rotator.service import port_range

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    s = state.settings
    port_range(s.rotator_ports)
    proc = RotatorProcess(s, engine=state.engine, redis=state.redis, keyring=state.keyring)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if s.rotator_metrics_port:
            from magpie.rotator.metrics import serve_metrics

            try:
                serve_metrics(proc, s.metrics_host, s.rotator_metrics_port)
            except OSError as exc:
                raise MagpieError(f"MAGPIE_ROTATOR_METRICS_PORT: cannot listen on {s.metrics_host}:"
                                  f"{s.rotator_metrics_port}: {exc.strerror or exc}") from None
        click.echo(f"rotator instance {proc.id} started", err=True)
        await proc.run(stop)

    asyncio.run(main())


COMMANDS: list = [rotators, rotator]
