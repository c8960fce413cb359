"""The ``magpie`` command line (also ``python -m magpie``). Read commands take ``--json``.

Errors a user can fix (bad config value, unreadable file, unreachable service) exit with status 2 and
a one-line message naming what was wrong.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from magpie.cli_common import echo_json as _emit_json, load_settings_or_exit as _settings

console = Console()




def _storage_error(exc: Exception) -> str | None:
    """One line for an unreachable or unmigrated Redis / PostgreSQL, or None for other errors."""
    import redis
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, redis.RedisError):
        return f"Redis error (MAGPIE_REDIS_URL): {exc}"
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
        first = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        return f"cannot reach PostgreSQL (MAGPIE_DATABASE_URL): {first}"
    if isinstance(exc, sa_exc.ProgrammingError):
        first = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        return f"PostgreSQL schema missing or out of date (run `magpie db upgrade`): {first}"
    return None


class MagpieGroup(click.Group):
    """The top-level group: storage failures in any command become a one-line error, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.exceptions.ClickException:
            raise
        except Exception as exc:  # noqa: BLE001 - translated below or re-raised
            msg = _storage_error(exc)
            if msg is None:
                raise
            raise click.ClickException(msg) from None


@click.group(cls=MagpieGroup)
@click.version_option(package_name="magpie")
def main() -> None:
    """magpie: recurring health checks of HTTP/HTTPS/SOCKS4/SOCKS5 proxies on a Redis lease schedule."""


# -- db ---------------------------------------------------------------------------------------------
@main.group()
def db() -> None:
    """PostgreSQL schema (Alembic)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Create the database if missing and migrate it to --revision (default: head)."""
    from magpie.db.migrate import current_revision, ensure_database, upgrade

    url = _settings().database_url
    try:
        ensure_database(url)
        upgrade(url, revision)
    except Exception as exc:  # noqa: BLE001 - report any connection/migration failure plainly
        raise click.ClickException(f"database upgrade failed ({_safe_url(url)}): {exc}") from None
    click.echo(f"database at revision {current_revision(url)}")


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


# -- import -----------------------------------------------------------------------------------------
@main.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--workspace", "-w", required=True, help="Workspace that will own the routes.")
@click.option("--protocol", default="http", show_default=True,
              type=click.Choice(["http", "https", "socks4", "socks5"]), help="For lines with no scheme.")
