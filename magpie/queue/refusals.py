"""The schedule's refusals: a script's negative reply code turned into a typed exception, in one place.

The Lua scripts in ``lua/`` return the codes of :class:`magpie.errors.Refusal` (``lua/lib.lua`` names them
``R_LEASE_LOST``, ``R_GONE``, ...); :func:`refusal` is the one mapper from such a code to the exception
the schedule raises. Positive replies are results, not refusals: :data:`COMPLETED` (1) and
:data:`REMOVED` (2, a completion that removed the route).
"""

from __future__ import annotations

from magpie.errors import Refusal, RefusedError

COMPLETED, REMOVED = 1, 2
# Per-item codes of the batch calls (complete, release, renew_many); equal to the plain ints Redis returns.
LEASE_LOST, GONE, PAYLOAD_CHANGED = Refusal.LEASE_LOST, Refusal.GONE, Refusal.PAYLOAD_CHANGED


class QueueError(RefusedError, RuntimeError):
    """A schedule call was refused and changed nothing.

    Args:
        code: a :class:`~magpie.errors.Refusal`, its integer value or its label (``"gone"``).
        member: the route hash concerned, possibly empty.
        detail: extra text for the message (for example the shard counts of ``layout_mismatch``).

    Attributes:
        code: the :class:`~magpie.errors.Refusal`; compare it with ``Refusal.GONE`` and print
            :attr:`label` (``"gone"``), the text users and the command line see.
        member: the route hash (same as ``subject``).
    """

    def __init__(self, code: Refusal | int | str, member: str = "", detail: str = ""):
        super().__init__(Refusal[code.upper()] if isinstance(code, str) else Refusal(code), member, detail)

    @property
    def member(self) -> str:
        """The route hash the refusal concerns (``""`` when it concerns the whole schedule)."""
        return self.subject


class LeaseLost(QueueError):
    """The caller no longer holds the lease (it expired and another holder claimed the route)."""


# Refusals with a class of their own; every other code raises a plain QueueError with that code.
_TYPED: dict[Refusal, type[QueueError]] = {Refusal.LEASE_LOST: LeaseLost}


def refusal(code: Refusal | int, member: str = "", detail: str = "") -> QueueError:
    """The exception for a script's refusal ``code`` (a negative integer of :class:`~magpie.errors.Refusal`).

    Returns (does not raise) a :class:`LeaseLost` for ``LEASE_LOST``, else a :class:`QueueError` with
    ``code``. Raises ``ValueError`` when ``code`` is not a refusal code (a script bug).
    """
    code = Refusal(code)
    return _TYPED.get(code, QueueError)(code, member, detail)


def is_refusal(reply) -> bool:
    """True when a script ``reply`` is a refusal code (a negative integer) rather than a result."""
    return isinstance(reply, int) and reply < 0
