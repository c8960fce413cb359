"""``magpie export``: a workspace's routes with their current health, as a list to use elsewhere."""

from __future__ import annotations

import os
import sys

import click

from magpie.cli.context import CliState, pass_state
from magpie.errors import MagpieError


@click.command("export")
@click.option("--workspace", required=True, help="Workspace whose routes are exported.")
@click.option("--alive/--dead", "alive", default=None,
              help="Only routes whose newest check was alive (--alive) or failed (--dead).")
@click.option("--protocol", default=None, help="Route protocols, e.g. socks5 or http,https.")
@click.option("--anonymity", default=None, help="Anonymity levels, e.g. elite,anonymous.")
@click.option("--country", default=None, help="Countries of the entry address, two-letter codes, e.g. DE,NL.")
@click.option("--exit-country", "exit_country", default=None,
              help="Countries of the exit address the judge saw, two-letter codes.")
@click.option("--max-latency", "max_latency", type=float, default=None, metavar="MS",
              help="Newest latency at most MS milliseconds.")
@click.option("--min-score", "min_score", type=float, default=None, metavar="N",
              help="Reputation score at least N (0-100).")
@click.option("--format", "fmt", required=True, type=click.Choice(["txt", "url", "csv", "json", "jsonl"]),
              help="txt: host:port; url: scheme://host:port; csv, json (one array), jsonl (one object a line).")
@click.option("--with-credentials", is_flag=True,
              help="Include usernames and passwords (decrypted; written to the audit log, never the secrets).")
@click.option("--output", "-o", "output", default=None, metavar="FILE",
              help="Write to FILE (replaced once complete; mode 0600 with credentials) instead of stdout.")
@pass_state
def export(state: CliState, workspace, alive, protocol, anonymity, country, exit_country, max_latency, min_score,
           fmt, with_credentials, output) -> None:
    """Export the routes of a workspace that pass the filters, streamed in route order (constant memory)."""
    from magpie.admin.export import ExportFilter, stream_export

    flt = ExportFilter(workspace=workspace, alive=alive, protocol=protocol, anonymity=anonymity, country=country,
                       max_latency_ms=max_latency, min_score=min_score, exit_country=exit_country)
    state.engine  # noqa: B018 - the database's key is this key (else one line, exit 2) before anything runs
    chunks = stream_export(state.settings, flt, fmt, with_credentials)
    if output is None:
        out = sys.stdout
        for chunk in chunks:
            out.write(chunk)
        out.flush()
        return
    tmp = f"{output}.partial"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if with_credentials else 0o644)
    except OSError as exc:
        raise MagpieError(f"cannot write {tmp!r}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            for chunk in chunks:
                fh.write(chunk)
        os.replace(tmp, output)
    except OSError as exc:
        raise MagpieError(f"cannot write {output!r}: {exc.strerror}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


COMMANDS = [export]
