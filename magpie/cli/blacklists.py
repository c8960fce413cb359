"""Commands for blacklist sources (magpie blacklists)."""

from __future__ import annotations

COMMANDS: list = []
