"""Commands for judge pools and check profiles (magpie judges, magpie profiles)."""

from __future__ import annotations

COMMANDS: list = []