@click.option("--dry-run", is_flag=True, help="Parse and report without storing anything.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def import_cmd(file: str, workspace: str, protocol: str, dry_run: bool, as_json: bool) -> None:
    """Import the proxy list FILE into a workspace and schedule its routes."""
    from magpie.importer.service import import_file

    settings = _settings()
    progress_cb = None
    prog = None
    if not as_json and sys.stdout.isatty():
        from rich.progress import Progress

        prog = Progress(console=console, transient=True)
        task = prog.add_task("importing", total=None)
        prog.start()

        def progress_cb(done, total):
            prog.update(task, completed=done, total=total)

    try:
        report = import_file(file, workspace, settings, protocol=protocol, dry_run=dry_run, progress=progress_cb)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - storage down: re-running the import completes it
        raise click.ClickException(f"import failed: {exc.__class__.__name__}: {exc}") from None
    finally:
        if prog:
            prog.stop()
    if as_json:
        _emit_json(report.as_json())
        return
    verb = "would import" if dry_run else "imported"
    click.echo(f"{verb} {report.imported if not dry_run else report.valid} routes into '{workspace}': "
               f"valid={report.valid} duplicates={report.duplicates} skipped={report.skipped} "
               f"invalid={len(report.invalid)}")
    for bad in report.invalid[:50]:
        click.echo(f"  line {bad['line']}: {bad['reason']}", err=True)
    if len(report.invalid) > 50:
        click.echo(f"  ... and {len(report.invalid) - 50} more (use --json for all)", err=True)


# -- status / routes --------------------------------------------------------------------------------
def _fmt_ms(ms):
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%H:%M:%S")


@main.command()
@click.option("--json", "as_json", is_flag=True)
def status(as_json: bool) -> None:
    """Per-shard schedule state: scheduled, leased, due now, next due, oldest lateness (s)."""
    from magpie.queue import RouteQueue

    settings = _settings()
    try:
        st = RouteQueue.from_settings(settings).status()
    except Exception as exc:  # noqa: BLE001
        raise click.ClickException(f"cannot read the schedule from Redis: {exc}") from None
    if as_json:
        _emit_json(st)
        return
    t = Table(title="route schedule")
    for col in ("shard", "scheduled", "leased", "expired leases", "due now", "next due (UTC)", "lateness s"):
        t.add_column(col, justify="right" if col != "shard" else "left")
    for s in st["shards"]:
        t.add_row(s["shard"].rsplit(":", 1)[-1], str(s["scheduled"]), str(s["leased"]), str(s["expired_leases"]),
                  str(s["due_now"]), _fmt_ms(s["next_due_ms"]), f"{s['oldest_lateness_s']:.1f}")
    tot = st["totals"]
    t.add_row("all", str(tot["scheduled"]), str(tot["leased"]), str(tot["expired_leases"]), str(tot["due_now"]),
              _fmt_ms(tot["next_due_ms"]), f"{tot['oldest_lateness_s']:.1f}", style="bold")
    console.print(t)


def health_table(rows, title="route health") -> Table:
    """Rich table of :func:`magpie.db.repo.latest_health` rows."""
    t = Table(title=title)
    for col in ("route", "protocol", "alive", "latency ms", "anonymity", "status", "checks", "last checked"):
        t.add_column(col)
    for r in rows:
        alive = {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[r["alive"]]
        user = f"{r['username']}@" if r.get("username") else ""
        host = f"[{r['host']}]" if ":" in r["host"] else r["host"]
        t.add_row(Text(f"{user}{host}:{r['port']}"), r["protocol"], alive,
                  f"{r['latency_ms']:.0f}" if r["latency_ms"] is not None else "-",
                  Text(r["anonymity"] or "-"), Text(str(r["status"] or r.get("error") or "-")),
                  str(r["checks_total"] or 0),
                  r["last_checked_at"].strftime("%H:%M:%S") if r["last_checked_at"] else "-")
    return t


@main.command()
@click.option("--workspace", "-w", default=None, help="Only this workspace's routes.")
@click.option("--json", "as_json", is_flag=True)
def routes(workspace: str | None, as_json: bool) -> None:
    """Latest health of each route (from PostgreSQL)."""
    from magpie.crypto import get_keyring
    from magpie.db.repo import latest_health
    from magpie.db.session import get_engine

    s = _settings()
    try:
        rows = latest_health(get_engine(s.database_url), workspace, keyring=get_keyring(s.encryption_key))
    except Exception as exc:  # noqa: BLE001
        raise click.ClickException(f"cannot read route health from PostgreSQL: {exc}") from None
    if as_json:
        _emit_json(rows)
        return
    console.print(health_table(rows))


# -- queue control plane -----------------------------------------------------------------------------
def _queue():
    from magpie.queue import RouteQueue

    return RouteQueue.from_settings(_settings())


def _run_queue(as_json: bool, fn):
    """Run ``fn()``; print its result; typed queue refusals exit with status 3 and name the code."""
    from magpie.queue import QueueError

    try:
        result = fn()
    except click.ClickException:
        raise
    except QueueError as exc:
        if as_json:
            _emit_json({"ok": False, "refused": exc.code, "member": exc.member or None})
        else:
            click.echo(f"refused: {exc.code}" + (f" (route {exc.member})" if exc.member else ""), err=True)
        raise click.exceptions.Exit(3) from None
    except Exception as exc:  # noqa: BLE001 - Redis unreachable and the like
        raise click.ClickException(f"queue operation failed: {exc.__class__.__name__}: {exc}") from None
    if as_json:
        _emit_json({"ok": True, "result": result})
    else:
        click.echo(result if isinstance(result, str) else json.dumps(result, indent=2, default=str))
    return result


def _known(info: dict) -> dict:
    """``info`` from :meth:`RouteQueue.inspect`; a route the schedule does not know is a ``gone`` refusal."""
    from magpie.queue import QueueError

    if info["state"] == "gone" and info["payload"] is None:
        raise QueueError("gone", info["member"])
    return info


@main.group()
def queue() -> None:
    """Operate the route schedule: pause/resume, drain, obliterate, dead letters and per-route verbs.

    Refusals exit with status 3 and a typed code: not_paused, active_leases, lease_lost, gone, leased,
    dead, not_dead.
    """


json_opt = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


@queue.command("pause")
@json_opt
def queue_pause(as_json):
    """Stop all claiming (checked inside pop: nothing is claimed once this returns)."""
    _run_queue(as_json, lambda: (_queue().pause(), "paused")[1])


@queue.command("resume")
@json_opt
def queue_resume(as_json):
    """Resume claiming."""
    _run_queue(as_json, lambda: (_queue().resume(), "resumed")[1])


@queue.command("drain")
@json_opt
def queue_drain(as_json):
    """Unschedule and delete every due or waiting route; leased routes are spared."""
    _run_queue(as_json, lambda: _queue().drain())


@queue.command("obliterate")
@click.option("--force", is_flag=True, help="Proceed even while leases are live.")
@click.option("--batch", default=1000, show_default=True, help="Routes deleted per script call.")
@json_opt
def queue_obliterate(force, batch, as_json):
    """Delete the whole schedule keyspace in bounded batches (the queue must be paused)."""

    def run():
        q = _queue()
        total = 0
        while True:
            status, n = q.obliterate(force=force, batch=batch)
            total += n
            if status == "done":
                return {"status": "done", "deleted_routes": total}

    _run_queue(as_json, run)


@queue.command("inspect")
@click.argument("route_hash")
@json_opt
def queue_inspect(route_hash, as_json):
    """Payload, score, state, stall count, retries, progress and recent logs of one route."""
    _run_queue(as_json, lambda: _known(_queue().inspect(route_hash)))


@queue.command("update")
@click.argument("route_hash")
@click.argument("payload")
@json_opt
def queue_update(route_hash, payload, as_json):
    """Replace a route's stored payload (JSON text in the payload format, see magpie/queue/payload.py).

    The payload is validated and stored in its canonical compact form. Changing host, port, protocol or
    credentials here does not change the route hash: re-import the route instead."""
    from magpie.queue import Payload, PayloadError

    try:
        decoded = Payload.decode(payload)  # refuse malformed input before it reaches Redis
    except PayloadError as exc:
        raise click.ClickException(f"payload rejected: {exc}") from None
    if decoded.route_hash != route_hash:
        raise click.ClickException(f"payload rejected: its route hash 'k' ({decoded.route_hash}) is not {route_hash}")
    if not decoded.workspaces:
        raise click.ClickException("payload rejected: 'w' must name at least one workspace")
    canonical = decoded.encode()  # the compact form the scripts merge workspaces into
    _run_queue(as_json, lambda: (_queue().update(route_hash, canonical), "updated")[1])


@queue.command("remove")
@click.argument("route_hash")
@click.option("--force", is_flag=True, help="Remove even under a live lease.")
@json_opt
def queue_remove(route_hash, force, as_json):
    """Remove one route from the schedule (refused under a live lease unless --force)."""
    _run_queue(as_json, lambda: (_queue().remove_route(route_hash, force=force), "removed")[1])


@queue.command("logs")
@click.argument("route_hash")
@json_opt
def queue_logs(route_hash, as_json):
    """Recent log lines a check wrote for one route."""
    _run_queue(as_json, lambda: _known(_queue().inspect(route_hash))["logs"])


@queue.command("progress")
@click.argument("route_hash")
@json_opt
def queue_progress(route_hash, as_json):
    """Latest progress a check recorded for one route."""
    _run_queue(as_json, lambda: _known(_queue().inspect(route_hash))["progress"])


@queue.command("dead")
@click.option("--limit", default=100, show_default=True)
@json_opt
def queue_dead(limit, as_json):
    """List dead-lettered routes with their reason."""
    _run_queue(as_json, lambda: _queue().dead_letters(limit))


@queue.command("reprocess")
@click.argument("route_hash")
@json_opt
def queue_reprocess(route_hash, as_json):
    """Put a dead-lettered route back, due now, with its stall count reset."""
    _run_queue(as_json, lambda: {"due_ms": _queue().reprocess(route_hash)})


@queue.command("check-now")
@click.argument("route_hash")
@click.option("--in", "delay", default=0.0, show_default=True, type=click.FloatRange(0, 365 * 86400),
              help="Delay in seconds (0 to one year).")
@json_opt
def queue_check_now(route_hash, delay, as_json):
    """Check one route now (or after --in seconds) without a second copy or losing its cadence."""
    _run_queue(as_json, lambda: {"due_ms": _queue().enqueue_in(route_hash, int(delay * 1000))})


@queue.command("respread")
@json_opt
def queue_respread(as_json):
    """Re-spread every unleased route evenly across MAGPIE_CHECK_INTERVAL (under a leader lock)."""
    from magpie.leader import LeaderLock

    def run():
        q = _queue()
        with LeaderLock(q.r, _settings().redis_prefix, "respread", ttl_ms=60_000).hold() as lost:
            if lost is None:
                return {"skipped": "another respread holds the leader lock"}
            return q.respread()

    _run_queue(as_json, run)


@queue.command("rebuild")
@json_opt
def queue_rebuild(as_json):
    """Schedule every route PostgreSQL has again (after Redis lost data), spread across the interval;
    routes still scheduled keep their due time (under the ``rebuild`` leader lock)."""
    from magpie.maintenance.rebuild import rebuild_schedule

    _run_queue(as_json, lambda: rebuild_schedule(_settings()))


# -- one-shot check, judge, lab ---------------------------------------------------------------------
@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--protocol", default="http", show_default=True,
              type=click.Choice(["http", "https", "socks4", "socks5"]))
@click.option("--judge", "judge_url", default=None, help="Judge URL (default MAGPIE_JUDGE_URL).")
@click.option("--timeout", default=None, type=click.FloatRange(0, 600, min_open=True),
              help="Hard deadline of one attempt, seconds (default MAGPIE_CHECK_TIMEOUT).")
@click.option("--attempts", default=None, type=click.IntRange(1, 10),
              help="Attempts per route (default MAGPIE_CHECK_ATTEMPTS).")
@click.option("--concurrency", default=None, type=click.IntRange(1, 1_000_000),
              help="Checks in flight at once (default MAGPIE_CHECKS_PER_PROCESS, capped by the fd limit).")
@click.option("--json", "as_json", is_flag=True)
def check(file, protocol, judge_url, timeout, attempts, concurrency, as_json) -> None:
    """Check every route of FILE once, now, with no Redis or PostgreSQL.

    Exits 1 when the judge itself does not answer a direct request (no route is blamed then)."""
    from urllib.parse import urlsplit

    from magpie.checker import Checker, checks_within_fd_limit
    from magpie.importer.parse import parse_file

    s = _settings()
    judge_url = judge_url or s.judge_url
    if urlsplit(judge_url).scheme not in ("http", "https") or not urlsplit(judge_url).hostname:
        raise click.BadParameter(f"not an http(s) URL: {judge_url!r}", param_hint="--judge")
    parsed = parse_file(file, default_protocol=protocol)
    for bad in parsed.invalid[:50]:
        click.echo(f"  line {bad.line}: {bad.reason}", err=True)
    timeout = timeout or s.check_timeout
    checker = Checker(judge_url, timeout=timeout, attempts=attempts or s.check_attempts, body_cap=s.body_cap,
                      connect_timeout=min(s.connect_timeout, timeout))
    try:
        if checker.learn_own_address() is None:
            click.echo(f"error: judge {checker.judge_url} does not answer a direct request with an echo; "
                       "fix --judge (or MAGPIE_JUDGE_URL) before checking routes", err=True)
            sys.exit(1)
        width = checks_within_fd_limit(concurrency or s.checks_per_process,
                                       setting="--concurrency" if concurrency else "MAGPIE_CHECKS_PER_PROCESS")
        if not as_json and sys.stderr.isatty() and parsed.routes:
            from rich.progress import Progress

            with Progress(console=Console(stderr=True), transient=True) as bar:
                task = bar.add_task("checking", total=len(parsed.routes))
                results = checker.check_many(parsed.routes, width,
                                             on_result=lambda _i, _r: bar.advance(task))
        else:
            results = checker.check_many(parsed.routes, width)
    finally:
        checker.close()
    rows = []
    for route, res in zip(parsed.routes, results):
        rows.append({"route": route.display(), "protocol": route.protocol, "alive": res.alive,
                     "latency_ms": res.latency_ms, "status": res.status, "attempts": res.attempts,
                     "error": res.error, "anonymity": res.anonymity})
    if as_json:
        _emit_json({"results": rows, "invalid": [{"line": x.line, "reason": x.reason} for x in parsed.invalid]})
        return
    t = Table(title=f"one-shot check ({len(rows)} routes, {sum(r['alive'] for r in rows)} alive)")
    for col in ("route", "alive", "latency ms", "anonymity", "error"):
        t.add_column(col)
    for r in rows:
        t.add_row(Text(r["route"]), "[green]yes[/]" if r["alive"] else "[red]no[/]",
                  f"{r['latency_ms']:.0f}" if r["latency_ms"] is not None else "-", r["anonymity"] or "-",
                  Text(r["error"] or ""))
    console.print(t)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8899, show_default=True)
