"""Reputation scores of hand-made histories follow the documented weights and label thresholds."""

from __future__ import annotations

import pytest

from magpie.derived.reputation import GOOD, NEUTRAL, WEIGHTS, History, Params, components, label_for, score

P = Params(recency_horizon_s=86400, latency_good_ms=500, latency_bad_ms=5000, streak_limit=10)


def H(checks=10, alive=10, latency=100.0, age=0.0, anon="elite", cf=0):
    return History(checks, alive, latency, age, anon, cf)


def test_weights_are_the_documented_ones_and_add_up_to_one():
    assert WEIGHTS == {"uptime": 0.45, "recency": 0.2, "latency": 0.15, "anonymity": 0.1, "streak": 0.1}
    assert sum(WEIGHTS.values()) == pytest.approx(1.0)
    assert (GOOD, NEUTRAL) == (80.0, 40.0)


@pytest.mark.parametrize(
    "history, expected, label",
    [
        # always alive, fast, elite, seen now: every component 1
        (H(), 100.0, "good"),
        # never checked, never alive: only the empty failure streak counts (0.1)
        (H(checks=0, alive=0, latency=None, age=None, anon=None), 10.0, "poor"),
        # half uptime, otherwise perfect: 100 - 45 / 2
        (H(alive=5), 77.5, "neutral"),
        # latency half-way between the bounds (2750 ms): loses 0.15 / 2
        (H(latency=2750.0), 92.5, "good"),
        # last alive 12 h ago: recency 0.5 loses 10
        (H(age=43200.0), 90.0, "good"),
        # anonymous grade 0.5, transparent 0
        (H(anon="anonymous"), 95.0, "good"),
        (H(anon="transparent"), 90.0, "good"),
        # 5 failures in a row (limit 10): streak 0.5
        (H(cf=5), 95.0, "good"),
        # dead for a day with 10 failures: uptime 0.3, recency 0, streak 0, latency 1, elite:
        # 45*0.3 + 15 + 10 = 38.5
        (H(alive=3, age=86400.0, cf=10), 38.5, "poor"),
        # exactly on the neutral bound: no alive check in the window, but recency 1, elite and no
        # streak: 20 + 10 + 10 = 40
        (H(checks=10, alive=0, latency=None, age=0.0, anon="elite", cf=0), 40.0, "neutral"),
    ],
)
def test_hand_made_histories_score_as_documented(history, expected, label):
    rep = score(history, P)
    assert rep.score == pytest.approx(expected)
    assert rep.label == label


def test_components_are_bounded_and_clamped():
    c = components(H(latency=10.0, age=-5.0, cf=50), P)  # faster than good, clock skew, long streak
    assert c["latency"] == 1.0 and c["recency"] == 1.0 and c["streak"] == 0.0
    c = components(H(latency=9000.0, age=10 * 86400.0), P)
    assert c["latency"] == 0.0 and c["recency"] == 0.0
    assert all(0.0 <= v <= 1.0 for v in c.values())


@pytest.mark.parametrize("value, label", [(80.0, "good"), (79.9, "neutral"), (40.0, "neutral"), (39.9, "poor"),
                                          (0.0, "poor"), (100.0, "good")])
def test_labels_at_their_bounds(value, label):
    assert label_for(value) == label


def test_params_refuse_a_bad_latency_bound_before_a_good_one():
    from magpie.config import load_settings

    with pytest.raises(ValueError, match="MAGPIE_REPUTATION_LATENCY_BAD_MS"):
        Params.from_settings(load_settings(reputation_latency_good_ms=900, reputation_latency_bad_ms=800))
