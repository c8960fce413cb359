"""File-descriptor limits: one check holds one socket, so the descriptor limit bounds checks in flight."""

from __future__ import annotations

import logging
import math
import os
import resource
from dataclasses import dataclass

log = logging.getLogger(__name__)

_FD_RESERVE = 256  # descriptors kept free for Redis, the broker, logs and the interpreter, at least


def fd_reserve(limit: int) -> int:
    """Descriptors a check process keeps free under an open-file ``limit``: 256, or 5 % of the limit when
    that is more. Beyond the process's own connections, a tarpit check opens its second attempt's socket
    before the loop has closed the first one's, and thousands of attempts time out in one wave."""
    return max(_FD_RESERVE, int(limit) // 20)

PER_PROCESS_MAX = 20_000
"""Checks per process when ``MAGPIE_CHECKS_PER_PROCESS`` is unset, if the open-file limit allows (one event
loop keeps its latency at this many checks in flight)."""

SLOTS_PER_CORE = 25_000
"""Checks in flight an automatically sized check worker aims at per core. A core runs about 3,000 checks a
second, and on a list that is mostly dead most of them wait out a timeout of 10-20 s."""

PROCESSES_PER_CORE_MAX = 4
"""Most processes per core the automatic sizing adds when a low open-file limit caps each process."""


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


def checks_within_fd_limit(wanted: int | None, *, reserve: int = _FD_RESERVE,
                           setting: str = "MAGPIE_CHECKS_PER_PROCESS") -> int:
    """Concurrent checks this process can run: ``wanted`` capped below the descriptor limit.

    Raises the soft ``RLIMIT_NOFILE`` toward the hard limit first (one check holds one socket). When the
    limit is still too low for a wanted number, logs one warning naming ``setting`` and the limits, and
    returns the cap (at least 1). Args: ``wanted`` >= 1 checks, or None for the default
    (:data:`PER_PROCESS_MAX` or the cap, whichever is lower, without a warning); ``reserve`` descriptors
    kept for everything else, at least :func:`fd_reserve` of the limit.
    """
    soft, hard = raise_nofile_limit()
    cap = max(1, soft - max(reserve, fd_reserve(soft)))
    if wanted is None:
        return min(PER_PROCESS_MAX, cap)
    if wanted > cap:
        log.warning("%s=%d exceeds the file-descriptor limit (soft %d, hard %d); running at most %d checks "
                    "at once in this process", setting, wanted, soft, hard, cap)
        return cap
    return wanted


@dataclass(frozen=True, slots=True)
class CheckSizing:
    """How a check worker is sized: ``processes`` Celery processes of ``per_process`` checks each.

    ``cores`` and the open-file limits (``fd_soft``, ``fd_hard``, per process) are what it was sized from;
    ``auto`` is True when the process count was chosen here, not by the operator; ``auto_per_process``
    likewise for the checks per process.
    """

    processes: int
    per_process: int
    cores: int
    fd_soft: int
    fd_hard: int
    auto: bool
    auto_per_process: bool = False

    @property
    def slots(self) -> int:
        """Checks in flight the worker can hold: ``processes * per_process``."""
        return self.processes * self.per_process

    def describe(self) -> str:
        """One log line naming the sizing and where it came from (no secrets)."""
        if not self.auto:
            how = "MAGPIE_CHECK_CONCURRENCY or --concurrency"
        elif self.processes > max(2, self.cores + 1):
            how = f"enough processes for {SLOTS_PER_CORE:,} checks per core under the open-file limit"
        else:
            how = "one per core plus one"
        per = (f"checks per process: the open-file limit less {fd_reserve(self.fd_hard):,}, at most "
               f"{PER_PROCESS_MAX:,}"
               if self.auto_per_process else "checks per process: MAGPIE_CHECKS_PER_PROCESS")
        return (f"check worker sized: {self.processes} processes x {self.per_process:,} checks = "
                f"{self.slots:,} checks in flight ({how}; {per}; {self.cores} cores, open-file limit "
                f"{self.fd_hard:,} per process; override with MAGPIE_CHECK_CONCURRENCY and "
                f"MAGPIE_CHECKS_PER_PROCESS)")


def size_check_worker(per_process: int | None, processes: int | None = None, *, cores: int | None = None,
                      limits: tuple[int, int] | None = None) -> CheckSizing:
    """Size a check worker from the cores and the open-file limit (pure; nothing is raised or logged).

    Args:
        per_process: wanted checks per process (``MAGPIE_CHECKS_PER_PROCESS``), or None: the hard open-file
            limit less a reserve (:func:`fd_reserve`), at most :data:`PER_PROCESS_MAX`. A wanted number is
            capped the same way (each process raises its soft limit to the hard one).
        processes: wanted processes (``MAGPIE_CHECK_CONCURRENCY`` or ``--concurrency``); None: one per
            core plus one (at least 2), more when the open-file limit (not a wanted ``per_process``) keeps
            them under :data:`SLOTS_PER_CORE` x cores in all, up to :data:`PROCESSES_PER_CORE_MAX` per core.
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
    cap = max(1, ceiling - fd_reserve(ceiling))
    per = min(cap, PER_PROCESS_MAX if per_process is None else max(1, int(per_process)))
    auto = processes is None
    if auto:
        wanted = math.ceil(SLOTS_PER_CORE * cores / min(cap, PER_PROCESS_MAX))  # only the limit adds any
        n = max(2, cores + 1, min(wanted, PROCESSES_PER_CORE_MAX * cores))
    else:
        n = int(processes)
    return CheckSizing(n, per, cores, soft, ceiling, auto, per_process is None)
