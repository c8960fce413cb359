"""``magpie web``: serve the operator dashboard and its JSON API with uvicorn until stopped."""

from __future__ import annotations

import click

from magpie.cli.context import CliState, pass_state
from magpie.errors import MagpieError


@click.command("web")
@click.option("--host", default=None, help="Bind address (default MAGPIE_WEB_HOST, 127.0.0.1).")
@click.option("--port", default=None, type=click.IntRange(0, 65535),
              help="TCP port (default MAGPIE_WEB_PORT, 8080; 0 picks a free one).")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              help="uvicorn's log level.")
@pass_state
def web_cmd(state: CliState, host: str | None, port: int | None, log_level: str) -> None:
    """Serve the dashboard: schedule per shard, charts, dead letters, routes, alerts, operator actions.

    Reads are open on a loopback address; any other address needs MAGPIE_WEB_TOKEN, and then reads need
    the token too. Operator actions (pause, resume, reprocess, check now) always need the token and are
    refused while MAGPIE_WEB_TOKEN is unset.
    """
    import socket

    import uvicorn

    from magpie.web.app import create_app
    from magpie.web.auth import is_loopback

    s = state.settings
    host = host or s.web_host
    port = s.web_port if port is None else port
    if not is_loopback(host) and not s.web_token:
        raise MagpieError(f"refusing to serve the dashboard on {host} without MAGPIE_WEB_TOKEN "
                          "(set it, or bind 127.0.0.1)")
    s = s.model_copy(update={"web_host": host})
    from magpie.web.service import Dashboard

    # a missing database or another PROXY_ENCRYPTION_KEY stops here with one line, before binding
    app = create_app(s, dashboard=Dashboard(s, engine=state.engine))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise MagpieError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    actions = "actions need the token" if s.web_token else "actions disabled (MAGPIE_WEB_TOKEN not set)"
    click.echo(f"dashboard on http://{shown}:{bound}/ ({actions}; Ctrl-C to stop)", err=False)
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    server.run(sockets=[sock])


COMMANDS = [web_cmd]
