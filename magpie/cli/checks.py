"""``magpie check`` (check a list once, with no Redis or PostgreSQL) and ``magpie judge`` (serve a judge)."""

from __future__ import annotations

import sys
from urllib.parse import urlsplit

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json, print_table
from magpie.cli.routes import PROTOCOL_CHOICE
from magpie.errors import MagpieError


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--protocol", default="http", show_default=True, type=PROTOCOL_CHOICE)
@click.option("--judge", "judge_url", default=None, help="Judge URL (default MAGPIE_JUDGE_URL).")
@click.option("--timeout", default=None, type=click.FloatRange(0, 600, min_open=True),
              help="Hard deadline of one attempt, seconds (default MAGPIE_CHECK_TIMEOUT).")
@click.option("--attempts", default=None, type=click.IntRange(1, 10),
              help="Attempts per route (default MAGPIE_CHECK_ATTEMPTS).")
@click.option("--concurrency", default=None, type=click.IntRange(1, 1_000_000),
              help="Checks in flight per process (default MAGPIE_CHECKS_PER_PROCESS, capped by the fd limit).")
@click.option("--processes", default=None, type=click.IntRange(1, 256),
              help="Check processes (default: MAGPIE_CHECK_CONCURRENCY, else one per core plus one when the "
                   "list is longer than one process's checks in flight; otherwise 1).")
@click.option("--ca-bundle", default=None, type=click.Path(exists=True, dir_okay=False),
              help="PEM CA certificates trusted for an https judge (default MAGPIE_JUDGE_CA_BUNDLE, else "
                   "the system store).")
@json_option
@pass_state
def check(state: CliState, file, protocol, judge_url, timeout, attempts, concurrency, processes, ca_bundle,
          as_json) -> None:
    """Check every route of FILE once, now, with no Redis or PostgreSQL.

    A long list is spread over several processes, each with its own event loop, as the check workers
    are (a dead proxy costs a whole timeout, so capacity is checks in flight). Exits 1 when the judge
    itself does not answer a direct request (no route is blamed then).

    Example: magpie check proxies.txt --judge http://127.0.0.1:8899/ --timeout 5 --json
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from magpie.checker import Checker, checks_within_fd_limit
    from magpie.checker.check import check_spread
    from magpie.checker.limits import size_check_worker
    from magpie.importer.parse import parse_file

    s = state.settings
    source = "--judge" if judge_url else "MAGPIE_JUDGE_URL"
    judge_url = judge_url or s.judge_url
    if urlsplit(judge_url).scheme not in ("http", "https") or not urlsplit(judge_url).hostname:
        raise MagpieError(f"{source}: not an http(s) URL: {judge_url!r}")
    parsed = parse_file(file, default_protocol=protocol)
    for bad in parsed.invalid[:50]:
        click.echo(f"  line {bad.line}: {bad.reason}", err=True)
    timeout = timeout or s.check_timeout
    from magpie.base.egress import EgressPolicy, is_ip_literal

    from magpie.checker.tls import is_https, judge_ssl_context

    guard = EgressPolicy(s.check_allow_private, "MAGPIE_CHECK_ALLOW_PRIVATE")
    tls = judge_ssl_context(ca_bundle or s.judge_ca_bundle) if is_https(judge_url) else None
    kwargs = dict(judge_url=judge_url, timeout=timeout, attempts=attempts or s.check_attempts, body_cap=s.body_cap,
                  connect_timeout=min(s.connect_timeout, timeout), egress=guard, ssl_context=tls)
    checker = Checker(**kwargs)
    try:
        judge_host = urlsplit(judge_url).hostname or ""
        refused = guard.refusal(judge_host) if is_ip_literal(judge_host) else None
        if refused:
            raise MagpieError(f"{source}: judge refused by the egress guard: {refused}")
        own = checker.learn_own_address()
        if own is None:
            click.echo(f"Error: judge {checker.judge_url} does not answer a direct request with an echo; "
                       "fix --judge (or MAGPIE_JUDGE_URL) before checking routes", err=True)
            raise click.exceptions.Exit(1)
    finally:
        checker.close()
    setting = "--concurrency" if concurrency else "MAGPIE_CHECKS_PER_PROCESS"
    width = checks_within_fd_limit(concurrency or s.checks_per_process, setting=setting)
    if processes is None:
        processes = size_check_worker(width, s.check_concurrency).processes if len(parsed.routes) > width else 1
    kwargs["own_addresses"] = own
    if not as_json and sys.stderr.isatty() and parsed.routes:
        from rich.progress import Progress

        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("checking", total=len(parsed.routes))
            results = check_spread(parsed.routes, kwargs, processes=processes, per_process=width,
                                   progress=lambda done: bar.update(task, completed=done))
    else:
        results = check_spread(parsed.routes, kwargs, processes=processes, per_process=width)
    rows = []
    for route, res in zip(parsed.routes, results):
        rows.append({"route": route.display(), "protocol": route.protocol, "alive": res.alive,
                     "latency_ms": res.latency_ms, "status": res.status, "attempts": res.attempts,
                     "error": res.error, "anonymity": res.anonymity, "connect_ms": res.connect_ms,
                     "handshake_ms": res.handshake_ms})
    if as_json:
        invalid = [{"line": x.line, "reason": x.reason} for x in parsed.invalid]
        echo_json({"results": rows, "invalid": invalid})
        return
    t = Table(title=f"one-shot check ({len(rows)} routes, {sum(r['alive'] for r in rows)} alive)")
    for col in ("route", "alive", "latency ms", "anonymity", "error"):
        t.add_column(col)
    for r in rows:
        t.add_row(Text(r["route"]), "[green]yes[/]" if r["alive"] else "[red]no[/]",
                  f"{r['latency_ms']:.0f}" if r["latency_ms"] is not None else "-", r["anonymity"] or "-",
                  Text(r["error"] or ""))
    print_table(t)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8899, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port to listen on (0: any free port).")
def judge(host: str, port: int) -> None:
    """Serve a judge: an echo endpoint returning the request's headers and remote address as JSON.

    A port in use is an error (exit 2), not a traceback.

    \b
    Example:
      magpie judge --host 127.0.0.1 --port 8899
    """
    from magpie.checker.judge import run_judge

    try:
        run_judge(host, port)  # prints "judge listening on <url>" once bound
    except OSError as exc:
        raise MagpieError(f"cannot listen on {host}:{port} (--host/--port): {exc.strerror or exc}") from None


COMMANDS = [check, judge]
