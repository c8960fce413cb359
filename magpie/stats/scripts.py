"""The results stream's Lua scripts, read once per process from ``lua/`` and run by EVALSHA.

The files live with every other script in ``lua/`` (installed as the package ``magpie.lua``, found
through :data:`magpie.queue.scripts.LUA_DIR`). They do not use the schedule prelude ``lib.lua``; the two
that need the replay floor get ``stats_floor.lua`` in front of their own file. A script's text and SHA1
are computed once; Redis keeps a loaded script by its SHA1, so each server is sent the text once (on the
first ``NOSCRIPT``), whichever client calls.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import redis as redis_lib

from magpie.queue.scripts import LUA_DIR


class StreamScript:
    """One script made of the files ``lua/<name>.lua`` of ``names``, in order (prelude first).

    Call it as ``script(client, keys, args)``; the reply is the script's return value as redis-py gives
    it. Raises ``redis.RedisError`` when Redis is unreachable or the script fails, ``OSError`` when a
    file is missing from the installation.
    """

    def __init__(self, *names: str) -> None:
        self.names = names
        self._lock = threading.Lock()
        self._loaded: tuple[str, str] | None = None  # (text, sha1)

    def source(self) -> tuple[str, str]:
        """``(text, sha1 hex)`` of the script as sent to Redis (read from ``lua/`` on first use)."""
        if self._loaded is None:
            with self._lock:
                if self._loaded is None:
                    text = "\n".join((LUA_DIR / f"{n}.lua").read_text(encoding="utf-8") for n in self.names)
                    self._loaded = (text, hashlib.sha1(text.encode("utf-8")).hexdigest())
        return self._loaded

    def __call__(self, client: redis_lib.Redis, keys: Sequence, args: Sequence):
        text, sha = self.source()
        try:
            return client.evalsha(sha, len(keys), *keys, *args)
        except redis_lib.exceptions.NoScriptError:
            client.script_load(text)
            return client.evalsha(sha, len(keys), *keys, *args)


TRIM = StreamScript("stats_floor", "stats_trim")
"""Remove the consumed entries below the replay floor (``lua/stats_trim.lua``)."""

DROP_CONSUMERS = StreamScript("stats_drop_consumers")
"""Delete named consumers that hold no pending entry (``lua/stats_drop_consumers.lua``)."""

INFRA = StreamScript("stats_infra")
"""Read or extend the ingestion's shared "database refuses writes" backoff (``lua/stats_infra.lua``)."""

REDRIVE = StreamScript("stats_redrive")
"""Move dead-lettered entries back into the results stream (``lua/stats_redrive.lua``)."""

ALL = (TRIM, DROP_CONSUMERS, INFRA, REDRIVE)
"""Every script of the results stream (for readiness probes that load them all)."""
