"""A poison route: a lab server whose every connection kills the process that made it.

Real poison inputs crash the worker process handling them (a parser bug, a native library abort, the
memory limit), and every other check in that process dies with it. :class:`PoisonServer` reproduces that
without touching magpie's code: on each accepted connection it finds the connecting process from the
socket's peer address (``psutil.net_connections`` on loopback) and SIGKILLs it, but only when that
process is one of the harness's own (``allowed()``). ``claims`` counts the connections, i.e. the checks
started through the route (one attempt per check).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable

import psutil


class PoisonServer:
    """Listens on ``host`` (a free port); see the module doc.

    Args:
        host: loopback address to listen on.
        allowed: returns the PIDs the server may kill (the harness's processes, read per connection).
    Attributes:
        address: ``"host:port"``; claims: connections accepted; kills: processes killed.
    """

    def __init__(self, host: str, allowed: Callable[[], set[int]]) -> None:
        self.allowed = allowed
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.claims = 0
        self.kills = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="chaos-poison", daemon=True)
        self._thread.start()

    def _owner(self, peer: tuple[str, int], pids: set[int]) -> int | None:
        """The process among ``pids`` holding the client end ``peer`` (only those are scanned: a scan of
        every process on a loaded machine can outlast the client's connect timeout)."""
        for pid in pids:
            try:
                conns = psutil.Process(pid).net_connections(kind="tcp4")
            except psutil.Error:
                continue
            if any(c.laddr and (c.laddr.ip, c.laddr.port) == peer for c in conns):
                return pid
        return None

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.claims += 1
            try:
                pid = self._owner(peer, self.allowed())
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    self.kills += 1
            except (ProcessLookupError, psutil.Error):
                pass
            finally:
                conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
