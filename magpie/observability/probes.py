"""The metrics server's HTTP side: ``/metrics``, ``/livez`` and ``/readyz`` on one threaded WSGI server.

* ``/metrics``: the Prometheus text format of a registry (``prometheus_client.make_wsgi_app``).
* ``/livez``: ``200 ok`` while the process serves HTTP; it reads nothing (a liveness probe restarts a
  process, so it must not fail because Redis or PostgreSQL is down).
* ``/readyz``: :func:`magpie.observability.health.check_health`, ready when the Redis, PostgreSQL and broker probes
  pass: ``200`` or ``503`` with a JSON body ``{"ready": bool, "checks": {name: {"ok", "detail", "ms"}}}``
  (details with URL passwords masked). One probe run at a time; its answer is reused for
  :data:`READY_CACHE_S` seconds so that many probers cost one run.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from magpie.base.redact import mask_url_passwords

READY_PROBES = ("redis", "postgres", "broker")
"""The probes of :func:`magpie.observability.health.check_health` that decide ``/readyz``."""

READY_CACHE_S = 1.0
"""Seconds one readiness answer is reused."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *_args) -> None:  # probes every few seconds: no access log
        pass


class Readiness:
    """Readiness of a deployment from its settings, computed at most once per :data:`READY_CACHE_S`.

    Args:
        settings: :class:`magpie.config.Settings`.
        probe: ``settings -> check_health``-shaped dict (default :func:`magpie.observability.health.check_health`).
    """

    def __init__(self, settings, probe: Callable[[object], dict] | None = None):
        self.settings = settings
        self._probe = probe
        self._lock = threading.Lock()
        self._last: tuple[float, dict] | None = None

    def __call__(self) -> dict:
        """``{"ready": bool, "checks": {name: {"ok": bool, "detail": str, "ms": float}}}`` for the
        :data:`READY_PROBES` only. Never raises."""
        with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < READY_CACHE_S:
                return self._last[1]
            answer = self._run()
            self._last = (time.monotonic(), answer)
            return answer

    def _run(self) -> dict:
        probe = self._probe
        if probe is None:
            from magpie.observability.health import check_health as probe
        try:
            rep = probe(self.settings)
        except Exception as exc:  # noqa: BLE001 - a probe that breaks is a "not ready" with its reason
            detail = mask_url_passwords(f"{exc.__class__.__name__}: {exc}".splitlines()[0])
            return {"ready": False, "checks": {"probe": {"ok": False, "detail": detail, "ms": 0.0}}}
        checks = {}
        for name in READY_PROBES:
            c = rep.get("checks", {}).get(name) or {"ok": False, "detail": "not probed", "ms": 0.0}
            checks[name] = {"ok": bool(c["ok"]), "detail": mask_url_passwords(str(c["detail"])),
                            "ms": c.get("ms", 0.0)}
        return {"ready": all(c["ok"] for c in checks.values()), "checks": checks}


def make_app(registry, readiness: Callable[[], dict]):
    """The WSGI application: ``/metrics`` from ``registry``, ``/livez``, ``/readyz`` from ``readiness``
    (a callable returning :meth:`Readiness.__call__`'s shape); any other path is ``404``."""
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if path == "/livez":
            return _reply(start_response, "200 OK", b"ok\n", "text/plain; charset=utf-8")
        if path == "/readyz":
            rep = readiness()
            status = "200 OK" if rep["ready"] else "503 Service Unavailable"
            return _reply(start_response, status, json.dumps(rep).encode() + b"\n", "application/json")
        if path in ("/metrics", "/"):
            return metrics(environ, start_response)
        return _reply(start_response, "404 Not Found", b"not found: try /metrics, /livez or /readyz\n",
                      "text/plain; charset=utf-8")

    return app


def _reply(start_response, status: str, body: bytes, ctype: str):
    start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body))),
                            ("Cache-Control", "no-store")])
    return [body]


def start_server(app, host: str, port: int):
    """Serve ``app`` on ``host:port`` (IPv4 or IPv6) from a daemon thread.

    Returns:
        ``(server, thread)``; ``server.server_port`` is the bound port (useful with ``port=0``); stop
        with ``server.shutdown(); server.server_close()``.
    Raises:
        OSError: the address is in use or cannot be bound.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_cls = type("MagpieMetricsServer", (_Server,), {"address_family": family})
    server = make_server(host, port, app, server_class=server_cls, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="magpie-metrics", daemon=True)
    thread.start()
    return server, thread


__all__ = ["READY_CACHE_S", "READY_PROBES", "Readiness", "make_app", "start_server"]
