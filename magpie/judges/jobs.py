"""The maintenance jobs of judge pools and ownership, as the registry takes them."""

from __future__ import annotations

from magpie.judges import ownership, refresh

JOBS = (refresh.JOB, ownership.JOB)
"""``judge_refresh`` and ``route_ownership``."""
