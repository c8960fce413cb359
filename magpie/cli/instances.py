"""``magpie instances``: the live worker and beat processes (their heartbeat records in Redis)."""

from __future__ import annotations

from datetime import UTC, datetime

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json, rows_table


def _age(iso: str | None) -> str | None:
    if not iso:
        return None
    try:
        return f"{(datetime.now(UTC) - datetime.fromisoformat(iso)).total_seconds():.0f}s"
    except ValueError:
        return None


def _detail(rec: dict) -> str:
    """The role-specific cells of a record: checks in flight / slots, or the beat's schedule state."""
    parts = []
    checks = rec.get("checks")
    if isinstance(checks, dict) and checks.get("processes"):
        parts.append(f"checks {checks.get('in_flight', 0)}/{checks.get('slots', 0)} "
                     f"in {checks.get('processes')} process(es)")
    sched = rec.get("schedule")
    if isinstance(sched, dict):
        state = "bootstrapped" if sched.get("bootstrapped") else "not bootstrapped"
        parts.append(f"schedule {state} ({sched.get('entries', 0)} entries)")
    revs = rec.get("cache_revisions")
    if revs:
        parts.append("caches " + ", ".join(f"{k}={v}" for k, v in sorted(revs.items())))
    return "; ".join(parts)


@click.command("instances")
@click.option("--role", default=None, help="Only instances of this role (worker, beat, ...).")
@json_option
@pass_state
def instances(state: CliState, role: str | None, as_json: bool) -> None:
    """Live instances: id, role, host, pid, version, queues, checks in flight, cache revisions, age of
    the last heartbeat. An instance that stops refreshing disappears after MAGPIE_INSTANCE_TTL seconds."""
    from magpie.coordination.instances import InstanceRegistry

    live = InstanceRegistry(state.redis, state.settings.redis_prefix).list_live(role)
    if as_json:
        echo_json(live)
        return
    rows_table(f"live instances ({len(live)})",
               ["id", "role", "host", "pid", "version", "queues", "started (UTC)", "heartbeat", "details"],
               [[r.get("id"), r.get("role"), r.get("host"), r.get("pid"), r.get("version"),
                 ",".join(r.get("queues") or []) or None, (r.get("started_at") or "")[:19].replace("T", " "),
                 _age(r.get("refreshed_at")), _detail(r) or None] for r in live])


COMMANDS: list = [instances]
