"""Local judge and proxy servers on loopback, for demos and tests (``magpie lab``).

The lab only ever dials loopback: importing it sets ``MAGPIE_EGRESS_ONLY`` to ``127.0.0.0/8,::1`` for
this process and its children (unless already set) and installs the socket guard (:mod:`magpie.base.egress`).
"""

from magpie.base.egress import restrict_to_loopback

restrict_to_loopback()

from magpie.lab.lab import (  # noqa: E402
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
