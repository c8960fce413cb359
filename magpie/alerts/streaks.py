"""Alert streaks: how one evaluation minute moves a rule's state, as a pure function.

No database and no clock: :func:`advance` takes the rule's stored :class:`StreakState`, the minute's
:class:`Measurement`, the minute itself and the open/recover thresholds, and returns the next state and the
incident transition, if any. :mod:`magpie.alerts.evaluate` reads the state under a row lock, calls it,
and writes the result back in the same transaction.

The rules:

* Streaks count *evaluation minutes* (Unix time // 60, :func:`epoch_minute`). Under the same rule
  revision, a minute at or before the last counted one changes no streak (a second evaluation in the same
  minute is not counted twice).
* A ``breach`` minute extends the breach streak and ends the healthy one, and vice versa; an ``unknown``
  minute ends both, so Unknown can neither open nor recover an incident (an open incident stays open).
* A gap of more than :data:`MAX_GAP_MINUTES` since the last counted minute, no counted minute yet, or a
  rule edit (the state's ``rule_revision`` differs from the rule's revision) restarts both streaks before
  the minute is counted.
* After counting, an ``ok`` rule opens an incident once its breach streak reaches ``open_minutes``; an
  ``open`` rule recovers once its healthy streak reaches ``recover_minutes``. The thresholds are checked
  even when the minute was not counted, against the stored streaks.

:func:`is_stale` is the guard in front of it: a rule edited, disabled, deleted or evaluated by someone else
since it was measured is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

MAX_GAP_MINUTES = 2
"""A streak survives one missed evaluation minute; a longer gap restarts it."""

OPENED = "incident.opened"
RECOVERED = "incident.recovered"


@dataclass(frozen=True, slots=True)
class Measurement:
    """Verdict of one rule for one minute.

    Attributes:
        outcome: ``breach``, ``healthy`` or ``unknown``.
        value: the measured figure in the rule's unit (routes, percent, ms) or ``None``.
        samples: observations behind it (fresh routes, checks, or alive checks with a latency).
        reason: why the outcome is ``unknown`` (``None`` otherwise).
    """

    outcome: str
    value: float | None
    samples: int
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class StreakState:
    """The streak part of a rule's ``alert_rule_state`` row.

    Attributes:
        status: ``ok`` (no open incident) or ``open``.
        breach_minutes: consecutive counted minutes with outcome ``breach``.
        healthy_minutes: consecutive counted minutes with outcome ``healthy``.
        last_minute: Unix minute of the last counted evaluation, ``None`` before the first.
        rule_revision: the rule revision the streaks were counted under.
    """

    status: str = "ok"
    breach_minutes: int = 0
    healthy_minutes: int = 0
    last_minute: int | None = None
    rule_revision: int = 1

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> StreakState:
        """The state from a row with keys ``status``, ``breach_minutes``, ``healthy_minutes``,
        ``last_minute`` and ``rule_revision`` (other keys are ignored); KeyError when one is missing."""
        return cls(row["status"], row["breach_minutes"], row["healthy_minutes"], row["last_minute"],
                   row["rule_revision"])


@dataclass(frozen=True, slots=True)
class Step:
    """Result of :func:`advance`: the state to store and the transition (``incident.opened``,
    ``incident.recovered`` or ``None``)."""

    state: StreakState
    transition: str | None = None


def epoch_minute(now: datetime) -> int:
    """Unix minute of ``now`` (seconds since the epoch // 60)."""
    return int(now.timestamp()) // 60


def is_stale(current: Mapping[str, Any] | None, *, revision: int, generation: int) -> bool:
    """Whether a rule measured at ``revision`` / state ``generation`` must be skipped.

    Args:
        current: the rule as locked now, with keys ``enabled``, ``revision`` and ``generation``; ``None``
            when the rule is gone.
        revision: ``alert_rules.revision`` when the rule was measured.
        generation: ``alert_rule_state.generation`` when the rule was measured.
    Returns:
        True when the rule was deleted, disabled or edited, or its state written by another evaluation.
    """
    return (current is None or not current["enabled"] or current["revision"] != revision
            or current["generation"] != generation)


def advance(state: StreakState, measurement: Measurement, *, minute: int, revision: int,
            open_minutes: int, recover_minutes: int, max_gap: int = MAX_GAP_MINUTES) -> Step:
    """Apply one evaluation minute to a rule's streaks (module doc for the rules).

    Args:
        state: the stored state.
        measurement: the minute's verdict; only ``outcome`` is read (anything but ``breach`` and
            ``healthy`` counts as unknown).
        minute: the evaluation's Unix minute (:func:`epoch_minute`).
        revision: the rule's current revision; the returned state carries it.
        open_minutes: breached minutes in a row that open an incident (``MAGPIE_ALERT_OPEN_MINUTES``).
        recover_minutes: healthy minutes in a row that recover one (``MAGPIE_ALERT_RECOVER_MINUTES``).
        max_gap: largest distance, in minutes, from the last counted minute that keeps the streaks.
    Returns:
        A :class:`Step` with the new state and the transition, if any.
    """
    if state.rule_revision != revision:  # edited since the streaks began
        breach, healthy, last = 0, 0, None
    else:
        breach, healthy, last = state.breach_minutes, state.healthy_minutes, state.last_minute
    if last is None or minute > last:
        if last is None or minute - last > max_gap:
            breach = healthy = 0
        if measurement.outcome == "breach":
            breach, healthy = breach + 1, 0
        elif measurement.outcome == "healthy":
            breach, healthy = 0, healthy + 1
        else:
            breach = healthy = 0
        last = minute
    status, transition = state.status, None
    if status == "ok" and breach >= open_minutes:
        status, transition = "open", OPENED
    elif status == "open" and healthy >= recover_minutes:
        status, transition = "ok", RECOVERED
    return Step(StreakState(status, breach, healthy, last, revision), transition)
