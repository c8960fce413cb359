"""The judge: an HTTP echo server that reports what a request looked like when it arrived.

Any GET (or HEAD) path is answered with ``200`` and a JSON object::

    {"remote_addr": "127.0.0.7", "remote_port": 40312, "method": "GET", "path": "/x?y",
     "headers": {"Host": "127.0.0.1:8899", "User-Agent": "...", ...}}

Header names keep the case they arrived with; repeated headers are joined with ``", "``. The checker
compares ``remote_addr`` and ``headers`` with its own address to grade a proxy's anonymity.

Two servers give the same answers: :class:`JudgeProtocol` on an event loop (:func:`start_judge`; what
:func:`run_judge`, ``magpie judge`` and the lab run, on uvloop: no thread per connection), and the
threaded :class:`JudgeServer` (:func:`make_judge_server`; its socket can be wrapped in TLS by a test).
Both serve one request per connection (HTTP/1.0) and then close it.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JudgeHandler(BaseHTTPRequestHandler):
    """Answers every GET/HEAD with the JSON echo of the request; request logging is silenced."""

    server_version = "magpie-judge/1"
    sys_version = ""

    def _echo(self) -> bytes:
        headers: dict[str, str] = {}
        seen: dict[str, str] = {}  # lower-case name -> first spelling
        for name, value in self.headers.items():
            key = seen.setdefault(name.lower(), name)
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        host, port = self.client_address[:2]
        doc = {
            "remote_addr": host,
            "remote_port": port,
            "method": self.command,
            "path": self.path,
            "headers": headers,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    def _reply(self, send_body: bool) -> None:
        body = self._echo()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        self._reply(True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._reply(False)

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


class JudgeServer(ThreadingHTTPServer):
    """Threaded echo server; one daemon thread per connection."""

    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        pass  # a client hanging up mid-request is not worth a traceback


class _JudgeServer6(JudgeServer):
    address_family = socket.AF_INET6


def make_judge_server(host: str = "127.0.0.1", port: int = 0) -> JudgeServer:
    """Bind a judge on ``host:port`` (``port=0``: the OS picks one) without serving yet.

    The caller runs ``server.serve_forever()`` (usually in a thread) and later ``server.shutdown()`` and
    ``server.server_close()``. ``server.server_address[1]`` is the bound port. An IPv6 ``host`` (``"::1"``)
    binds an IPv6 socket. Raises ``OSError`` when the address is taken.
    """
    cls = _JudgeServer6 if ":" in host else JudgeServer
    return cls((host, port), JudgeHandler)


def judge_url_of(server: JudgeServer) -> str:
    """``http://host:port/`` of a bound judge (IPv6 hosts bracketed)."""
    host, port = server.server_address[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


# -- the judge on an event loop --------------------------------------------------------------------

_HEAD_LIMIT = 64 * 1024  # bytes of request head read at most
IDLE_TIMEOUT = 60.0  # seconds a connection may take to send its request head
_date_cache: tuple[int, bytes] = (0, b"")


def _http_date() -> bytes:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True).encode())
    return _date_cache[1]


def _head(status: bytes, content_type: bytes, length: int) -> bytes:
    return (b"HTTP/1.0 " + status + b"\r\nServer: magpie-judge/1\r\nDate: " + _http_date()
            + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: %d\r\n" % length
            + b"Cache-Control: no-store\r\nConnection: close\r\n\r\n")


