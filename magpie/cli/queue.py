"""``magpie queue ...``: the schedule's control plane (pause, drain, obliterate, dead letters, route verbs).

Every verb prints its result (with ``--json`` as ``{"ok": true, "result": ...}``); a refusal of the
schedule reaches the root handler, which exits 3 with its code (:mod:`magpie.cli`).
"""

from __future__ import annotations

import json
import re

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json
from magpie.cli.queue_lease import register as register_lease_verbs
from magpie.errors import MagpieError, Refusal, RefusedError
from magpie.base.redact import mask_route_info as _masked


def _emit(as_json: bool, result) -> None:
    """Print a verb's ``result``: one JSON object with ``--json``, else the text or indented JSON."""
    if as_json:
        echo_json({"ok": True, "result": result})
    else:
        click.echo(result if isinstance(result, str) else json.dumps(result, indent=2, default=str))


def _known(info: dict) -> dict:
    """``info`` from :meth:`RouteQueue.inspect`; a route the schedule does not know is a ``gone`` refusal."""
    if info["state"] == "gone" and info["payload"] is None:
        raise RefusedError(Refusal.GONE, info["member"])
    return info


def _route_hash(_ctx, _param, value: str) -> str:
    """A route hash argument: 24 lower-case hex characters (as ``magpie routes`` prints them)."""
    v = (value or "").strip().lower()
    if not re.fullmatch(r"[0-9a-f]{24}", v):
        raise click.BadParameter(f"expected a route hash of 24 hex characters, got {value!r}")
    return v


@click.group()
def queue() -> None:
    """Operate the route schedule: pause/resume, drain, obliterate, dead letters and per-route verbs.

    Refusals exit with status 3 and a typed code: not_paused, active_leases, lease_lost, gone, leased,
    dead, not_dead, layout_mismatch; ``claim`` exits 3 (empty) when nothing is claimable.
    """


_partition = click.option("--partition", type=click.IntRange(min=0), default=None, metavar="K",
                          help="Only partition number K (MAGPIE_SCHEDULE_PARTITIONS > 1; default: all).")


def _per_partition(state: CliState, verb: str, partition: int | None) -> None:
    q = state.queue
    if partition is None:
        getattr(q, verb)()
    elif hasattr(q, "parts"):
        try:
            getattr(q, verb)(partition)
        except ValueError as exc:
            raise click.BadParameter(str(exc).removeprefix("--partition "), param_hint="--partition") from None
    elif partition == 0:
        getattr(q, verb)()
    else:
        raise click.BadParameter(f"the schedule has one partition (0), got {partition}", param_hint="--partition")


@queue.command("pause")
@_partition
@json_option
@pass_state
def queue_pause(state: CliState, partition: int | None, as_json: bool) -> None:
    """Stop all claiming (checked inside pop: nothing is claimed once this returns), or only partition K's."""
    _per_partition(state, "pause", partition)
    _emit(as_json, "paused" if partition is None else f"paused partition {partition}")


@queue.command("resume")
@_partition
@json_option
@pass_state
def queue_resume(state: CliState, partition: int | None, as_json: bool) -> None:
    """Resume claiming (everywhere, or only in partition K)."""
    _per_partition(state, "resume", partition)
    _emit(as_json, "resumed" if partition is None else f"resumed partition {partition}")


@queue.command("repartition")
@click.option("--to", "to", required=True, type=click.IntRange(1, 1024), metavar="N",
              help="The new partition count (then run every process with MAGPIE_SCHEDULE_PARTITIONS=N).")
@click.option("--batch", default=500, show_default=True, type=click.IntRange(1, 10_000),
              help="Routes per ZSCAN step (progress is recorded after each).")
