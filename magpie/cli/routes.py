"""``magpie import``, ``status`` and ``routes``: load routes, read the schedule and route health."""

from __future__ import annotations

import sys
from datetime import datetime, timezone

import click

from magpie.base.protocols import PROTOCOLS
from magpie.cli.context import CliState, json_option, pass_state, user_errors
from magpie.cli.output import echo_json, print_table

PROTOCOL_CHOICE = click.Choice(PROTOCOLS)


FORMAT_CHOICE = click.Choice(["auto", "ip:port:user:pass", "ip:port:country:anonymity"])


@click.command("import")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--workspace", "-w", required=True, help="Workspace that will own the routes.")
@click.option("--protocol", default="http", show_default=True, type=PROTOCOL_CHOICE,
              help="For lines with no scheme.")
@click.option("--format", "fmt", default="auto", show_default=True, type=FORMAT_CHOICE,
              help="What the two fields of host:port:a:b are; auto refuses such a line when a field looks "
                   "like a country or anonymity code.")
@click.option("--dry-run", is_flag=True, help="Parse and report without storing anything.")
@json_option
@pass_state
def import_cmd(state: CliState, file: str, workspace: str, protocol: str, fmt: str, dry_run: bool,
               as_json: bool) -> None:
    """Import the proxy list FILE ('-' for standard input) into a workspace and schedule its routes.

    Reads plain lists (host:port, user:pass@host:port, host:port:user:pass, URLs, annotated lines),
    CSV and TSV with a header row, and JSON lines. Malformed lines, routes the egress guard refuses
    (private, loopback... addresses: see MAGPIE_CHECK_ALLOW_PRIVATE) and listed routes a workspace's
    blacklist policy keeps out are reported with their line numbers and not stored.
    """
    import os

    from magpie.errors import MagpieError
    from magpie.importer.service import ImportIncomplete, import_file, require_schema

    if file == "-":
        source = click.open_file("-", "rb")  # binary standard input, left open
    elif not os.path.isfile(file):
        raise MagpieError(f"cannot read {file!r}: no such file")
    else:
        source = file
    if not dry_run:
        from magpie.db.session import get_engine

        require_schema(get_engine(state.settings.database_url))  # one line naming `magpie db upgrade`
    progress_cb = None
    prog = None
    if not as_json and sys.stdout.isatty():
        from rich.console import Console
        from rich.progress import Progress

        prog = Progress(console=Console(), transient=True)
        task = prog.add_task("importing", total=None)
        prog.start()

        def progress_cb(done, total):
            prog.update(task, completed=done, total=total)

    incomplete = None
    try:
        with user_errors(ValueError, OSError):  # an empty workspace name, an unreadable file
            report = import_file(source, workspace, state.settings, protocol=protocol, dry_run=dry_run,
                                 progress=progress_cb, queue=None if dry_run else state.queue,
                                 engine=None if dry_run else state.engine, fmt=fmt)
    except ImportIncomplete as exc:  # stored but not (all) scheduled: say both, exit 3
        if exc.report is None:
            raise
        incomplete, report = exc, exc.report
    finally:
        if prog:
            prog.stop()
    if as_json:
        echo_json(report.as_json())
        if incomplete is not None:
            sys.exit(3)
        return
    verb = "would import" if dry_run else "imported"
    click.echo(f"{verb} {report.imported if not dry_run else report.valid} routes into '{workspace}': "
               f"valid={report.valid} duplicates={report.duplicates} skipped={report.skipped} "
               f"invalid={len(report.invalid)}"
               + (f" (refused by the egress guard: {report.refused})" if report.refused else "")
               + (f" (kept out by a blacklist: {report.blacklisted})" if report.blacklisted else "")
               + (f" flagged={report.flagged}" if report.flagged else "")
               + (f" enriched={report.enriched}" if report.enriched else "")
               + (f" stored={report.stored} scheduled={report.scheduled}" if not dry_run else ""))
    for bad in report.invalid[:50]:
        click.echo(f"  line {bad['line']}: {bad['reason']}", err=True)
    if len(report.invalid) > 50:
        click.echo(f"  ... and {len(report.invalid) - 50} more (use --json for all)", err=True)
    if incomplete is not None:
        click.echo(f"Error: {incomplete}", err=True)
        sys.exit(3)


def _counts(s: dict) -> list[str]:
    """The table cells of one shard (or the totals) of :meth:`RouteQueue.status`."""
    return [str(s["scheduled"]), str(s["leased"]), str(s["expired_leases"]), str(s["due_now"]),
            _fmt_ms(s["next_due_ms"]), f"{s['oldest_lateness_s']:.1f}"]


def _fmt_ms(ms) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%H:%M:%S")


@click.command()
@json_option
@pass_state
def status(state: CliState, as_json: bool) -> None:
    """Per-shard schedule state: scheduled, leased, due now, next due, oldest lateness (s); per partition
    with MAGPIE_SCHEDULE_PARTITIONS > 1 (``--json``: ``partitions`` beside ``shards`` and ``totals``)."""
    from rich.table import Table

    st = state.queue.status()
    if as_json:
        echo_json(st)
        return
    t = Table(title="route schedule")
    for col in ("shard", "scheduled", "leased", "expired leases", "due now", "next due (UTC)", "lateness s"):
        t.add_column(col, justify="right" if col != "shard" else "left")
    parts = st.get("partitions")
    if parts:  # a partitioned schedule: one row per partition (its shards summed), then the totals
        t.columns[0].header = "partition"
        for p in parts:
            t.add_row(f"{p['partition']} {{{p['name']}}}" + (" paused" if p["paused"] else ""), *_counts(p))
    else:
        for s in st["shards"]:
            t.add_row(s["shard"].rsplit(":", 1)[-1], *_counts(s))
    t.add_row("all", *_counts(st["totals"]), style="bold")
    print_table(t)


