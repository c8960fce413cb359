"""Loads the Lua scripts in ``lua/`` once per client; redis-py runs them by EVALSHA (EVAL on NOSCRIPT).

Each script is ``lua/lib.lua`` (shared helpers and the eight schedule keys) followed by the script's
own file, so every transition stays one atomic script.
"""

from __future__ import annotations

from pathlib import Path

import redis

LUA_DIR = Path(__file__).resolve().parents[2] / "lua"
NAMES = (
    "pop", "renew", "complete", "complete_payload", "retry", "remove", "progress", "log", "schedule",
    "enqueue_at", "reprocess", "admin_remove", "update", "respread", "drain", "obliterate", "release",
)


def script_text(name: str) -> str:
    """Full text of script ``name`` as sent to Redis (prelude + body)."""
    return (LUA_DIR / "lib.lua").read_text() + "\n" + (LUA_DIR / f"{name}.lua").read_text()


class Scripts:
    """One ``redis.commands.core.Script`` per name in :data:`NAMES`, bound to ``client``."""

    def __init__(self, client: redis.Redis):
        for name in NAMES:
            setattr(self, name, client.register_script(script_text(name)))
