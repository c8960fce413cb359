"""Commands for judge pools and check profiles (``magpie judges ...``, ``magpie profiles ...``).

A change raises the check-config revision and notifies the checkers, which also reconcile on their own
within ``MAGPIE_CONFIG_RECONCILE_SECONDS``. With ``--json`` every verb prints ``{"ok": true, "result":
...}``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import click

from magpie.base.protocols import PROTOCOLS
from magpie.cli.context import CliState, json_option, pass_state, user_errors
from magpie.cli.output import echo_json, rows_table

_JUDGE_COLS = ("id", "workspace", "url", "rule", "rate", "enabled", "health", "last_error", "last_checked_at",
               "addresses")


def _emit(as_json: bool, result) -> None:
    if as_json:
        echo_json({"ok": True, "result": result})


def _changed(state: CliState) -> dict:
    return {"redis": state.redis, "prefix": state.settings.redis_prefix}


@click.group()
def judges() -> None:
    """Manage judge pools: the global pool and per-workspace pools (MAGPIE_JUDGE_URL stands in for an
    empty global pool)."""


@judges.command("add")
@click.argument("url")
@click.option("--workspace", help="Add to this workspace's pool (default: the global pool).")
@click.option("--rule", default="echo", show_default=True, help="Valid answer: echo, status or contains:<text>.")
@click.option("--disabled", is_flag=True, help="Store it disabled (not used by checks).")
@click.option("--rate", type=float, default=None,
              help="Requests per second across the deployment (0: unlimited; default: MAGPIE_JUDGE_RATE).")
@json_option
@pass_state
def judges_add(state: CliState, url: str, workspace: str | None, rule: str, disabled: bool, rate: float | None,
               as_json: bool) -> None:
    """Add the judge at URL (http or https)."""
    from magpie.judges.store import add_judge

    with user_errors(ValueError):
        from magpie.base.egress import EgressPolicy

        guard = EgressPolicy(state.settings.check_allow_private, "MAGPIE_CHECK_ALLOW_PRIVATE")
        row = add_judge(state.engine, url, workspace=workspace, rule=rule, enabled=not disabled, egress=guard,
                        rate=rate, **_changed(state))
    _emit(as_json, row)
    if not as_json:
        click.echo(f"judge {row['id']} added: {row['url']} ({row['workspace'] or 'global'} pool)")


@judges.command("rate")
@click.argument("judge")
@click.argument("rate")
@click.option("--workspace", help="The pool the URL is in (default: the global pool).")
@json_option
@pass_state
def judges_rate(state: CliState, judge: str, rate: str, workspace: str | None, as_json: bool) -> None:
    """Set JUDGE's (id or URL) RATE: requests per second across the deployment, 0 unlimited, or
    "default" for MAGPIE_JUDGE_RATE."""
    from magpie.judges.store import set_judge_rate

    with user_errors(ValueError):
        row = set_judge_rate(state.engine, judge, None if rate == "default" else rate, workspace=workspace,
                             **_changed(state))
    _emit(as_json, row)
    if not as_json:
        shown = "default (MAGPIE_JUDGE_RATE)" if row["rate"] is None else f"{row['rate']:g}/s"
        click.echo(f"judge {row['id']} rate: {shown}")


@judges.command("remove")
@click.argument("judge")
@click.option("--workspace", help="The pool the URL is in (default: the global pool).")
@json_option
@pass_state
def judges_remove(state: CliState, judge: str, workspace: str | None, as_json: bool) -> None:
    """Remove JUDGE (its id, or its URL within the pool)."""
    from magpie.judges.store import remove_judge

    jid = remove_judge(state.engine, judge, workspace=workspace, **_changed(state))
    _emit(as_json, {"removed": jid})
    if not as_json:
        click.echo(f"judge {jid} removed")


@judges.command("list")
@click.option("--workspace", help="Only this workspace's pool.")
@json_option
@pass_state
def judges_list(state: CliState, workspace: str | None, as_json: bool) -> None:
    """List judges with their health (the refresh job's last verdict) and resolved addresses."""
    from magpie.judges.store import list_judges

    rows = list_judges(state.engine, workspace)
    if as_json:
        _emit(True, rows)
        return
    rows_table("judges", _JUDGE_COLS, [[r["id"], r["workspace"] or "global", r["url"], r["rule"],
                                        "default" if r["rate"] is None else f"{r['rate']:g}/s", r["enabled"],
                                        r["health"], r["last_error"], r["last_checked_at"],
                                        ",".join(r["addresses"] or [])] for r in rows])


@judges.command("check")
@click.argument("judge", required=False)
@json_option
@pass_state
def judges_check(state: CliState, judge: str | None, as_json: bool) -> None:
    """Probe every judge (or JUDGE, an id or URL) directly now and record the verdict. Exit status 1
    when one fails."""
    from magpie.judges.refresh import probe_all
    from magpie.judges.store import bump, list_judges, notify, record_health

    rows = [r for r in list_judges(state.engine)
            if judge is None or str(r["id"]) == judge or r["url"] == judge]
    if judge is not None and not rows:
        from magpie.errors import MagpieError

        raise MagpieError(f"no judge {judge!r}")

    verdicts = asyncio.run(probe_all([SimpleNamespace(**r) for r in rows], state.settings)) if rows else []
    out, moved = [], 0
    with state.engine.begin() as conn:
        for r, (ok, reason, addrs) in zip(rows, verdicts):
            moved += record_health(conn, r["id"], ok, reason, addrs, state.settings.dns_ttl)
            out.append({"id": r["id"], "url": r["url"], "healthy": ok, "reason": reason, "addresses": addrs})
        rev = bump(conn) if moved else None
    if rev is not None:
        notify(state.redis, state.settings.redis_prefix, rev)
    if as_json:
        _emit(True, out)
    else:
        rows_table("judge probes", ("id", "url", "healthy", "reason", "addresses"),
                   [[o["id"], o["url"], o["healthy"], o["reason"], ",".join(o["addresses"] or [])] for o in out])
    if any(not o["healthy"] for o in out):
        raise SystemExit(1)


@click.group()
def profiles() -> None:
    """Show or change a workspace's check profile (protocols, timeout, attempts, judge pool, rule,
    auto-remove, and on the Redis schedule its check interval and dead-route policy)."""


def _show(as_json: bool, prof: dict) -> None:
    if as_json:
        _emit(True, prof)
        return
    rows_table(f"check profile of {prof['workspace']}" + ("" if prof["custom"] else " (defaults)"),
               ("field", "value"),
               [[k, ",".join(v) if isinstance(v, list) else ("default" if v is None else v)]
                for k, v in prof.items() if k not in ("workspace", "custom", "walk")])


class _Duration(click.ParamType):
    """``magpie.cli.queue.Duration`` (ms), imported when used so this module loads without the queue CLI."""

    name = "duration"

    def convert(self, value, param, ctx) -> int:
        from magpie.cli.queue import Duration

        return Duration().convert(value, param, ctx)


@profiles.command("show")
@click.argument("workspace")
@json_option
@pass_state
def profiles_show(state: CliState, workspace: str, as_json: bool) -> None:
    """Show WORKSPACE's check profile (fields at their default print as "default")."""
    from magpie.judges.store import get_profile

    _show(as_json, get_profile(state.engine, workspace))


@profiles.command("set")
@click.argument("workspace")
@click.option("--protocols", help=f"Comma-separated protocols to test each route as ({','.join(PROTOCOLS)}).")
@click.option("--timeout", type=float, help="Seconds per attempt (at most MAGPIE_PROFILE_MAX_TIMEOUT).")
@click.option("--attempts", type=int, help="Attempts per check (at most MAGPIE_PROFILE_MAX_ATTEMPTS).")
@click.option("--judge-pool", type=click.Choice(["global", "workspace"]), help="Judges to check through.")
@click.option("--rule", help="Valid answer: echo, status or contains:<text> (default: each judge's).")
@click.option("--auto-remove-after", type=int, help="Drop ownership after this many consecutive failures.")
@click.option("--interval", "interval_ms", type=_Duration(),
              help="Check interval of the workspace's routes (60s, 5m, 1h; Redis schedule only).")
@click.option("--dead-after", type=int,
              help="Dead-route policy: after this many dead checks in a row ... (Redis schedule only)")
@click.option("--dead-factor", type=int,
              help="... check every FACTOR x the interval until alive again (default 4).")
@click.option("--reset", "resets", multiple=True,
              type=click.Choice(["protocols", "timeout", "attempts", "judge_pool", "rule", "auto_remove_after",
                                 "check_interval", "dead_after", "dead_factor"]),
              help="Put a field back to its default (repeatable; dead_after resets the whole policy).")
@json_option
@pass_state
def profiles_set(state: CliState, workspace: str, protocols, timeout, attempts, judge_pool, rule,
                 auto_remove_after, interval_ms, dead_after, dead_factor, resets, as_json: bool) -> None:
    """Change WORKSPACE's check profile; prints the profile as it is now.

    A profile's interval and dead-route policy win over the workspace's own (`magpie workspaces
    set-interval`), field by field; a route's own interval (`magpie queue set-interval`) wins over both.
    Changing them moves the workspace's routes into the new interval (resumable: run the same command again
    after an interruption). Refused, with nothing changed, on the PostgreSQL schedule.

    \b
    Example:
      magpie profiles set acme --timeout 5 --attempts 1
      magpie profiles set acme --interval 60s --dead-after 3 --dead-factor 4
      magpie profiles set acme --reset check_interval --reset dead_after --json
    """
    from magpie.cli.progress import progress
    from magpie.judges.store import CADENCE_FIELDS, profile_bounds, profile_cadence_ms, set_profile, workspace_id

    changes = {k: v for k, v in (("protocols", protocols), ("timeout", timeout), ("attempts", attempts),
                                 ("judge_pool", judge_pool), ("rule", rule),
                                 ("auto_remove_after", auto_remove_after),
                                 ("check_interval", interval_ms / 1000 if interval_ms else None),
                                 ("dead_after", dead_after), ("dead_factor", dead_factor)) if v is not None}
    both = set(changes) & set(resets)
    if both:
        raise click.UsageError(f"--reset {sorted(both)[0]} and a new value for it at once")
    changes.update(dict.fromkeys(resets))
    cadence = bool(set(changes) & set(CADENCE_FIELDS))
    if cadence and not getattr(state.queue, "carries_cadence", False):
        state.queue.set_profile_cadence(0)  # the schedule's one-line refusal, before anything is written
    max_timeout, max_attempts = profile_bounds(state.settings)
    with user_errors(ValueError):
        prof = set_profile(state.engine, workspace, changes, max_timeout=max_timeout,
                           max_attempts=max_attempts, **_changed(state))
    if cadence:
        with state.engine.connect() as conn:
            wid = workspace_id(conn, workspace)
        with progress("walking routes") as update:
            walk = state.queue.set_profile_cadence(wid, **profile_cadence_ms(prof),
                                                   progress=lambda c: update(c["shard"], state.queue.shards))
        if as_json:
            prof = {**prof, "walk": walk}
        else:
            click.echo(f"workspace {workspace!r}: {walk['routes']} routes, {walk['moved']} moved into the new "
                       "interval")
    _show(as_json, prof)


COMMANDS: list = [judges, profiles]
