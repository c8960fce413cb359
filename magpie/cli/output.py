"""How commands print: one JSON line for ``--json``, rich tables for people.

User data (hosts, credentials, error texts) goes into tables as :class:`rich.text.Text`, never as markup,
so ``[/x]`` or ``[fe80::1]`` prints literally.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

import click


def echo_json(obj) -> None:
    """Print ``obj`` as one JSON line on stdout (datetimes and other objects as strings)."""
    click.echo(json.dumps(obj, default=str))


def print_table(table) -> None:
    """Print a :class:`rich.table.Table` on ``sys.stdout`` as it is at call time (a test runner's capture).

    On a terminal the table fits its width; into a pipe or file nothing is cut (a table is as wide as its
    cells need), so ``magpie routes | grep`` sees whole values."""
    import sys

    from rich.console import Console

    out = sys.stdout
    Console(file=out, width=None if out.isatty() else 10_000).print(table)


def rows_table(title: str, cols: Sequence[str], rows: Sequence[Sequence]) -> None:
    """Print a table of plain values: None as ``-``, datetimes as ``YYYY-MM-DD HH:MM:SS``, all literally."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title)
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*[Text("-" if v is None else (v.strftime("%Y-%m-%d %H:%M:%S") if isinstance(v, datetime)
                                                else str(v))) for v in r])
    print_table(t)
