"""A private redis-server on a free loopback port for tests that restart or pause Redis (never the shared
one). Started and stopped by PID; ``--save ""`` so a restart comes back empty."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess

import pytest
import redis
from helpers import TimedOut, wait_until


class PrivateRedis:
    """``start()`` -> client; ``kill()`` (SIGKILL), ``pause()`` / ``resume()`` (SIGSTOP / SIGCONT),
    ``stop()``. The port stays the same across restarts."""

    def __init__(self, tmp_path):
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            pytest.skip("redis-server binary not installed")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = str(tmp_path)
        self.proc: subprocess.Popen | None = None

    def start(self) -> redis.Redis:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)

        def up():
            try:
                return c.ping()
            except redis.ConnectionError:
                return False

        try:
            wait_until(up, timeout=5, interval=0.025, what="the private redis-server")
        except TimedOut:
            self.stop()
            raise RuntimeError("private redis-server did not start") from None
        return c

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.kill()

    @staticmethod
    def wait_until_acquirable(lock, timeout: float = 10.0) -> None:
        """Wait out the quiet period after the server's start (acquires and releases ``lock`` once)."""
        def acquired():
            if lock.acquire():
                lock.release()
                return True
            if lock.refusal != "restarting":
                raise AssertionError(f"lock refused: {lock.refusal}")
            return False

        wait_until(acquired, timeout=timeout, what="the end of the quiet period")