def judge(host: str, port: int) -> None:
    """Serve a judge: an echo endpoint returning the request's headers and remote address as JSON."""
    from magpie.checker.judge import run_judge

    click.echo(f"judge listening on http://{host}:{port}/")
    run_judge(host, port)


@main.command()
@click.option("--base-port", default=18080, show_default=True, type=click.IntRange(1024, 65527),
              help="First proxy port (8 ports are used).")
@click.option("--judge-port", default=8899, show_default=True, type=click.IntRange(0, 65535),
              help="Judge port on 127.0.0.1 (0: any free port).")
@click.option("--slow-delay", default=3.0, show_default=True, type=click.FloatRange(0, 60),
              help="Seconds the slow proxy waits before forwarding.")
@click.option("--list-file", default=None, type=click.Path(dir_okay=False), help="Also write the proxy list here.")
@click.option("--faults", is_flag=True,
              help="Also start the fault servers (tarpit, trickle, slow, echo, refused) on 127.0.0.20-24.")
def lab(base_port, judge_port, slow_delay, list_file, faults) -> None:
    """Start the local lab (a judge and real proxy servers on 127.0.0.x) and run until stopped."""
    from magpie.lab.lab import main as lab_main

    argv = ["--base-port", str(base_port), "--judge-port", str(judge_port), "--slow-delay", str(slow_delay)]
    if list_file:
        argv += ["--list-file", list_file]
    if faults:
        argv += ["--faults"]
    sys.exit(lab_main(argv) or 0)


def _register_plugins() -> None:
    """Command groups owned by background-job packages (each module exposes ``register(main)``)."""
    import importlib

    for name in ("magpie.maintenance.cli", "magpie.alerts.cli"):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue
            raise
        mod.register(main)


_register_plugins()

if __name__ == "__main__":  # pragma: no cover
    main()
