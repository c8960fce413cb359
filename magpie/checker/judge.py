"""The judge: an HTTP echo server that reports what a request looked like when it arrived.

Any GET (or HEAD) path is answered with ``200`` and a JSON object::

    {"remote_addr": "127.0.0.7", "remote_port": 40312, "method": "GET", "path": "/x?y",
     "headers": {"Host": "127.0.0.1:8899", "User-Agent": "...", ...}}

Header names keep the case they arrived with; repeated headers are joined with ``", "``. The checker
compares ``remote_addr`` and ``headers`` with its own address to grade a proxy's anonymity.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
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


def run_judge(host: str = "127.0.0.1", port: int = 8899) -> None:
    """Serve a judge on ``host:port`` in the calling thread until SIGINT or SIGTERM.

    Prints the judge URL once listening (SIGTERM is handled only when called from the main thread).
    Raises ``OSError`` when the address is taken.
    """
    server = make_judge_server(host, port)

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    print(f"judge listening on {judge_url_of(server)}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        server.server_close()
        print("judge stopped", file=sys.stderr, flush=True)