class JudgeProtocol(asyncio.Protocol):
    """The judge as a bare ``asyncio.Protocol``: reads one request head, answers as :class:`JudgeHandler`
    does (``200`` with the JSON echo for GET/HEAD; ``501`` for another method, ``400`` for a malformed
    request line, ``431`` past 64 KiB of head), then closes. A client that sends no complete head within
    :data:`IDLE_TIMEOUT` seconds is disconnected."""

    def __init__(self) -> None:
        self._buf = b""
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(IDLE_TIMEOUT, transport.abort)

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None

    def data_received(self, data: bytes) -> None:
        if self._buf is None or self._transport is None:
            return
        self._buf += data
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _HEAD_LIMIT:
                self._answer(b"431 Request Header Fields Too Large", b"text/plain", b"")
            return
        self._respond(self._buf[:end].decode("latin-1").split("\r\n"))

    def _respond(self, lines: list[str]) -> None:
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self._answer(b"400 Bad Request", b"text/plain", b"")
            return
        method, path, _ = parts
        if method not in ("GET", "HEAD"):
            self._answer(b"501 Unsupported method", b"text/plain", b"")
            return
        headers: dict[str, str] = {}
        seen: dict[str, str] = {}  # lower-case name -> first spelling
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                continue
            key = seen.setdefault(name.lower(), name)
            value = value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        peer = self._transport.get_extra_info("peername") or ("", 0)
        doc = {"remote_addr": peer[0], "remote_port": peer[1], "method": method, "path": path,
               "headers": headers}
        body = json.dumps(doc, separators=(",", ":")).encode()
        self._answer(b"200 OK", b"application/json", body if method == "GET" else b"", len(body))

    def _answer(self, status: bytes, content_type: bytes, body: bytes, length: int | None = None) -> None:
        self._buf = None
        t = self._transport
        if t is not None:
            t.write(_head(status, content_type, len(body) if length is None else length) + body)
            t.close()  # flushes first


async def start_judge(host: str = "127.0.0.1", port: int = 0, backlog: int = 4096) -> asyncio.AbstractServer:
    """Serve :class:`JudgeProtocol` on ``host:port`` (``port=0``: the OS picks one) on the running loop.

    Returns the listening ``asyncio.Server`` (``server.sockets[0].getsockname()[1]`` is the port; the
    caller closes it). Raises ``OSError`` when the address is taken.
    """
    loop = asyncio.get_running_loop()
    return await loop.create_server(JudgeProtocol, host, port, backlog=backlog, reuse_address=True)


def server_url(server: asyncio.AbstractServer) -> str:
    """``http://host:port/`` of a server from :func:`start_judge` (IPv6 hosts bracketed)."""
    host, port = server.sockets[0].getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


class JudgeThread:
    """A :func:`start_judge` judge on its own event loop (uvloop) in a daemon thread.

    Args:
        host / port: where to listen (``port=0``: the OS picks one).
    Attributes:
        url: ``http://host:port/``; port: the bound port.
    Raises ``OSError`` when the address is taken (the thread is stopped again).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        from magpie.checker.check import LoopThread

        self._loop = LoopThread("magpie-judge")
        try:
            self._server = self._loop.run(start_judge(host, port), 10.0)
        except BaseException:
            self._loop.stop()
            raise
        self.url = server_url(self._server)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Close the listener and stop the loop's thread (idempotent)."""
        if self._server is not None:
            self._loop.loop.call_soon_threadsafe(self._server.close)
            self._server = None
            self._loop.stop()


def run_judge(host: str = "127.0.0.1", port: int = 8899) -> None:
    """Serve a judge on ``host:port`` in the calling thread until SIGINT or SIGTERM, on uvloop
    (:func:`magpie.checker.check.new_event_loop`).

    Prints the judge URL once listening (signals are handled only when called from the main thread).
    Raises ``OSError`` when the address is taken.
    """
    from magpie.checker.check import new_event_loop

    loop = new_event_loop()
    in_main = threading.current_thread() is threading.main_thread()
    try:
        server = loop.run_until_complete(start_judge(host, port))
        if in_main:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, loop.stop)
        print(f"judge listening on {server_url(server)}", flush=True)
        try:
            loop.run_forever()
        except KeyboardInterrupt:
            pass
        finally:
            if in_main:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
            server.close()  # open connections die with the loop
            print("judge stopped", file=sys.stderr, flush=True)
    finally:
        loop.close()
