"""Loads the Lua scripts in ``lua/`` once per client; redis-py runs them by EVALSHA (EVAL on NOSCRIPT).

Each script is ``lua/lib.lua`` (shared helpers and the schedule keys) followed by the script's
own file, so every transition stays one atomic script.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import redis


def _lua_dir():
    """The scripts' folder: the installed ``magpie.lua`` package, or ``lua/`` of a source tree on sys.path."""
    try:
        return resources.files("magpie.lua")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "lua"


LUA_DIR = _lua_dir()
NAMES = (
    "pop", "renew", "complete", "retry", "remove", "progress", "log", "schedule",
    "enqueue_at", "reprocess", "admin_remove", "update", "respread", "drain", "obliterate", "release",
    "respread_batch", "crashed", "cadence",
)


PRELUDES = {"complete": ("lib", "stats_floor")}
"""Scripts whose preludes differ from the default ``lib.lua`` (completion also appends to the stream)."""


def script_text(name: str) -> str:
    """Full text of script ``name`` as sent to Redis (preludes + body)."""
    parts = PRELUDES.get(name, ("lib",)) + (name,)
    return "\n".join((LUA_DIR / f"{p}.lua").read_text(encoding="utf-8") for p in parts)


class Scripts:
    """One ``redis.commands.core.Script`` per name in :data:`NAMES`, bound to ``client``."""

    def __init__(self, client: redis.Redis):
        for name in NAMES:
            setattr(self, name, client.register_script(script_text(name)))
