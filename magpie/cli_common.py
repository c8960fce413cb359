"""Helpers shared by the command-line modules (``magpie/cli.py`` and the packages' ``cli.py``)."""

from __future__ import annotations

import json

import click


def load_settings_or_exit():
    """Process settings; a broken value becomes a one-line ``click`` error naming the variable."""
    from magpie.config import ConfigError, get_settings

    try:
        return get_settings()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def echo_json(obj) -> None:
    """Print ``obj`` as one JSON line (datetimes and other objects as strings)."""
    click.echo(json.dumps(obj, default=str))
