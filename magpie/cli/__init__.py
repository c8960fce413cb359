"""The ``magpie`` command line (also ``python -m magpie``): one root group and its one error handler.

Each command module of this package is imported here and added to :func:`main`. Read commands take
``--json``. Exit statuses, the same for every command:

- 0: done.
- 1: the command ran and its documented result is "not good": ``magpie health`` not ready, a failed
  ``magpie maintenance run`` pass, ``magpie check`` with a judge that does not answer.
- 2: an error a user can fix (bad setting, bad argument, unreachable or unmigrated Redis/PostgreSQL, a
  port in use): one line ``Error: ...`` on stderr naming what was wrong. Click's usage errors exit 2 too.
- 3: a refusal (:class:`magpie.errors.RefusedError`): the request was well formed but the current state
  does not allow it; nothing changed. One line ``refused: <code>`` (then ``: route <hash>`` or
  ``: <detail>``) on stderr, and with ``--json`` also
  ``{"ok": false, "refused": "<code>", "member": <route hash or null>}`` on stdout.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click

from magpie.cli import alerts, checks, db, keys, lab, maintenance, monitoring, outbox, queue, routes
from magpie.cli import blacklists, init, instances, judges, rotators, stats, web
from magpie.cli import bulk
from magpie.cli import export as export_cmd
from magpie.cli import tokens
from magpie.cli import sources
from magpie.cli import examples as _examples
from magpie.cli.context import CliState
from magpie.cli.output import echo_json
from magpie.errors import MagpieError, RefusedError, storage_error

EXIT_ERROR = 2
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2
EXIT_REFUSED = 3


class CommandFailed(click.ClickException):
    """A :class:`MagpieError` or a storage failure as click shows it: ``Error: <message>``, exit status 2."""

    exit_code = EXIT_ERROR


class CommandRefused(click.ClickException):
    """A :class:`RefusedError` as click reports it: ``refused: <code>`` (and the JSON form), exit status 3."""

    exit_code = EXIT_REFUSED

    def __init__(self, refusal: RefusedError, as_json: bool):
        self.refusal = refusal
        self.as_json = as_json
        super().__init__(f"refused: {refusal}")  # "<code>", "<code>: route <hash>" or "<code>: <detail>"

    def show(self, file=None) -> None:
        if self.as_json:
            echo_json({"ok": False, "refused": self.refusal.label, "member": self.refusal.subject or None})
        click.echo(self.format_message(), err=True)


@contextmanager
def handle_errors(state: CliState) -> Iterator[None]:
    """The one translation of exceptions into exit statuses (module doc): refusal -> 3, error -> 2.

    Raises :class:`CommandRefused` or :class:`CommandFailed` (click prints them and exits); click's own
    exceptions and any other exception (a bug: its traceback is wanted) pass unchanged.
    """
    try:
        yield
    except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
        raise
    except RefusedError as exc:
        raise CommandRefused(exc, state.as_json) from None
    except MagpieError as exc:
        raise CommandFailed(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - storage failures become one line, anything else re-raised
        msg = storage_error(exc)
        if msg is None:
            raise
        raise CommandFailed(msg) from None


class MagpieGroup(click.Group):
    """The root group: a :class:`CliState` on the context, every command run inside :func:`handle_errors`;
    a usage error (bad option or argument) is one line too, naming where ``--help`` is."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as exc:  # a bare group: its help, as click shows it
            click.echo(exc.format_message(), err=True)
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else (prog_name or "magpie")
            click.echo(f"Error: {exc.format_message()} (see `{where} --help`)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context):
        state = ctx.ensure_object(CliState)
        ctx.call_on_close(state.close)
        with handle_errors(state):
            return super().invoke(ctx)


@click.group(cls=MagpieGroup)
@click.version_option(package_name="magpie")
def main() -> None:
    """magpie: recurring health checks of HTTP/HTTPS/SOCKS4/SOCKS5 proxies on a Redis lease schedule."""
    from magpie.observability.logs import setup_cli_logging

    setup_cli_logging()  # MAGPIE_LOG_FORMAT=json: log lines as JSON


for _module in (db, routes, queue, checks, lab, alerts, outbox, maintenance, monitoring, keys, stats, judges,
                blacklists, instances, rotators, web, init, bulk, export_cmd, tokens, sources):
    for _command in _module.COMMANDS:
        main.add_command(_command)
del _module, _command
_examples.attach(main)

__all__ = ["main", "handle_errors", "storage_error", "CommandFailed", "CommandRefused", "EXIT_ERROR",
           "EXIT_REFUSED"]
