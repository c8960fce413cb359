"""``Backoff``: a pure retry curve, attempt number -> delay in ms.

Kinds: ``fixed`` (always ``base_ms``) and ``exponential`` (``base_ms * factor**(attempt-1)`` capped at
``cap_ms``), each with optional jitter: ``full`` (uniform in [0, d]) or ``equal`` (uniform in [d/2, d]),
as in the AWS Architecture Blog's "Exponential Backoff And Jitter". The random source is injectable, so
the curve stays a pure function of (attempt, rng).
"""

from __future__ import annotations

import random as _random
from dataclasses import dataclass

KINDS = ("fixed", "exponential")
JITTERS = ("none", "full", "equal")


@dataclass(frozen=True)
class Backoff:
    """Retry delay curve.

    Args:
        kind: ``fixed`` or ``exponential``.
        base_ms: first delay in ms (> 0).
        cap_ms: upper bound on any delay in ms (>= base_ms).
        factor: growth per attempt for ``exponential`` (>= 1).
        jitter: ``none``, ``full`` or ``equal``.
    Raises ``ValueError`` for an unknown kind/jitter or out-of-range numbers.
    """

    kind: str = "exponential"
    base_ms: int = 1000
    cap_ms: int = 300_000
    factor: float = 2.0
    jitter: str = "none"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"backoff kind must be one of {KINDS}, got {self.kind!r}")
        if self.jitter not in JITTERS:
            raise ValueError(f"backoff jitter must be one of {JITTERS}, got {self.jitter!r}")
        if self.base_ms <= 0 or self.cap_ms < self.base_ms or self.factor < 1:
            raise ValueError("backoff needs base_ms > 0, cap_ms >= base_ms and factor >= 1")

    def ceiling(self, attempt: int) -> int:
        """Delay in ms before jitter for ``attempt`` (1-based); raises ``ValueError`` if attempt < 1."""
        if attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {attempt}")
        if self.kind == "fixed":
            return min(self.base_ms, self.cap_ms)
        # compare exponents, not powers, so huge attempts never overflow
        d = float(self.base_ms)
        for _ in range(attempt - 1):
            d *= self.factor
            if d >= self.cap_ms:
                return self.cap_ms
        return int(min(d, self.cap_ms))

    def delay(self, attempt: int, rng: _random.Random | None = None) -> int:
        """Delay in ms for ``attempt`` (1-based) with jitter drawn from ``rng`` (default: module random)."""
        d = self.ceiling(attempt)
        if self.jitter == "none":
            return d
        u = (rng or _random).random()
        if self.jitter == "full":
            return int(d * u)
        return int(d / 2 + (d / 2) * u)
