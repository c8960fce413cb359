"""The lab's tarpit: listening sockets that never accept, and a reaper that keeps their queues from filling.

A real dead proxy that accepts and never answers costs its checker a whole timeout, and costs the proxy
nothing. The lab's stand-in should cost as little: a :class:`TarpitListener` is a listening socket whose
process never calls ``accept()`` for a client. The kernel completes the TCP handshake and queues the
connection (and the request bytes the client sends) in the listener's accept queue; the client waits for
an answer that never comes. The lab process holds one fd per listener, not one per connection, and runs
no code per connection.

The accept queue is bounded by the listen backlog, which the kernel caps at ``net.core.somaxconn``
(4096 here). A connection stays queued until it is accepted, even after its client closed or reset it,
so a listener that never accepts fills up for good; once full, the kernel drops new handshakes
(``ListenOverflows``/``ListenDrops`` in ``/proc/net/netstat``) and clients see a connect timeout instead.
Hence two measures:

* several listening ports per lab, so the queues hold the connections in flight at the wanted rate
  (``attempts * timeout * connections per second``; about 45,000 for a million routes, 70 % tarpits, on
  a 300 s interval with 2 x 10 s attempts);
* a :class:`Reaper` on the lab's event loop that reads each listener's queue length every
  :data:`REAP_INTERVAL` seconds with ``getsockopt(TCP_INFO)`` (for a LISTEN socket Linux reports the
  current accept-queue length in ``tcpi_unacked`` and its maximum in ``tcpi_sacked``) and, when a queue
  passes :data:`REAP_HIGH` of its maximum, accepts and at once closes (abortive close, no ``TIME_WAIT``)
  its oldest connections down to :data:`REAP_LOW`. The queue is FIFO, so at realistic rates those
  clients gave up long ago; the reaper counts those it found still open (``reaped_waiting``): a
  non-zero count means the lab had too few ports and cut live checks short.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

from magpie.lab.net import LabError

BACKLOG = 65535  # the kernel caps it at net.core.somaxconn
REAP_INTERVAL = 0.25  # seconds between two looks at the queues
REAP_HIGH = 0.85  # reap once a queue holds more than this share of its maximum ...
REAP_LOW = 0.70  # ... down to this share

_TCP_INFO_LEN = 32  # bytes read: tcpi_state ... tcpi_sacked
_TCP_ESTABLISHED = 1
_LINGER_ABORT = struct.pack("ii", 1, 0)


def queue_info(sock: socket.socket) -> tuple[int, int]:
    """``(queued, maximum)`` connections of a LISTEN socket's accept queue, from ``TCP_INFO`` (Linux).

    Raises ``OSError`` when the socket is closed or the platform has no ``TCP_INFO``.
    """
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    return struct.unpack_from("II", raw, 24)


def somaxconn(default: int = 4096) -> int:
    """``net.core.somaxconn`` (the cap on a listen backlog), or ``default`` when it cannot be read."""
    try:
        with open("/proc/sys/net/core/somaxconn") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return default


class TarpitListener:
    """One listening socket that never accepts a client (module doc). Not thread-safe: :meth:`reap`
    runs on the lab's event loop.

    Args:
        host / port: where to listen (port 0: the OS picks one; :attr:`port` then holds it).
        backlog: listen backlog (the kernel caps it at ``net.core.somaxconn``).

    Attributes:
        reaped: connections the reaper accepted and closed so far.
        reaped_waiting: those of them whose client had not closed yet.
    Raises :class:`magpie.lab.LabError` naming the address when it cannot listen.
    """

    def __init__(self, host: str, port: int, backlog: int = BACKLOG) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            raise LabError(f"tarpit port {host}:{port} is not available: {exc}") from None
        sock.setblocking(False)
        self.sock = sock
        self.host = host
        self.port = sock.getsockname()[1]
        self.reaped = 0
        self.reaped_waiting = 0

    @property
    def address(self) -> str:
        """``"host:port"`` of the listener."""
        return f"{self.host}:{self.port}"

    def queue(self) -> tuple[int, int]:
        """``(queued, maximum)`` of the accept queue; ``(0, 0)`` once closed."""
        try:
            return queue_info(self.sock)
        except OSError:
            return 0, 0

    def reap(self, high: float = REAP_HIGH, low: float = REAP_LOW) -> int:
        """When more than ``high`` of the queue's maximum is queued, accept and close the oldest
        connections until at most ``low`` of it is. Returns the number closed (0 when under ``high``)."""
        queued, maximum = self.queue()
        if maximum <= 0 or queued <= high * maximum:
            return 0
        n = 0
        for _ in range(queued - int(low * maximum)):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # e.g. out of fds: try again at the next look
                break
            with contextlib.suppress(OSError):
                if conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_ESTABLISHED:
                    self.reaped_waiting += 1
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ABORT)
            conn.close()
            n += 1
        self.reaped += n
        return n

    def close(self) -> None:
        """Close the listener; the kernel drops every queued connection (their clients see a reset)."""
        self.sock.close()


class Reaper:
    """Runs :meth:`TarpitListener.reap` for every listener every ``interval`` seconds on ``loop``.

    Args:
        loop: the lab's event loop; :meth:`start` and :meth:`stop` must run on it.
        listeners: the tarpit listeners to watch.
        interval: seconds between two looks (:data:`REAP_INTERVAL`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, listeners: list[TarpitListener],
                 interval: float = REAP_INTERVAL) -> None:
        self._loop = loop
        self._listeners = listeners
        self._interval = interval
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Schedule the first look one interval from now."""
        self._handle = self._loop.call_later(self._interval, self._tick)

    def _tick(self) -> None:
        for listener in self._listeners:
            listener.reap()
        self._handle = self._loop.call_later(self._interval, self._tick)

    def stop(self) -> None:
        """Cancel the next look (idempotent)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def tarpit_stats(listeners: list[TarpitListener]) -> dict[str, int]:
    """Totals over ``listeners``: ``listeners``, ``queued`` (now), ``capacity`` (sum of maxima),
    ``peak_queued_share_pct`` (fullest queue now, % of its maximum), ``reaped``, ``reaped_waiting``."""
    queued = capacity = 0
    fullest = 0.0
    for listener in listeners:
        q, m = listener.queue()
        queued += q
        capacity += m
        if m:
            fullest = max(fullest, q / m)
    return {"listeners": len(listeners), "queued": queued, "capacity": capacity,
            "peak_queued_share_pct": int(round(100 * fullest)),
            "reaped": sum(x.reaped for x in listeners),
            "reaped_waiting": sum(x.reaped_waiting for x in listeners)}