def health_table(rows: list[dict], title: str = "route health"):
    """A :class:`rich.table.Table` of :func:`magpie.db.repo.latest_health` rows (user text kept literal);
    a ``score`` / ``reputation`` column pair when the rows carry them (:func:`with_reputation`)."""
    from rich.table import Table
    from rich.text import Text

    rep = any("reputation" in r for r in rows)
    t = Table(title=title)
    cols = ["route", "protocol", "alive", "latency ms", "anonymity", "exit", "status", "checks", "last checked"]
    for col in cols + (["score", "reputation"] if rep else []):
        t.add_column(col)
    colour = {"good": "green", "neutral": "yellow", "poor": "red"}
    for r in rows:
        alive = {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[r["alive"]]
        user = f"{r['username']}@" if r.get("username") else ""
        host = f"[{r['host']}]" if ":" in r["host"] else r["host"]
        cells = [Text(f"{user}{host}:{r['port']}"), r["protocol"], alive,
                 f"{r['latency_ms']:.0f}" if r["latency_ms"] is not None else "-",
                 Text(r["anonymity"] or "-"),
                 Text(" ".join(x for x in (r.get("exit_ip"), r.get("exit_country")) if x) or "-"),
                 Text(str(r["status"] or r.get("error") or "-")),
                 str(r["checks_total"] or 0),
                 r["last_checked_at"].strftime("%H:%M:%S") if r["last_checked_at"] else "-"]
        if rep:
            label = r.get("reputation")
            cells += [f"{r['score']:.1f}" if r.get("score") is not None else "-",
                      f"[{colour[label]}]{label}[/]" if label in colour else "-"]
        t.add_row(*cells)
    return t


def with_reputation(engine, rows: list[dict], label: str | None = None,
                    min_score: float | None = None) -> list[dict]:
    """``rows`` (:func:`magpie.db.repo.latest_health`) with ``score`` (0-100 | None) and ``reputation``
    (``good`` / ``neutral`` / ``poor`` | None for a route not scored yet) added, keeping only those with
    the ``label`` and at least ``min_score`` when given (an unscored route then never matches)."""
    from magpie.derived.reputation import read_reputation

    with engine.connect() as conn:
        reps = read_reputation(conn, [r["route_id"] for r in rows])
    out = []
    for r in rows:
        rep = reps.get(r["route_id"])
        r = dict(r, score=rep["score"] if rep else None, reputation=rep["label"] if rep else None)
        if label is not None and r["reputation"] != label:
            continue
        if min_score is not None and (r["score"] is None or r["score"] < min_score):
            continue
        out.append(r)
    return out


@click.command()
@click.option("--workspace", "-w", default=None, help="Only this workspace's routes.")
@click.option("--reputation", "label", type=click.Choice(["good", "neutral", "poor"]), default=None,
              help="Only routes with this reputation label (good >= 80, neutral >= 40, poor below).")
@click.option("--min-score", type=click.FloatRange(0, 100), default=None,
              help="Only routes whose reputation score is at least this (0-100).")
@click.option("--limit", type=click.IntRange(0, 1_000_000), default=100, show_default=True,
              help="Routes per page (0: every route, sorted by address; fine for small deployments only).")
@click.option("--after", type=click.IntRange(0), default=0,
              help="Start after this route id (the next-page hint a page ends with).")
@json_option
@pass_state
def routes(state: CliState, workspace: str | None, label: str | None, min_score: float | None, limit: int,
           after: int, as_json: bool) -> None:
    """Latest health and reputation of each route (from PostgreSQL), a page at a time; routes not scored
    yet show '-'.

    Pages are read by route id (keyset paging: as fast on the millionth route as on the first); a page
    that is not the last ends with the command for the next one.

    Example: magpie routes --workspace lists --reputation good --limit 50
    """
    from magpie.db.repo import latest_health

    if limit == 0:
        rows = with_reputation(state.engine, latest_health(state.engine, workspace, keyring=state.keyring),
                               label, min_score)
        more = None
    else:
        rows, more, cursor = [], None, after
        while len(rows) < limit:  # filters may thin a page out: read on until the page is full
            page = latest_health(state.engine, workspace, keyring=state.keyring, limit=limit, after=cursor)
            if not page:
                break
            for r in with_reputation(state.engine, page, label, min_score):
                if len(rows) < limit:
                    rows.append(r)
            cursor = page[-1]["route_id"] if len(rows) < limit else rows[-1]["route_id"]
            if len(page) < limit and len(rows) < limit:
                cursor = None
                break
        more = cursor if len(rows) >= limit else None
    if as_json:
        echo_json(rows)
        return
    print_table(health_table(rows))
    if more is not None:
        hint = f"magpie routes --after {more} --limit {limit}" + (f" --workspace {workspace}" if workspace else "")
        click.echo(f"more routes: {hint}", err=True)


COMMANDS = [import_cmd, status, routes]
