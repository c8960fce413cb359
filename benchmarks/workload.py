"""The schedule benchmarks' shared workload: the Redis URL, the shard count and the route payloads
(``queue_bench.py`` and ``pg_bench.py`` measure the same routes on their backends)."""

from __future__ import annotations

import os
import sys
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only
from magpie.queue import Payload  # noqa: E402
from magpie.routes import Route  # noqa: E402

URL = os.environ.get("MAGPIE_REDIS_URL", "redis://127.0.0.1:6379/0")  # the product's setting
SHARDS = 16


def payload_for(i: int) -> tuple[str, str]:
    """A route hash and a ~150-byte payload (credentials, two workspaces)."""
    h = f"{i:024x}"
    p = Payload(i + 1, Route("socks5", f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}", 1080,
                             "user" + str(i % 997), "pw-" + uuid.UUID(int=i).hex[:20]), h, [1, 2]).encode()
    pad = 150 - len(p)
    if pad > 0:  # stretch the password so every payload is 150 bytes
        p = Payload(i + 1, Route("socks5", f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}", 1080,
                                 "user" + str(i % 997), "pw-" + uuid.UUID(int=i).hex[:20] + "x" * pad), h,
                    [1, 2]).encode()
    return h, p
