"""CLI commands of the maintenance work, added to ``magpie`` by :func:`register`:

``magpie metrics [--host H] [--port P]``   serve /metrics (Prometheus text) until stopped
``magpie health [--json]``                 readiness; exit status 1 when not ready
``magpie maintenance run JOB|all [--json]`` one pass now, under the job's leader lock
``magpie maintenance status [--json]``      last start / success / error and counters per job
"""

from __future__ import annotations

import json
import sys
import time

import click

from magpie.cli_common import echo_json as _echo_json, load_settings_or_exit as _settings




def _ts(v) -> str:
    return v.strftime("%Y-%m-%d %H:%M:%S") if v is not None else "-"


@click.command("metrics")
@click.option("--host", default=None, help="Bind address (default MAGPIE_METRICS_HOST, 127.0.0.1).")
@click.option("--port", default=None, type=click.IntRange(1, 65535), help="TCP port (default MAGPIE_METRICS_PORT, else 9464).")
def metrics_cmd(host: str | None, port: int | None) -> None:
    """Serve /metrics in Prometheus text format (schedule, stream, maintenance, check counters)."""
    from magpie.metrics import serve

    s = _settings()
    host = host or s.metrics_host
    port = port if port is not None else (s.metrics_port or 9464)
    try:
        server, _thread = serve(s, host, port)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--timeout", default=None, type=float, help="Seconds per probe (default MAGPIE_HEALTH_TIMEOUT)."
)
def health_cmd(as_json: bool, timeout: float | None) -> None:
    """Readiness of Redis, PostgreSQL, the broker, the schema and the schedule; exits 1 when not ready."""
    from magpie.health import check_health

    rep = check_health(_settings(), timeout=timeout)
    if as_json:
        _echo_json(rep)
    else:
        for name, c in rep["checks"].items():
            mark = "ok  " if c["ok"] else "FAIL"
            click.echo(f"{mark} {name:<9} {c['detail']} ({c['ms']:.0f} ms)")
        click.echo("ready" if rep["ready"] else "NOT READY")
    sys.exit(0 if rep["ready"] else 1)


@click.group("maintenance")
def maintenance() -> None:
    """Maintenance jobs: retention, partitions, daily counters, cleanup, schedule rebuild."""


@maintenance.command("run")
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--batch-size", type=int, default=None, help="Override MAGPIE_MAINTENANCE_BATCH_SIZE.")
@click.option("--max-batches", type=int, default=None, help="Override MAGPIE_MAINTENANCE_MAX_BATCHES.")
@click.option("--max-seconds", type=float, default=None, help="Override MAGPIE_MAINTENANCE_MAX_RUN_SECONDS.")
def maintenance_run(job: str, as_json: bool, batch_size, max_batches, max_seconds) -> None:
    """Run one pass of JOB (or `all`) now, under its leader lock. Exits 1 if a pass failed."""
    from magpie.maintenance.registry import JOBS
    from magpie.maintenance.runner import run_job

    s = _settings()
    names = list(JOBS) if job == "all" else [job]
    for n in names:
        if n not in JOBS:
            raise click.ClickException(f"unknown job {n!r}; known: all, {', '.join(JOBS)}")
    kw = dict(batch_size=batch_size, max_batches=max_batches, max_seconds=max_seconds)
    results = [run_job(n, s, **kw) for n in names]
    if as_json:
        _echo_json(results if job == "all" else results[0])
    else:
        for r in results:
            line = f"{r['job']:<18} {r['status']:<8} {r['seconds']:.2f}s"
            if r["status"] == "ok":
                line += " " + json.dumps(r["result"], default=str)
            elif r["status"] == "error":
                line += " " + (r["error"] or "")
            else:
                line += " another process holds the leader lock"
            click.echo(line)
    sys.exit(1 if any(r["status"] == "error" for r in results) else 0)


@maintenance.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def maintenance_status(as_json: bool) -> None:
    """Per job: cadence, leader held now, last start / success / error, runs and failures."""
    from magpie.maintenance.runner import job_status

    try:
        rows = job_status(_settings())
    except Exception as exc:  # noqa: BLE001 - unreachable database or unmigrated schema
        raise click.ClickException(f"cannot read maintenance status from PostgreSQL: {exc}") from None
    if as_json:
        _echo_json(rows)
        return
    from rich.console import Console
    from rich.table import Table

    from rich.text import Text

    t = Table(title="maintenance jobs")
    for col in (
        "job",
        "every s",
        "leader",
        "last start (UTC)",
        "last success (UTC)",
        "runs",
        "failures",
        "last error",
    ):
        t.add_column(col)
    for r in rows:
        leader = {True: "held", False: "-", None: "?"}[r["leader_active"]]
        t.add_row(
            r["job"],
            f"{r['every_s']:g}",
            leader,
            _ts(r["last_started_at"]),
            _ts(r["last_success_at"]),
            str(r["runs_total"]),
            str(r["failures_total"]),
            Text((r["last_error"] or "")[:60]),  # an error message is not markup
        )
    Console().print(t)


def register(main: click.Group) -> None:
    """Add ``metrics``, ``health`` and the ``maintenance`` group to the ``magpie`` command group."""
    main.add_command(metrics_cmd)
    main.add_command(health_cmd)
    main.add_command(maintenance)
