"""``magpie maintenance run JOB|all`` (one pass now, under the job's leader lock) and ``... status``."""

from __future__ import annotations

import json
import sys

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json, print_table
from magpie.errors import MagpieError


def _ts(v) -> str:
    return v.strftime("%Y-%m-%d %H:%M:%S") if v is not None else "-"


@click.group("maintenance")
def maintenance() -> None:
    """Maintenance jobs: retention, partitions, daily counters, cleanup, schedule rebuild, reputation,
    rollups and the instance registry."""


@maintenance.command("run")
@click.argument("job")
@json_option
@click.option("--batch-size", type=int, default=None, help="Override MAGPIE_MAINTENANCE_BATCH_SIZE.")
@click.option("--max-batches", type=int, default=None, help="Override MAGPIE_MAINTENANCE_MAX_BATCHES.")
@click.option("--max-seconds", type=float, default=None, help="Override MAGPIE_MAINTENANCE_MAX_RUN_SECONDS.")
@pass_state
def maintenance_run(state: CliState, job: str, as_json: bool, batch_size, max_batches, max_seconds) -> None:
    """Run one pass of JOB (or `all`) now, under its leader lock. Exits 1 if a pass failed."""
    from magpie.wiring.jobs import JOBS, run_job

    names = list(JOBS) if job == "all" else [job]
    for n in names:
        if n not in JOBS:
            raise MagpieError(f"unknown job {n!r}; known: all, {', '.join(JOBS)}")
    kw = dict(batch_size=batch_size, max_batches=max_batches, max_seconds=max_seconds)
    results = [run_job(n, state.settings, engine=state.engine, redis=state.redis, **kw) for n in names]
    if as_json:
        echo_json(results if job == "all" else results[0])
    else:
        for r in results:
            line = f"{r['job']:<18} {r['status']:<8} {r['seconds']:.2f}s"
            if r["status"] == "ok":
                line += " " + json.dumps(r["result"], default=str)
            elif r["status"] == "error":
                line += " " + (r["error"] or "")
            else:
                line += " " + (r.get("reason") or "another process holds the leader lock")
            click.echo(line)
    sys.exit(1 if any(r["status"] == "error" for r in results) else 0)


def _heartbeats(state: CliState) -> dict:
    """The per-process family ``instance_heartbeat`` as a status row: its cadence, and as last success
    the newest refresh of a live instance (every process refreshes its own record; no leader)."""
    from datetime import datetime

    import redis

    from magpie.coordination.instances import InstanceRegistry

    s = state.settings
    try:
        live = InstanceRegistry(state.redis, s.redis_prefix).list_live()
        newest = max((datetime.fromisoformat(r["refreshed_at"]) for r in live if r.get("refreshed_at")),
                     default=None)
        err = None
    except redis.RedisError as exc:
        live, newest, err = [], None, f"Redis error: {exc}"
    return {"job": "instance_heartbeat", "description": f"every worker and beat refreshes its instance "
            f"record (TTL {s.instance_ttl:g} s); {len(live)} live", "every_s": s.instance_heartbeat,
            "leader_active": None, "per_process": True, "last_started_at": newest, "last_finished_at": newest,
            "last_success_at": newest, "last_error_at": None, "last_error": err, "last_duration_s": None,
            "last_result": {"live": len(live)}, "state": {}, "runs_total": 0, "failures_total": 0}


@maintenance.command("status")
@json_option
@pass_state
def maintenance_status(state: CliState, as_json: bool) -> None:
    """Every family: cadence, leader held now, last start / success / error, runs and failures; the
    per-process instance heartbeat last (its last success is the newest live refresh)."""
    from rich.table import Table
    from rich.text import Text

    from magpie.wiring.jobs import job_status

    rows = job_status(state.settings, engine=state.engine, redis=state.redis) + [_heartbeats(state)]
    if as_json:
        echo_json(rows)
        return
    t = Table(title="maintenance jobs")
    for col in ("job", "every s", "leader", "last start (UTC)", "last success (UTC)", "runs", "failures",
                "last error"):
        t.add_column(col)
    for r in rows:
        leader = {True: "held", False: "-", None: "?"}[r["leader_active"]]
        if r.get("per_process"):
            leader = "per process"
        t.add_row(r["job"], f"{r['every_s']:g}", leader, _ts(r["last_started_at"]), _ts(r["last_success_at"]),
                  str(r["runs_total"]), str(r["failures_total"]),
                  Text((r["last_error"] or "")[:60]))  # an error message is not markup
    print_table(t)


COMMANDS = [maintenance]
