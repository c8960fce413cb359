"""Loopback helpers shared by the lab's servers (:mod:`magpie.lab.lab`, :mod:`magpie.lab.faults`).

The lab's error type lives here too, so the ordinary lab and the fault servers raise the same
:class:`LabError` without importing each other.
"""

from __future__ import annotations

import socket
import subprocess
import time

from magpie.errors import MagpieError


class LabError(MagpieError, RuntimeError):
    """A lab server could not start (e.g. a port is taken); the message names the address."""


def bindable(host: str, port: int) -> bool:
    """True when a TCP socket can bind ``host:port`` now (closed again at once; racy by nature)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_accepting(addrs: list[tuple[str, str, int]], timeout: float) -> None:
    """Block until every ``(name, host, port)`` accepts a TCP connection.

    Args:
        addrs: the listeners to wait for; ``name`` only labels the error message.
        timeout: seconds in all (each connect attempt itself waits at most 1 s).
    Raises :class:`LabError` naming the first listener still refusing when ``timeout`` has passed.
    """
    deadline = time.monotonic() + timeout
    pending = list(addrs)
    while pending:
        name, host, port = pending[0]
        try:
            with socket.create_connection((host, port), timeout=1.0):
                pass
            pending.pop(0)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise LabError(f"{name} on {host}:{port} does not accept connections: {exc}") from None
            time.sleep(0.05)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Stop a process this lab started: SIGTERM, then SIGKILL after ``timeout_s`` seconds; reaped either
    way. A process already ended is only reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
