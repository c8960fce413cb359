"""A check process's garbage collector: automatic collection off, a full collection on a timer instead."""

from __future__ import annotations

import subprocess
import sys

_PROBE = r"""
import gc, time
from magpie.base.collector import tune_collector as _tune_gc

class Cycle:
    pass

_tune_gc({interval})
assert not gc.isenabled(), "automatic collection still on"
a, b = Cycle(), Cycle()
a.other, b.other = b, a
del a, b
full = gc.get_stats()[2]["collections"]
deadline = time.monotonic() + 20
while gc.get_stats()[2]["collections"] == full:
    assert time.monotonic() < deadline, "no timed full collection within 20 s"
    time.sleep(0.01)
print("collected")
"""


def _run(interval: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROBE.format(interval=interval)], capture_output=True,
                          text=True, timeout=60)


def test_a_timer_runs_full_collections_while_automatic_ones_are_off():
    p = _run(0.05)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "collected"


def test_interval_zero_keeps_automatic_collection_with_a_large_young_generation():
    probe = ("import gc\nfrom magpie.base.collector import tune_collector as _tune_gc\n_tune_gc(0)\n"
             "print(gc.isenabled(), gc.get_threshold()[0], gc.get_freeze_count() > 0)")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "50000", "True"]


def test_a_negative_interval_is_refused():
    import pytest

    from magpie.base.collector import tune_collector

    with pytest.raises(ValueError, match="collector interval"):
        tune_collector(-1)


def test_the_interval_follows_the_garbage_found():
    from magpie.base.collector import BUSY_OBJECTS, QUIET_OBJECTS, STRETCH, next_interval

    assert next_interval(30, 0, 30) == 60
    assert next_interval(30 * STRETCH, QUIET_OBJECTS - 1, 30) == 30 * STRETCH  # capped
    assert next_interval(240, BUSY_OBJECTS + 1, 30) == 120
    assert next_interval(30, BUSY_OBJECTS + 1, 30) == 30  # never below the first
    assert next_interval(90, QUIET_OBJECTS, 30) == 90  # some garbage: it stays
