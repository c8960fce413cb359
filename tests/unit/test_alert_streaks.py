"""The alert streak rule (magpie.alerts.streaks) as a pure function: no database, no clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from magpie.alerts.streaks import (
    MAX_GAP_MINUTES,
    OPENED,
    RECOVERED,
    Measurement,
    StreakState,
    Step,
    advance,
    epoch_minute,
    is_stale,
)

M = 29_000_000  # an arbitrary Unix minute
B = Measurement("breach", 1.0, 10)
H = Measurement("healthy", 5.0, 10)
U = Measurement("unknown", None, 0, "no data")


def step(state: StreakState, m: Measurement, minute: int, *, revision: int = 1, open_minutes: int = 2,
         recover_minutes: int = 2) -> Step:
    return advance(state, m, minute=minute, revision=revision, open_minutes=open_minutes,
                   recover_minutes=recover_minutes)


def ok(b: int = 0, h: int = 0, last: int | None = None, rev: int = 1) -> StreakState:
    return StreakState("ok", b, h, last, rev)


def open_(b: int = 0, h: int = 0, last: int | None = None, rev: int = 1) -> StreakState:
    return StreakState("open", b, h, last, rev)


# (case, state before, measurement, minute, state after, transition)
SINGLE_STEPS = [
    ("first breach counts one", ok(), B, M, ok(1, 0, M), None),
    ("second breach in a row opens", ok(1, 0, M), B, M + 1, open_(2, 0, M + 1), OPENED),
    ("one missed minute keeps the streak", ok(1, 0, M), B, M + 2, open_(2, 0, M + 2), OPENED),
    ("a longer gap restarts it", ok(1, 0, M), B, M + 3, ok(1, 0, M + 3), None),
    ("first healthy while ok", ok(), H, M, ok(0, 1, M), None),
    ("healthy ends a breach streak", ok(1, 0, M), H, M + 1, ok(0, 1, M + 1), None),
    ("breach ends a healthy streak", ok(0, 5, M), B, M + 1, ok(1, 0, M + 1), None),
    ("unknown ends a breach streak", ok(1, 0, M), U, M + 1, ok(0, 0, M + 1), None),
    ("unknown ends a healthy streak", open_(0, 1, M), U, M + 1, open_(0, 0, M + 1), None),
    ("unknown keeps an incident open", open_(3, 0, M), U, M + 1, open_(0, 0, M + 1), None),
    ("first unknown still sets the minute", ok(), U, M, ok(0, 0, M), None),
    ("second healthy in a row recovers", open_(0, 1, M), H, M + 1, ok(0, 2, M + 1), RECOVERED),
    ("healthy after a long gap restarts", open_(0, 1, M), H, M + 3, open_(0, 1, M + 3), None),
    ("breach while open stays open", open_(2, 0, M), B, M + 1, open_(3, 0, M + 1), None),
    ("a repeated minute is not counted", ok(1, 0, M), B, M, ok(1, 0, M), None),
    ("an earlier minute is not counted", ok(1, 0, M), B, M - 1, ok(1, 0, M), None),
    ("a repeated minute keeps an unknown out", ok(1, 0, M), U, M, ok(1, 0, M), None),
    ("a repeated healthy minute is not counted", open_(0, 1, M), H, M, open_(0, 1, M), None),
    ("any other outcome counts as unknown", ok(1, 0, M), Measurement("bogus", None, 0), M + 1,
     ok(0, 0, M + 1), None),
]


@pytest.mark.parametrize(("before", "m", "minute", "after", "transition"),
                         [c[1:] for c in SINGLE_STEPS], ids=[c[0] for c in SINGLE_STEPS])
def test_one_minute(before, m, minute, after, transition):
    assert step(before, m, minute) == Step(after, transition)


# (case, state before, measurement, minute, revision, state after, transition)
REVISIONS = [
    ("an edit restarts the streaks", ok(1, 0, M, rev=1), B, M + 1, 2, ok(1, 0, M + 1, rev=2), None),
    ("an edit counts even a repeated minute", ok(1, 0, M, rev=1), B, M, 2, ok(1, 0, M, rev=2), None),
    ("an edit counts an earlier minute", ok(1, 0, M, rev=1), H, M - 5, 2, ok(0, 1, M - 5, rev=2), None),
    ("an edit keeps an incident open", open_(0, 1, M, rev=1), H, M + 1, 2, open_(0, 1, M + 1, rev=2), None),
    ("same revision is carried", ok(1, 0, M, rev=7), B, M + 1, 7, open_(2, 0, M + 1, rev=7), OPENED),
]


@pytest.mark.parametrize(("before", "m", "minute", "revision", "after", "transition"),
                         [c[1:] for c in REVISIONS], ids=[c[0] for c in REVISIONS])
def test_rule_revision(before, m, minute, revision, after, transition):
    assert step(before, m, minute, revision=revision) == Step(after, transition)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_opens_after_exactly_n_breached_minutes(n):
    state = ok()
    for i in range(n):
        s = step(state, B, M + i, open_minutes=n)
        state = s.state
        assert s.transition == (OPENED if i == n - 1 else None), i
    assert state == open_(n, 0, M + n - 1)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_recovers_after_exactly_n_healthy_minutes(n):
    state = open_(4, 0, M)
    for i in range(1, n + 1):
        s = step(state, H, M + i, recover_minutes=n)
        state = s.state
        assert s.transition == (RECOVERED if i == n else None), i
    assert state == ok(0, n, M + n)


def test_thresholds_are_checked_against_stored_streaks_on_an_uncounted_minute():
    # a lower threshold than the one the streak was counted under takes effect in the same minute
    assert step(ok(3, 0, M), B, M, open_minutes=2) == Step(open_(3, 0, M), OPENED)
    assert step(open_(0, 3, M), H, M, recover_minutes=2) == Step(ok(0, 3, M), RECOVERED)
    # and the stored streak is what counts, not the repeated minute's outcome
    assert step(ok(3, 0, M), H, M, open_minutes=2) == Step(open_(3, 0, M), OPENED)


def test_a_streak_long_enough_does_not_reopen_or_re_recover():
    assert step(open_(2, 0, M), B, M, open_minutes=2) == Step(open_(2, 0, M), None)
    assert step(ok(0, 2, M), H, M, recover_minutes=2) == Step(ok(0, 2, M), None)


# minute offsets and outcomes -> the transitions, in order
SCENARIOS = [
    ("breach breach opens, healthy healthy recovers",
     [(0, B), (1, B), (2, H), (3, H)], [None, OPENED, None, RECOVERED]),
    ("unknown between breaches opens nothing",
     [(0, B), (1, U), (2, B), (3, U), (4, B)], [None] * 5),
    ("unknown between healthy minutes recovers nothing",
     [(0, B), (1, B), (2, H), (3, U), (4, H), (5, U)], [None, OPENED, None, None, None, None]),
    ("same-minute re-evaluations do not count twice",
     [(0, B), (0, B), (0, B), (1, B)], [None, None, None, OPENED]),
    ("one missed minute is bridged, two are not",
     [(0, B), (2, B), (3, H), (6, H), (9, H), (10, H)], [None, OPENED, None, None, None, RECOVERED]),
]


@pytest.mark.parametrize(("minutes", "want"), [c[1:] for c in SCENARIOS], ids=[c[0] for c in SCENARIOS])
def test_scenario(minutes, want):
    state, got = StreakState(), []
    for offset, m in minutes:
        s = step(state, m, M + offset)
        state = s.state
        got.append(s.transition)
    assert got == want


def test_max_gap_is_two_minutes():
    assert MAX_GAP_MINUTES == 2
    assert step(ok(1, 0, M), B, M + 5).state.breach_minutes == 1
    assert advance(ok(1, 0, M), B, minute=M + 5, revision=1, open_minutes=2, recover_minutes=2,
                   max_gap=5) == Step(open_(2, 0, M + 5), OPENED)


@pytest.mark.parametrize(("current", "stale"), [
    (None, True),
    ({"enabled": False, "revision": 3, "generation": 9}, True),
    ({"enabled": True, "revision": 4, "generation": 9}, True),
    ({"enabled": True, "revision": 3, "generation": 10}, True),
    ({"enabled": True, "revision": 3, "generation": 9}, False),
], ids=["deleted", "disabled", "edited", "evaluated elsewhere", "current"])
def test_stale_guard(current, stale):
    assert is_stale(current, revision=3, generation=9) is stale


def test_state_from_a_row():
    row = {"status": "open", "breach_minutes": 2, "healthy_minutes": 0, "last_minute": M, "rule_revision": 3,
           "generation": 8, "open_incident_id": 11}
    assert StreakState.from_row(row) == open_(2, 0, M, rev=3)
    assert StreakState() == ok(0, 0, None, rev=1)  # the row's server defaults


def test_epoch_minute():
    t = datetime(2025, 3, 1, 12, 0, 30, tzinfo=UTC)
    assert epoch_minute(t) == int(t.timestamp()) // 60
    assert epoch_minute(t + timedelta(seconds=29)) == epoch_minute(t)
    assert epoch_minute(t + timedelta(seconds=30)) == epoch_minute(t) + 1
    assert epoch_minute(t.astimezone(timezone(timedelta(hours=5)))) == epoch_minute(t)