@click.option("--max-passes", default=1000, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Passes at most (a pass revisits routes that were under a live lease).")
@json_option
@pass_state
def queue_repartition(state: CliState, to: int, batch: int, max_passes: int, as_json: bool) -> None:
    """Move every route to its partition among N (resumable: rerun it to continue; fenced: a route under a
    live lease moves after its lease ends). Processes of the old count are refused from the start; restart
    them with MAGPIE_SCHEDULE_PARTITIONS=N (they claim from both layouts until the run ends).

    \b
    Example:
      magpie queue repartition --to 4 --json
    """
    import sys

    from magpie.queue.repartition import Repartitioner

    s = state.settings
    rep = Repartitioner(state.redis, s.redis_prefix, s.queue_shards, to, batch=batch)
    live = not as_json and sys.stderr.isatty()

    def progress(st: dict) -> None:
        line = (f"pass {st.get('passes', 0) + 1}: partition {st.get('src', 0)} shard {st.get('shard', 0)}  "
                f"moved {st.get('moved', 0)}  leased {st.get('leased_skipped', 0)}  "
                f"remaining {st.get('remaining', 0)}")
        if as_json:
            return
        click.echo(("\r" + line) if live else line, err=True, nl=not live)

    try:
        out = rep.run(progress, max_passes=max_passes)
    finally:
        if live:
            click.echo("", err=True)
    result = {k: out.get(k) for k in ("done", "from", "to", "moved", "leased_skipped", "conflicts", "passes")}
    if as_json:
        _emit(True, result)
        return
    if out.get("done"):
        click.echo(f"repartitioned to {to} partitions: moved {out.get('moved', 0)} routes"
                   f" in {out.get('passes', 0) + 1} pass(es); set MAGPIE_SCHEDULE_PARTITIONS={to}")
    else:
        click.echo(f"repartition to {to} not finished (moved {out.get('moved', 0)}): run it again", err=True)


@queue.command("drain")
@json_option
@pass_state
def queue_drain(state: CliState, as_json: bool) -> None:
    """Unschedule and delete every due or waiting route; leased routes are spared. Shows progress on a
    terminal.

    \b
    Example:
      magpie queue pause && magpie queue drain --json
    """
    from magpie.cli.progress import progress

    with progress("draining") as update:
        result = state.queue.drain(progress=update)
    _emit(as_json, result)


@queue.command("obliterate")
@click.option("--force", is_flag=True, help="Proceed even while leases are live.")
@click.option("--batch", default=1000, show_default=True, type=click.IntRange(1, 100_000),
              help="Routes deleted per script call.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed when stdin is not a terminal).")
@json_option
@pass_state
def queue_obliterate(state: CliState, force: bool, batch: int, yes: bool, as_json: bool) -> None:
    """Delete the whole schedule keyspace in bounded batches (the queue must be paused).

    Asks for confirmation on a terminal; elsewhere --yes is required. Shows progress on a terminal.

    \b
    Example:
      magpie queue pause
      magpie queue obliterate --yes --json
    """
    from magpie.cli.progress import confirm_destructive, progress

    totals = state.queue.status()["totals"]
    if not state.queue.is_paused():  # refused before asking: nothing would be deleted
        raise RefusedError(Refusal.NOT_PAUSED)
    routes = int(totals.get("scheduled", 0)) + int(totals.get("dead", 0) or 0)
    confirm_destructive(f"delete the whole schedule ({routes} routes)", yes)
    total = 0
    with progress("obliterating") as update:
        while True:
            status, n = state.queue.obliterate(force=force, batch=batch)
            total += n
            update(total, max(routes, total))
            if status == "done":
                break
    _emit(as_json, {"status": "done", "deleted_routes": total})


@queue.command("inspect")
@click.argument("route_hash", callback=_route_hash)
@json_option
@pass_state
def queue_inspect(state: CliState, route_hash: str, as_json: bool) -> None:
    """Payload, score, state, stall count, retries, progress and recent logs of one route (the password
    masked)."""
    from magpie.queue.payload import payload_revision

    info = _masked(_known(state.queue.inspect(route_hash)))
    info["payload_revision"] = payload_revision(state.queue.payload(route_hash))
    _emit(as_json, info)


@queue.command("update")
@click.argument("route_hash", callback=_route_hash)
@click.argument("payload")
@click.option("--expected-revision", required=True, metavar="REV",
              help="The payload_revision `magpie queue inspect` printed; refused if the payload changed since.")
@click.option("--force", is_flag=True, help="Update even under a live lease.")
@json_option
@pass_state
def queue_update(state: CliState, route_hash: str, payload: str, expected_revision: str, force: bool,
                 as_json: bool) -> None:
    """Replace a route's stored payload (JSON text in the payload format, see magpie/queue/payload.py).

    The payload is validated and stored in its canonical compact form. The update is fenced: refused
    (payload_changed, exit 3) when the stored payload is no longer the revision you read, and
    (active_leases) under a live lease unless --force. Changing host, port, protocol or credentials here
    does not change the route hash: re-import the route instead.

    \b
    Example:
      magpie queue inspect 0123456789abcdef01234567      # note payload_revision
      magpie queue update 0123456789abcdef01234567 '{"v":1,...}' --expected-revision 3f2a9c0d1e4b5a6f"""
    from magpie.queue import Payload, PayloadError
    from magpie.queue.payload import payload_revision, read_cipher, write_cipher

    try:  # refuse malformed input before it reaches Redis; sealed credentials ('c', v 2) are opened
        decoded = Payload.decode(payload, read_cipher(state.settings))
    except PayloadError as exc:
        raise MagpieError(f"payload rejected: {exc}") from None
    if decoded.route_hash != route_hash:
        raise MagpieError(f"payload rejected: its route hash 'k' ({decoded.route_hash}) is not {route_hash}")
    if not decoded.workspaces:
        raise MagpieError("payload rejected: 'w' must name at least one workspace")
    current = state.queue.payload(route_hash)
    if current is None:
        raise RefusedError(Refusal.GONE, route_hash)
    if payload_revision(current) != expected_revision.strip().lower():
        raise RefusedError(Refusal.PAYLOAD_CHANGED, route_hash)
    # the compact form the scripts merge workspaces into; PROXY_QUEUE_ENCRYPT_CREDENTIALS seals credentials;
    # the script compares `current` with the stored text again, atomically with the write
    state.queue.update(route_hash, decoded.encode(write_cipher(state.settings)), current, force=force)
    _emit(as_json, "updated")


@queue.command("migrate-payloads")
@click.option("--encrypt/--decrypt", "encrypt", default=None,
              help="Seal the credentials of every payload, or write them back in plaintext.")
@click.option("--batch", default=500, show_default=True, type=click.IntRange(1, 10_000),
              help="Payload keys per SCAN step and per script call.")
@json_option
@pass_state
def queue_migrate_payloads(state: CliState, encrypt: bool | None, batch: int, as_json: bool) -> None:
    """Rewrite stored payloads with credentials encrypted (--encrypt) or in plaintext (--decrypt).

    Resumable: run it again to finish (payloads already in the wanted form are skipped); a payload under a
    live lease or changed by a concurrent import is left for the next run (counted as deferred)."""
    import sys

    from magpie.queue.payload import read_cipher

    if encrypt is None:
        raise click.UsageError("give --encrypt or --decrypt")
    if encrypt != state.settings.encrypt_queue_credentials:
        click.echo(f"warning: PROXY_QUEUE_ENCRYPT_CREDENTIALS is {'off' if encrypt else 'on'}: new payloads "
                   f"are still written {'in plaintext' if encrypt else 'encrypted'}", err=True)
    live = not as_json and sys.stderr.isatty()

    def progress(c: dict) -> None:
        click.echo(f"\rscanned {c['scanned']}  changed {c['changed']}  skipped {c['skipped']}", err=True,
                   nl=False)

    try:
        counts = state.queue.migrate_payloads(read_cipher(state.settings), encrypt=encrypt, batch=batch,
                                              progress=progress if live else None)
    finally:
        if live:
            click.echo("", err=True)
    if as_json:
        _emit(True, counts)
        return
    click.echo(f"{'encrypted' if encrypt else 'decrypted'} {counts['changed']} payloads: "
               + " ".join(f"{k}={v}" for k, v in counts.items()))
    if counts["deferred"]:
        click.echo(f"{counts['deferred']} payloads are leased or changing now: run the command again",
                   err=True)


@queue.command("remove")
@click.argument("route_hash", callback=_route_hash)
@click.option("--force", is_flag=True, help="Remove even under a live lease.")
@json_option
@pass_state
def queue_remove(state: CliState, route_hash: str, force: bool, as_json: bool) -> None:
    """Remove one route from the schedule (refused under a live lease unless --force)."""
    state.queue.remove_route(route_hash, force=force)
    _emit(as_json, "removed")


@queue.command("logs")
@click.argument("route_hash", callback=_route_hash)
@json_option
@pass_state
def queue_logs(state: CliState, route_hash: str, as_json: bool) -> None:
    """Recent log lines a check wrote for one route."""
    _emit(as_json, _masked(_known(state.queue.inspect(route_hash)))["logs"])


@queue.command("progress")
@click.argument("route_hash", callback=_route_hash)
@json_option
@pass_state
def queue_progress(state: CliState, route_hash: str, as_json: bool) -> None:
    """Latest progress a check recorded for one route."""
    _emit(as_json, _masked(_known(state.queue.inspect(route_hash)))["progress"])


@queue.command("dead")
@click.option("--limit", default=100, show_default=True)
@json_option
@pass_state
def queue_dead(state: CliState, limit: int, as_json: bool) -> None:
    """List dead-lettered routes with their reason."""
    _emit(as_json, state.queue.dead_letters(limit))


@queue.command("reprocess")
@click.argument("route_hash", callback=_route_hash)
@json_option
@pass_state
def queue_reprocess(state: CliState, route_hash: str, as_json: bool) -> None:
    """Put a dead-lettered route back, due now, with its stall count reset."""
    _emit(as_json, {"due_ms": state.queue.reprocess(route_hash)})


@queue.command("check-now")
@click.argument("route_hash", callback=_route_hash)
@click.option("--in", "delay", default=0.0, show_default=True, type=click.FloatRange(0, 365 * 86400),
              help="Delay in seconds (0 to one year).")
@json_option
@pass_state
def queue_check_now(state: CliState, route_hash: str, delay: float, as_json: bool) -> None:
    """Check one route now (or after --in seconds) without a second copy or losing its cadence."""
    _emit(as_json, {"due_ms": state.queue.enqueue_in(route_hash, int(delay * 1000))})


@queue.command("respread")
@json_option
@pass_state
def queue_respread(state: CliState, as_json: bool) -> None:
    """Re-spread every unleased route evenly across MAGPIE_CHECK_INTERVAL, in bounded batches (under a
    leader lock), and record it as the schedule's interval. Shows progress on a terminal.

    \b
    Example:
      MAGPIE_CHECK_INTERVAL=600 magpie queue respread --json
    """
    from magpie.cli.progress import progress
    from magpie.coordination.leader import LeaderLock
    from magpie.maintenance.interval import LOCK, respread_now

    q = state.queue
    with LeaderLock(q.redis, state.settings.redis_prefix, LOCK, ttl_ms=60_000).hold() as lost, \
            progress("respreading") as update:
        result = ({"skipped": "another respread holds the leader lock"} if lost is None
                  else respread_now(q, batch=state.settings.respread_batch, progress=update))
    _emit(as_json, result)


@queue.command("interval")
@json_option
@pass_state
def queue_interval(state: CliState, as_json: bool) -> None:
    """The configured and stored (effective) check interval, and a running respread's progress."""
    from magpie.maintenance.interval import read_interval_state

    st = read_interval_state(state.queue)
    if as_json:
        _emit(True, st)
        return
    eff = "unknown (recorded by the interval_respread job)" if st["effective_ms"] is None \
        else f"{st['effective_ms'] / 1000:g} s"
    lines = [f"configured: {st['configured_ms'] / 1000:g} s (MAGPIE_CHECK_INTERVAL)", f"effective: {eff}"]
    run = st["running"]
    if run:
        lines.append(f"respreading to {run['target_ms'] / 1000:g} s: shard {min(run['shard'], run['shards'])}/"
                     f"{run['shards']}, {run['placed']}/{run['total']} routes ({run['percent']:g} %), "
                     f"{run['moved']} moved, {run['leased']} leased")
    elif st["last"]:
        lines.append(f"last respread: {st['last']['moved']} routes moved to {st['last']['to_ms'] / 1000:g} s")
    lines.append(f"respreads: {st['respreads']}; converged: {'yes' if st['converged'] else 'no'}")
    _emit(False, "\n".join(lines))


@queue.command("rebuild")
@json_option
@pass_state
def queue_rebuild(state: CliState, as_json: bool) -> None:
    """Schedule every route PostgreSQL has again (after Redis lost data), spread across the interval;
    routes still scheduled keep their due time (under the ``rebuild`` leader lock). Shows progress on a
    terminal.

    \b
    Example:
      magpie queue rebuild --json
    """
    from magpie.cli.progress import progress
    from magpie.maintenance.rebuild import rebuild_schedule

    with progress("rebuilding") as update:
        result = rebuild_schedule(state.settings, engine=state.engine, queue=state.queue, progress=update)
    _emit(as_json, result)


register_lease_verbs(queue)  # claim, heartbeat, complete, in-flight (magpie.cli.queue_lease)
COMMANDS = [queue]


class Duration(click.ParamType):
    """A duration: ``60s``, ``5m``, ``1h``, ``1500ms`` or plain seconds (``90``); converted to ms (at least 1 s)."""

    name = "duration"
    _UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", str(value))
        if not m:
            self.fail(f"expected a duration like 60s, 5m or 1h, got {value!r}", param, ctx)
        ms = int(float(m.group(1)) * self._UNITS[m.group(2) or "s"])
        if not 1000 <= ms <= 30 * 86_400_000:
            self.fail(f"a duration must be within 1s..30d, got {value!r}", param, ctx)
        return ms


@queue.command("set-interval")
@click.argument("route_hash", callback=_route_hash)
@click.argument("interval", type=Duration(), required=False)
@click.option("--clear", is_flag=True, help="Drop the route's own interval (back to its workspaces' or the global).")
@json_option
@pass_state
def queue_set_interval(state: CliState, route_hash: str, interval: int | None, clear: bool, as_json: bool) -> None:
    """Give one route its own check interval (or --clear it). Its next due moves into the new interval when
    it is due later; a running check's completion applies it. Redis schedule only.

    \b
    Example:
      magpie queue set-interval 0123456789abcdef01234567 60s
      magpie queue set-interval 0123456789abcdef01234567 --clear --json
    """
    if clear == (interval is not None):
        raise click.UsageError("give either INTERVAL (e.g. 60s) or --clear")
    _emit(as_json, state.queue.set_route_interval(route_hash, None if clear else interval))
