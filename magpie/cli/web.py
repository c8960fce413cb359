"""Commands for the operator web dashboard (magpie web)."""

from __future__ import annotations

COMMANDS: list = []
