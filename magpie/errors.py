"""The one exception base of magpie and the one refusal vocabulary.

Every exception magpie raises on purpose derives from :class:`MagpieError`; the command line turns one into
a one-line message and exit status 2. A *refusal* is the special case of a well-formed request that the
current state does not allow (a stale lease, a route that is gone, a queue that is not paused): it carries
a :class:`Refusal` code and exits with status 3 and that code.

The numeric codes are the ones the Lua scripts return (negative integers; ``lua/lib.lua`` mirrors them as
named constants); the schedule maps a script's code to its typed exception in one place
(:mod:`magpie.queue`). The anchor is BullMQ's error-code enum: one table, one mapper, typed exceptions.
"""

from __future__ import annotations

import enum


class Refusal(enum.IntEnum):
    """Refusal codes shared by the Lua scripts (``lua/lib.lua``) and Python."""

    LEASE_LOST = -1
    """The caller no longer holds the lease (it expired and another holder claimed the route)."""
    GONE = -2
    """The route is not scheduled (removed, drained or never imported)."""
    PAYLOAD_CHANGED = -3
    """A concurrent import changed the payload after the claim; nothing was removed."""
    BAD_PAYLOAD = -4
    """The stored or given payload is not one magpie can merge."""
    LEASED = -5
    """A check is running for the route now."""
    DEAD = -6
    """The route is dead-lettered."""
    NOT_DEAD = -7
    """The route is not dead-lettered."""
    ACTIVE_LEASES = -8
    """Live leases block the operation (use ``--force`` where offered)."""
    NOT_PAUSED = -9
    """The operation needs a paused queue."""
    LAYOUT_MISMATCH = -10
    """``PROXY_QUEUE_SHARDS`` differs from the shard count the stored schedule was built with."""
    PORT_TAKEN = -11
    """The requested port is used by another rotator (or outside ``MAGPIE_ROTATOR_PORTS``)."""
    RANGE_EXHAUSTED = -12
    """Every port of ``MAGPIE_ROTATOR_PORTS`` already belongs to a rotator."""
    NO_SUCH_WORKSPACE = -13
    """The named workspace does not exist."""
    EMPTY = -14
    """Nothing is claimable now (``magpie queue claim``)."""
    UNSUPPORTED = -15
    """The schedule provider does not serve the operation (a Redis-only one on the PostgreSQL schedule)."""
    REVISION_CHANGED = -16
    """The record changed since the revision the caller named (``--expected-revision``)."""

    @property
    def label(self) -> str:
        """The code as users see it, e.g. ``"lease_lost"``."""
        return self.name.lower()


class MagpieError(Exception):
    """Base of every exception magpie raises on purpose; its message is one line for the user."""


class ConfigError(MagpieError, ValueError):
    """A setting from the environment (or an operator's argument) is missing or malformed; the message
    names the variable. Also importable as :class:`magpie.config.ConfigError`."""


class RefusedError(MagpieError):
    """A request refused by the current state; nothing changed.

    Attributes:
        code: the :class:`Refusal`.
        subject: what it concerns (a route hash, a setting), possibly empty.
    """

    def __init__(self, code: Refusal, subject: str = "", detail: str = ""):
        self.code = Refusal(code)
        self.subject = subject
        msg = self.code.label + (f": route {subject}" if subject and not detail else "")
        super().__init__(msg + (f": {detail}" if detail else ""))

    @property
    def label(self) -> str:
        """The refusal code as text (``"lease_lost"``, ``"gone"``, ...)."""
        return self.code.label


def storage_error(exc: BaseException) -> str | None:
    """One line for an unreachable or unmigrated Redis / PostgreSQL, or None for any other exception."""
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
    try:  # the PostgreSQL schedule talks to psycopg2 directly (MAGPIE_SCHEDULE_URL)
        import psycopg2
    except ImportError:  # pragma: no cover - a dependency
        return None
    if isinstance(exc, psycopg2.Error):
        first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
        if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)):
            return f"cannot reach the PostgreSQL schedule (MAGPIE_SCHEDULE_URL): {first}"
        if isinstance(exc, psycopg2.ProgrammingError):
            return f"PostgreSQL schedule schema missing or out of date (run `magpie db upgrade`): {first}"
    return None
