"""``magpie metrics`` (serve /metrics until stopped) and ``magpie health`` (readiness; 1 when not ready)."""

from __future__ import annotations

import sys
import time

import click

from magpie.cli.context import CliState, json_option, pass_state, user_errors
from magpie.cli.output import echo_json


@click.command("metrics")
@click.option("--host", default=None, help="Bind address (default MAGPIE_METRICS_HOST, 127.0.0.1).")
@click.option("--port", default=None, type=click.IntRange(1, 65535),
              help="TCP port (default MAGPIE_METRICS_PORT, else 9464).")
@pass_state
def metrics_cmd(state: CliState, host: str | None, port: int | None) -> None:
    """Serve /metrics in Prometheus text format (schedule, stream, maintenance, check counters)."""
    from magpie.observability.metrics import serve
    from magpie.wiring.jobs import JOBS

    s = state.settings
    host = host or s.metrics_host
    port = port if port is not None else (s.metrics_port or 9464)
    with user_errors(OSError, prefix=f"cannot listen on {host}:{port}: "):
        server, _thread = serve(s, host, port, jobs=JOBS.values())
    click.echo(f"metrics on http://{host}:{server.server_port}/metrics (Ctrl-C to stop)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()


@click.command("health")
@json_option
@click.option("--timeout", default=None, type=float,
              help="Seconds per probe (default MAGPIE_HEALTH_TIMEOUT).")
@pass_state
def health_cmd(state: CliState, as_json: bool, timeout: float | None) -> None:
    """Readiness of Redis, PostgreSQL, the broker, the schema and the schedule; exits 1 when not ready."""
    from magpie.observability.health import check_health

    rep = check_health(state.settings, timeout=timeout)
    if as_json:
        echo_json(rep)
    else:
        for name, c in rep["checks"].items():
            mark = ("WARN" if c.get("warn") else "ok  ") if c["ok"] else "FAIL"
            click.echo(f"{mark} {name:<9} {c['detail']} ({c['ms']:.0f} ms)")
        click.echo("ready" if rep["ready"] else "NOT READY")
    sys.exit(0 if rep["ready"] else 1)


COMMANDS = [metrics_cmd, health_cmd]
