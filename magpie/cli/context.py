"""What the commands of one ``magpie`` invocation share: settings and clients on the click context.

The root group puts one :class:`CliState` on ``ctx.obj``; a command takes it with ``@pass_state`` and
reads ``state.settings``, ``state.redis``, ``state.engine``, ``state.queue``: each is built on first use,
once per invocation, so a command that needs no Redis never connects to it (``magpie check`` runs with
neither Redis nor PostgreSQL).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property

import click

from magpie.base import redisconn
from magpie.errors import MagpieError


class CliState:
    """Settings and clients of one invocation (``ctx.obj``), each built lazily and at most once.

    Attributes:
        as_json: set by :data:`json_option` when the command was given ``--json``; the error handler
            then prints a refusal as JSON too.
    """

    def __init__(self) -> None:
        self.as_json = False

    @cached_property
    def settings(self):
        """The process's :class:`magpie.config.Settings`; raises :class:`magpie.config.ConfigError`."""
        from magpie.config import get_settings

        return get_settings()

    @cached_property
    def redis(self):
        """A redis-py client on ``MAGPIE_REDIS_URL`` (bytes replies), closed when the invocation ends."""
        import redis

        return redisconn.connect(self.settings.redis_url, health_check_interval=30)

    @cached_property
    def engine(self):
        """The process-wide SQLAlchemy engine on ``MAGPIE_DATABASE_URL``, once ``PROXY_ENCRYPTION_KEY`` is
        known to be the database's key (:func:`magpie.db.keycheck.verify_key`: recorded on first use).

        Raises :class:`magpie.base.crypto.KeyMismatchError` for another key (exit status 2, one line).
        """
        from magpie.db.keycheck import verify_key
        from magpie.db.session import get_engine

        engine = get_engine(self.settings.database_url)
        verify_key(engine, self.settings.encryption_key)
        return engine

    @cached_property
    def queue(self):
        """The deployment's :class:`magpie.queue.RouteQueue` on :attr:`redis`.

        Raises the ``layout_mismatch`` refusal when ``PROXY_QUEUE_SHARDS`` differs from the stored schedule.
        """
        from magpie.queue.provider import create_provider

        return create_provider(self.settings.schedule_url, self.settings, redis_client=self.redis)

    @cached_property
    def keyring(self):
        """The credential keyring of ``PROXY_ENCRYPTION_KEY``."""
        from magpie.base.crypto import get_keyring

        return get_keyring(self.settings.encryption_key)

    def close(self) -> None:
        """Release what this invocation opened (the Redis connections); the shared engine stays."""
        client = self.__dict__.get("redis")
        if client is not None:
            client.close()


pass_state = click.make_pass_decorator(CliState, ensure=True)
"""Decorator passing the invocation's :class:`CliState` as a command's first argument."""


def _record_json(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.ensure_object(CliState).as_json = True
    return value


json_option = click.option("--json", "as_json", is_flag=True, callback=_record_json,
                           help="Print one JSON object.")
"""The ``--json`` flag of read commands (passed as ``as_json``; also recorded on the :class:`CliState`)."""


@contextmanager
def user_errors(*types: type[BaseException], prefix: str = "") -> Iterator[None]:
    """Turn the exceptions of ``types`` raised inside the block into a :class:`MagpieError` (exit status 2).

    For library calls that report a user's mistake with a plain ``ValueError``, ``LookupError`` or
    ``OSError``; ``prefix`` goes before the message, e.g. ``"cannot listen on ...: "``. A
    :class:`MagpieError` passes through unchanged.
    """
    try:
        yield
    except types as exc:
        if isinstance(exc, MagpieError):
            raise
        raise MagpieError(prefix + str(exc)) from exc


def worker_options(setting: str):
    """The ``--workers N``, ``--once`` and ``--poll S`` options of a command running senders in-process.

    ``setting`` names the variable ``--workers`` defaults to (e.g. ``"MAGPIE_EMAIL_WORKERS"``).
    """

    def decorate(f):
        f = click.option("--poll", default=1.0, show_default=True, help="Idle poll interval in seconds.")(f)
        f = click.option("--once", is_flag=True, help="Drain what is due and exit.")(f)
        return click.option("--workers", type=int, default=None,
                            help=f"Parallel senders (default {setting}).")(f)

    return decorate


def run_workers(run: Callable[..., Mapping[str, int]], *, once: bool, poll: float) -> None:
    """Run senders and print their counters as ``key=value`` pairs (``nothing due`` when there are none).

    Args:
        run: ``run()`` drains what is due and returns counters; ``run(stop=event, poll_s=poll)`` keeps
            polling until ``event`` is set.
        once: drain once and return; else serve until Ctrl-C (the senders finish their rows first).
        poll: idle poll interval, seconds.
    """
    got: dict = {}
    if once:
        got.update(run())
    else:
        stop = threading.Event()
        th = threading.Thread(target=lambda: got.update(run(stop=stop, poll_s=poll)), daemon=True)
        th.start()
        try:
            while th.is_alive():
                th.join(0.5)
        except KeyboardInterrupt:
            stop.set()
            th.join()
    click.echo(" ".join(f"{k}={v}" for k, v in sorted(got.items())) or "nothing due")
