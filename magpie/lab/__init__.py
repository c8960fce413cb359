"""Local judge and proxy servers on loopback, for demos and tests (``magpie lab``)."""

from magpie.lab.lab import (
    DEFAULT_BASE_PORT,
    DEFAULT_JUDGE_PORT,
    LAB_PASSWORD,
    LAB_USER,
    Lab,
    LabError,
    LabProxy,
    find_free_base_port,
    start_free_lab,
)

__all__ = [
    "DEFAULT_BASE_PORT",
    "DEFAULT_JUDGE_PORT",
    "LAB_PASSWORD",
    "LAB_USER",
    "Lab",
    "LabError",
    "LabProxy",
    "find_free_base_port",
    "start_free_lab",
]
