"""Loads the Lua scripts in ``lua/`` once per client; redis-py runs them by EVALSHA (EVAL on NOSCRIPT)."""

from __future__ import annotations

from pathlib import Path

import redis

LUA_DIR = Path(__file__).resolve().parents[2] / "lua"
NAMES = ("pop", "renew", "complete", "remove", "schedule")


class Scripts:
    """One ``redis.commands.core.Script`` per file in ``lua/``, bound to ``client``."""

    def __init__(self, client: redis.Redis):
        for name in NAMES:
            text = (LUA_DIR / f"{name}.lua").read_text()
            setattr(self, name, client.register_script(text))
