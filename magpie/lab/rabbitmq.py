"""Throwaway RabbitMQ vhosts for tests, the fault suite and benchmarks (``rabbitmqctl``, no management plugin).

:class:`Vhost` creates ``magpie-test-<random>`` on the local RabbitMQ node, grants the ``guest`` user all
permissions on it and deletes it (and with it every queue and exchange in it) afterwards. It never
touches another vhost or user.

    with Vhost() as vh:                  # raises RabbitUnavailable when RabbitMQ is not reachable
        url = vh.url                     # amqp://guest:guest@127.0.0.1:5672/magpie-test-1a2b3c4d
        vh.queue_types()                 # {"checks": "quorum", ...}
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import uuid
from urllib.parse import quote

from magpie.errors import MagpieError

HOST = "127.0.0.1"
PORT = 5672
USER = "guest"
PASSWORD = "guest"
CTL_TIMEOUT_S = 60.0


class RabbitUnavailable(MagpieError, RuntimeError):
    """RabbitMQ is not reachable (nothing on the port, or no working ``rabbitmqctl``)."""


def reachable(host: str = HOST, port: int = PORT, timeout: float = 1.0) -> bool:
    """True when something accepts TCP connections on ``host:port`` (timeout in seconds)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def ctl(*args: str, timeout: float = CTL_TIMEOUT_S) -> str:
    """Run ``rabbitmqctl -q <args>`` and return its standard output.

    Raises :class:`RabbitUnavailable` when the command is missing, times out (``timeout`` s) or fails."""
    exe = shutil.which("rabbitmqctl")
    if exe is None:
        raise RabbitUnavailable("rabbitmqctl is not installed")
    try:
        done = subprocess.run([exe, "-q", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RabbitUnavailable(f"rabbitmqctl {args[0]} took more than {timeout:g}s") from None
    if done.returncode != 0:
        raise RabbitUnavailable(f"rabbitmqctl {args[0]} failed: {(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout


class Vhost:
    """A vhost of its own on the local RabbitMQ, created by :meth:`create`, deleted by :meth:`delete`.

    Args:
        prefix: the vhost's name starts with it (a random 8-hex suffix follows).
    Attributes:
        name: the vhost's name; url: ``amqp://guest:guest@127.0.0.1:5672/<name>``.
    """

    def __init__(self, prefix: str = "magpie-test-") -> None:
        self.name = f"{prefix}{uuid.uuid4().hex[:8]}"
        self.url = f"amqp://{USER}:{PASSWORD}@{HOST}:{PORT}/{quote(self.name, safe='')}"
        self.created = False

    def create(self) -> "Vhost":
        """Add the vhost and give ``guest`` configure/write/read on it; raises :class:`RabbitUnavailable`."""
        if not reachable():
            raise RabbitUnavailable(f"RabbitMQ is not reachable on {HOST}:{PORT}")
        ctl("add_vhost", self.name)
        self.created = True
        ctl("set_permissions", "-p", self.name, USER, ".*", ".*", ".*")
        return self

    def delete(self) -> None:
        """Delete the vhost (its queues, exchanges and bindings go with it). Never raises."""
        if self.created:
            try:
                ctl("delete_vhost", self.name)
                self.created = False
            except RabbitUnavailable:
                pass

    def queue_types(self) -> dict[str, str]:
        """Queue name -> type (``quorum``, ``classic``, ``stream``) of every queue in the vhost."""
        out: dict[str, str] = {}
        for line in ctl("list_queues", "-p", self.name, "--no-table-headers", "name", "type").splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = parts[1]
        return out

    def close_connections(self, why: str = "magpie fault test") -> None:
        """Close every client connection to this vhost (as a broker restart would, for its clients)."""
        ctl("close_all_connections", "-p", self.name, why)

    def __enter__(self) -> "Vhost":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.delete()
