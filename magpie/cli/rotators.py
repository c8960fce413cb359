"""Commands for rotating listeners (magpie rotators, magpie rotator)."""

from __future__ import annotations

COMMANDS: list = []
