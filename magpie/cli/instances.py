"""Commands for live process instances (magpie instances)."""

from __future__ import annotations

COMMANDS: list = []
