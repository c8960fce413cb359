"""Backoff is a pure curve: property tests of its bounds and monotonicity."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from magpie.base.backoff import Backoff

curves = st.builds(
    Backoff,
    kind=st.sampled_from(["fixed", "exponential"]),
    base_ms=st.integers(1, 10_000),
    cap_ms=st.integers(10_000, 10_000_000),
    factor=st.floats(1.0, 10.0),
    jitter=st.just("none"),
)


@given(curves, st.integers(1, 200))
def test_monotone_and_never_above_cap(b, n):
    assert b.ceiling(n) <= b.ceiling(n + 1) <= b.cap_ms
    assert b.delay(n) == b.ceiling(n)


@given(st.integers(1, 1000), st.integers(1000, 100_000), st.integers(1, 40))
def test_exponential_doubles_until_cap(base, cap, n):
    b = Backoff("exponential", base, cap, 2.0)
    assert b.ceiling(n) == min(cap, base * 2 ** (n - 1))


@given(curves, st.integers(1, 60), st.sampled_from(["full", "equal"]), st.integers(0, 2**32))
def test_jitter_within_bounds(b, n, jitter, seed):
    j = Backoff(b.kind, b.base_ms, b.cap_ms, b.factor, jitter)
    d = j.delay(n, random.Random(seed))
    top = j.ceiling(n)
    low = 0 if jitter == "full" else top // 2
    assert low <= d <= top


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="kind"):
        Backoff("linear")
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter="some")
    with pytest.raises(ValueError, match="attempt"):
        Backoff().ceiling(0)
