"""The schedule benchmarks' shared workload: the Redis URL, the shard count and the route payloads
(``queue_bench.py`` and ``pg_bench.py`` measure the same routes on their backends), and a private
``redis-server`` (:class:`PrivateRedis`, used by ``sizing.py`` and ``queue_bench.py --cluster``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import redis

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only
from magpie.lab.net import stop_process  # noqa: E402
from magpie.queue import Payload  # noqa: E402
from magpie.base.routes import Route  # noqa: E402

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


class PrivateRedis:
    """A ``redis-server`` on a free loopback port in a temporary directory, stopped by PID (:meth:`stop`).

    ``aof``: AOF with ``appendfsync everysec`` (else no persistence); ``noeviction``. :attr:`client` is a
    plain client, :attr:`url` its ``redis://`` URL. Raises ``SystemExit`` (one line) when ``redis-server``
    is not installed or does not answer within 10 s."""

    def __init__(self, aof: bool = False):
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server not installed (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="magpie-bench-")
        argv = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", self.dir,
                "--maxmemory-policy", "noeviction"]
        argv += (["--appendonly", "yes", "--appendfsync", "everysec", "--auto-aof-rewrite-percentage", "0"]
                 if aof else ["--appendonly", "no"])
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise SystemExit("private redis-server did not start") from None
                time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
