"""File-descriptor limits: one check holds one socket, so the descriptor limit bounds checks in flight."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

_FD_RESERVE = 256  # descriptors kept free for Redis, the broker, logs and the interpreter


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit.

    Returns ``(soft, hard)`` after the change (the old soft limit when raising is not allowed).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1_048_576)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft, hard


def checks_within_fd_limit(wanted: int, *, reserve: int = _FD_RESERVE, setting: str = "MAGPIE_CHECKS_PER_PROCESS"
                           ) -> int:
    """Concurrent checks this process can run: ``wanted`` capped below the descriptor limit.

    Raises the soft ``RLIMIT_NOFILE`` toward the hard limit first (one check holds one socket). When the
    limit is still too low, logs one warning naming ``setting`` and the limits, and returns the cap
    (at least 1). Args: ``wanted`` >= 1 checks; ``reserve`` descriptors kept for everything else.
    """
    soft, hard = raise_nofile_limit()
    cap = max(1, soft - reserve)
    if wanted > cap:
        log.warning("%s=%d exceeds the file-descriptor limit (soft %d, hard %d); running at most %d checks "
                    "at once in this process", setting, wanted, soft, hard, cap)
        return cap
    return wanted
