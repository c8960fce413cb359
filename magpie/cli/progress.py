"""Progress of long operator verbs (rebuild, respread, drain, obliterate) and the confirmation of
destructive ones.

Progress is drawn on stderr, and only when stderr is a terminal, so ``--json`` output on stdout and
scripts reading it are unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

from magpie.errors import MagpieError


@contextmanager
def progress(label: str, enabled: bool | None = None) -> Iterator[Callable[[int, int], None]]:
    """A callback ``update(done, total)`` (counts of routes) drawing a bar labelled ``label`` on stderr.

    Args:
        label: what is counted, e.g. ``"draining"``.
        enabled: draw the bar; default: when stderr is a terminal. A disabled bar's callback does nothing.
    Yields:
        the callback; the bar is removed when the block ends.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda done, total: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    task = bar.add_task(label, total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total or None)


def interactive() -> bool:
    """True when stdin is a terminal an operator can answer on."""
    return sys.stdin.isatty()


def confirm_destructive(what: str, yes: bool) -> None:
    """Ask before ``what`` (e.g. ``"delete 30020 routes"``) on a terminal; elsewhere require ``--yes``.

    Raises :class:`MagpieError` (exit 2) without ``--yes`` when stdin is not a terminal, and
    ``click.Abort`` when the operator answers no.
    """
    if yes:
        return
    if not interactive():
        raise MagpieError(f"refusing to {what} without confirmation: pass --yes")
    click.confirm(f"{what[0].upper()}{what[1:]}?", abort=True, err=True)
