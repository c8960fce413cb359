"""File-descriptor limits: one check holds one socket, so the descriptor limit bounds checks in flight."""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class CheckSizing:
    """How a check worker is sized: ``processes`` Celery processes of ``per_process`` checks each.

    ``cores`` and the open-file limits (``fd_soft``, ``fd_hard``, per process) are what it was sized from;
    ``auto`` is True when the process count was chosen here, not by the operator.
    """

    processes: int
    per_process: int
    cores: int
    fd_soft: int
    fd_hard: int
    auto: bool

    @property
    def slots(self) -> int:
        """Checks in flight the worker can hold: ``processes * per_process``."""
        return self.processes * self.per_process

    def describe(self) -> str:
        """One log line naming the sizing and where it came from (no secrets)."""
        how = "one per core plus one" if self.auto else "MAGPIE_CHECK_CONCURRENCY or --concurrency"
        return (f"check worker sized: {self.processes} processes x {self.per_process:,} checks = "
                f"{self.slots:,} checks in flight ({how}; {self.cores} cores, open-file limit "
                f"{self.fd_hard:,} per process, {_FD_RESERVE} kept for the rest; override with "
                f"MAGPIE_CHECK_CONCURRENCY and MAGPIE_CHECKS_PER_PROCESS)")


def size_check_worker(per_process: int, processes: int | None = None, *, cores: int | None = None,
                      limits: tuple[int, int] | None = None) -> CheckSizing:
    """Size a check worker from the cores and the open-file limit (pure; nothing is raised or logged).

    Args:
        per_process: wanted checks per process (``MAGPIE_CHECKS_PER_PROCESS``); capped at the hard
            open-file limit less a reserve (each process raises its soft limit to the hard one).
        processes: wanted processes (``MAGPIE_CHECK_CONCURRENCY`` or ``--concurrency``); None: one per
            core plus one (at least 2).
        cores: CPU cores usable by this process (default: its CPU affinity).
        limits: ``(soft, hard)`` ``RLIMIT_NOFILE`` (default: this process's).
    Returns a :class:`CheckSizing`.
    """
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
    soft, hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = hard if hard != resource.RLIM_INFINITY else max(soft, 1_048_576)
    per = max(1, min(int(per_process), ceiling - _FD_RESERVE))
    auto = processes is None
    n = max(2, cores + 1) if auto else int(processes)
    return CheckSizing(n, per, cores, soft, ceiling, auto)
