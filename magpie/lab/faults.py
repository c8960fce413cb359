"""Fault servers for the lab: the ways real published proxies fail, plus a cheap live stand-in, on loopback.

Real proxy lists are mostly dead, and a dead proxy usually costs the checker a whole timeout. These
servers reproduce that locally, cheaply enough that one process can stand in for tens of thousands of
routes (every server accepts any credentials, so :func:`population_lines` can make many distinct routes
through one address).

Layout for ``host_base`` ``127.0.0.H`` and ``base_port`` P (kind *i* listens on ``127.0.0.(H+i):P+i``)::

    i  kind     behaviour                                                   a checker should see
    0  tarpit   accepts, never sends a byte, holds the connection           timeout (read), dead
    1  trickle  reads the request, sends ``HTTP/1.1 200 OK``, then one      total deadline, dead (a
                header byte a second, never ends the headers                per-read timeout never fires)
    2  slow     the echo below, answering after ``slow_delay`` seconds      alive, elite (slow)
    3  echo     lab stand-in that does NOT forward: answers as proxy and    alive, elite
                judge in one hop (see EchoProtocol)
    4  refused  port bound but not listening: connections refused           connection refused, dead

All servers run on one asyncio event loop (uvloop when importable) with bare ``asyncio.Protocol``
handlers: no task and no stream objects per connection. :class:`FaultLab` runs them in a background
thread. The runner ``python -m magpie.lab.faults [--host-base 127.0.0.20] [--base-port P]
[--slow-delay S] [--judge-host H] [--judge-port N]`` runs them in a process of their own, prints one JSON
line ``{"tarpit": "127.0.0.20:P", "trickle": "127.0.0.21:P+1", ..., "refused": "...", "pid": N}`` and
serves until SIGINT/SIGTERM (exit status 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import random
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping

from magpie.lab.forward import _HOP_BY_HOP
from magpie.lab.net import LabError, bindable, wait_accepting
from magpie.routes import PROTOCOLS

KINDS = ("tarpit", "trickle", "slow", "echo", "refused")
"""Fault server kinds, in layout order (kind ``KINDS[i]`` is at ``host_base + i``, ``base_port + i``)."""

EXPECT_ALIVE = {"tarpit": False, "trickle": False, "slow": True, "echo": True, "refused": False}
"""Whether a check through each kind must find the route alive (``slow``: only if the timeout exceeds
its delay)."""

DEFAULT_HOST_BASE = "127.0.0.20"
DEFAULT_SLOW_DELAY = 2.0  # seconds
BACKLOG = 65535  # the kernel caps it at net.core.somaxconn
TRICKLE_INTERVAL = 1.0  # seconds between two trickled bytes
TRICKLE_HEADER = b"X-Trickle: "  # then 'a' forever
START_TIMEOUT = 10.0  # seconds start() waits for every listener
_HEAD_LIMIT = 64 * 1024  # bytes of request head an echo or trickle server reads at most

_RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nServer: magpie-lab-echo\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n"
)


def _error_response(status: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n" % len(status)
    ) + status


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when uvloop is importable, else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (best effort).

    Returns the ``(soft, hard)`` limits in force afterwards (file descriptors).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


# -- protocols --------------------------------------------------------------------------------------


class _Tracked(asyncio.Protocol):
    """Base: registers its transport in a shared set while connected (so stop() can close it)."""

    transport: asyncio.Transport | None = None

    def __init__(self, conns: set) -> None:
        self._conns = conns

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._conns.add(transport)

    def connection_lost(self, exc) -> None:
        self._conns.discard(self.transport)
        self.transport = None


class TarpitProtocol(_Tracked):
    """Accepts, reads and discards whatever arrives, never sends a byte; the connection lives until the
    client closes it. State per connection: this object and its transport.

    Args:
        conns: the server's set of live transports (this connection is in it while open).
    """

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # client half-closed: close our side too


class TrickleProtocol(_Tracked):
    """Reads the request head, sends ``HTTP/1.1 200 OK\\r\\n``, then one byte of an endless header line
    (``X-Trickle: aaaa...``) every :data:`TRICKLE_INTERVAL` seconds until the client closes.

    The bytes are sent by one shared ticker (:class:`_Trickler`), not a timer per connection.

    Args:
        conns: the server's set of live transports.
        trickling: transport -> header bytes sent so far (int), shared with the ticker.
    """

    def __init__(self, conns: set, trickling: dict) -> None:
        super().__init__(conns)
        self._trickling = trickling
        self._buf = bytearray()

    def data_received(self, data: bytes) -> None:
        if self._buf is None:
            return  # already answering: ignore the rest
        self._buf += data
        if b"\r\n\r\n" in self._buf or len(self._buf) > _HEAD_LIMIT:
            self._buf = None
            self.transport.write(b"HTTP/1.1 200 OK\r\n")
            self._trickling[self.transport] = 0

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc) -> None:
        self._trickling.pop(self.transport, None)
        super().connection_lost(exc)


class _Trickler:
    """The trickle server's ticker: every interval, one more header byte to every answered connection."""

    def __init__(self, loop: asyncio.AbstractEventLoop, trickling: dict, interval: float) -> None:
        self._loop = loop
        self._trickling = trickling
        self._interval = interval
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._handle = self._loop.call_later(self._interval, self._tick)

    def _tick(self) -> None:
        n = len(TRICKLE_HEADER)
        for transport, sent in list(self._trickling.items()):
            byte = TRICKLE_HEADER[sent : sent + 1] if sent < n else b"a"
            with contextlib.suppress(Exception):
                transport.write(byte)
            self._trickling[transport] = sent + 1
        self._handle = self._loop.call_later(self._interval, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


# echo protocol states
_START, _S5_GREET, _S5_AUTH, _S5_REQ, _S4_REQ, _HTTP_PROXY, _HTTP_TUNNEL, _DONE = range(8)


class EchoProtocol(_Tracked):
    """Lab stand-in for a live elite proxy: it does NOT forward. It answers the request itself, as proxy
    and judge in one hop, with the JSON body :mod:`magpie.checker.judge` would return through an elite
    proxy (``remote_addr`` = the configured egress address, never the client's 127.0.0.1). Its purpose is
    to measure the checker's own cost per route without a Python forwarding proxy's cost.

    Served per connection (one request, then ``Connection: close`` and close):

    * HTTP proxy: ``GET|HEAD http://<any host>/<path> HTTP/1.x``; hop-by-hop headers, including
      ``Proxy-Authorization``, are dropped (any credentials are accepted) and ``Connection: close`` is
      added, as :class:`magpie.lab.forward.ForwardProxy` would forward it.
    * ``CONNECT host:port`` (any target): ``200``, then one plain HTTP request inside the "tunnel".
    * SOCKS5 (no auth, or username/password with ANY credentials, CONNECT only) and SOCKS4/4a, then one
      plain HTTP request; tunnelled headers reach the echo unchanged.

    Args:
        conns: the server's set of live transports.
        egress: the address reported as ``remote_addr`` (str).
        bind: ``(host, port)`` reported in SOCKS replies.
        delay: seconds to wait before the HTTP answer (the ``slow`` server); 0 answers at once.
        default_host: ``Host`` header value echoed when the request has none (``"host:port"``).
    """

    def __init__(
        self, conns: set, egress: str, bind: tuple[str, int], delay: float = 0.0, default_host: str = ""
    ) -> None:
        super().__init__(conns)
        self._egress = egress
        self._bind = bind
        self._delay = delay
        self._default_host = default_host
        self._buf = b""
        self._state = _START
        self._timer: asyncio.TimerHandle | None = None

    # -- plumbing --

    def data_received(self, data: bytes) -> None:
        if self._state == _DONE:
            return
        self._buf += data
        while self._state != _DONE and self._step():
            pass

    def eof_received(self) -> bool:
        return self._timer is not None  # keep the connection for a pending (delayed) answer

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def _finish(self, data: bytes) -> None:
        self._state = _DONE
        self._buf = b""
        if self.transport is not None:
            self.transport.write(data)
            self.transport.close()  # flushes first

    # -- state machine: each step consumes one message from _buf, or returns False for more bytes --

    def _step(self) -> bool:
        b = self._buf
        st = self._state
        if st == _START:
            if not b:
                return False
            self._state = {5: _S5_GREET, 4: _S4_REQ}.get(b[0], _HTTP_PROXY)
            return True
        if st in (_HTTP_PROXY, _HTTP_TUNNEL):
            return self._http()
        if st == _S5_GREET:
            if len(b) < 2 or len(b) < 2 + b[1]:
                return False
            methods = b[2 : 2 + b[1]]
            method = 2 if 2 in methods else 0 if 0 in methods else 0xFF
            self._buf = b[2 + b[1] :]
            if method == 0xFF:
                self._finish(b"\x05\xff")
                return False
            self.transport.write(bytes((5, method)))
            self._state = _S5_AUTH if method == 2 else _S5_REQ
            return True
        if st == _S5_AUTH:  # RFC 1929; any username and password are accepted, never logged
            if len(b) < 2:
                return False
            ulen = b[1]
            if len(b) < 3 + ulen or len(b) < 3 + ulen + b[2 + ulen]:
                return False
            self._buf = b[3 + ulen + b[2 + ulen] :]
            self.transport.write(b"\x01\x00")
            self._state = _S5_REQ
            return True
        if st == _S5_REQ:
            if len(b) < 5:
                return False
            alen = {1: 4, 4: 16, 3: 1 + b[4]}.get(b[3])
            if alen is None:
                self._finish(b"\x05\x08\x00\x01" + bytes(6))
                return False
            if len(b) < 4 + alen + 2:
                return False
            if b[1] != 1:
                self._finish(b"\x05\x07\x00\x01" + bytes(6))
                return False
            self._buf = b[4 + alen + 2 :]
            host, port = self._bind
            self.transport.write(b"\x05\x00\x00\x01" + socket.inet_aton(host) + port.to_bytes(2, "big"))
            self._state = _HTTP_TUNNEL
            return True
        if st == _S4_REQ:
            if len(b) < 9:
                return False
            end = b.find(b"\x00", 8)  # end of user id
            if end < 0:
                return False
            if b[4:7] == b"\x00\x00\x00" and b[7] != 0:  # SOCKS4a: a host name follows
                end = b.find(b"\x00", end + 1)
                if end < 0:
                    return False
            self._buf = b[end + 1 :]
            if b[1] != 1:
                self._finish(b"\x00\x5b" + bytes(6))
                return False
            self.transport.write(b"\x00\x5a" + b[2:8])
            self._state = _HTTP_TUNNEL
            return True
        return False

    def _http(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _HEAD_LIMIT:
                self._finish(_error_response(b"431 Request Header Fields Too Large"))
            return False
        lines = self._buf[:end].decode("latin-1").split("\r\n")
        rest = self._buf[end + 4 :]
        parts = lines[0].split(" ")
        if len(parts) != 3:
            self._finish(_error_response(b"400 Bad Request"))
            return False
        method, target, _version = parts
        proxied = self._state == _HTTP_PROXY
        if method == "CONNECT" and proxied:
            self._buf = rest
            self.transport.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            self._state = _HTTP_TUNNEL
            return True
        if method not in ("GET", "HEAD"):
            self._finish(_error_response(b"405 Method Not Allowed"))
            return False
        authority = ""
        if target.startswith("/"):
            path = target
        elif target[:7].lower() == "http://":
            slash = target.find("/", 7)
            authority = target[7:slash] if slash >= 0 else target[7:]
            path = target[slash:] if slash >= 0 else "/"
        else:
            self._finish(_error_response(b"400 Bad Request"))
            return False
        headers: dict[str, str] = {}
        seen: dict[str, str] = {}  # lower-case name -> first spelling, as the judge does
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                continue
            name = name.strip()
            lname = name.lower()
            if proxied and lname in _HOP_BY_HOP:
                continue
            key = seen.setdefault(lname, name)
            value = value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        if "host" not in seen and (authority or self._default_host):
            headers["Host"] = authority or self._default_host
        if proxied:
            headers["Connection"] = "close"
        peer_port = (self.transport.get_extra_info("peername") or ("", 0))[1]
        doc = {"remote_addr": self._egress, "remote_port": peer_port, "method": method, "path": path,
               "headers": headers}
        body = json.dumps(doc, separators=(",", ":")).encode()
        reply = (_RESPONSE_HEAD % len(body)) + (body if method == "GET" else b"")
        self._state = _DONE
        self._buf = b""
        if self._delay > 0:
            self._timer = asyncio.get_running_loop().call_later(self._delay, self._delayed, reply)
        else:
            self._finish(reply)
        return False

    def _delayed(self, reply: bytes) -> None:
        self._timer = None
        self._finish(reply)


# -- the lab ----------------------------------------------------------------------------------------


def _hosts(host_base: str) -> list[str]:
    """The five listen addresses starting at ``host_base``; raises ValueError unless all are 127/8."""
    try:
        base = ipaddress.IPv4Address(host_base)
    except ValueError:
        raise ValueError(f"host_base must be an IPv4 address: {host_base!r}") from None
    hosts = [base + i for i in range(len(KINDS))]
    if not all(h.is_loopback for h in hosts) or int(hosts[-1]) & 0xFF == 0xFF:
        raise ValueError(f"host_base {host_base} leaves 127.0.0.0/8 (or hits .255) within {len(KINDS)}")
    return [str(h) for h in hosts]


def find_free_fault_port(host_base: str = DEFAULT_HOST_BASE, lo: int = 20000, hi: int = 40000,
                         tries: int = 200) -> int:
    """A base port P in ``[lo, hi)`` such that every fault address ``host_base+i : P+i`` can be bound now.

    Racy by nature; :func:`start_free_fault_lab` retries. Raises ``RuntimeError`` when none is found.
    """
    hosts = _hosts(host_base)
    for _ in range(tries):
        base = random.randrange(lo, hi - len(KINDS))
        if all(bindable(h, base + i) for i, h in enumerate(hosts)):
            return base
    raise RuntimeError(f"no free block of {len(KINDS)} ports in [{lo}, {hi}) on {host_base}+")


class FaultLab:
    """The five fault servers (module doc) on one event loop in a background thread. A context manager.

    Args:
        host_base: first listen address; kind ``KINDS[i]`` listens on ``host_base + i`` (all in 127/8).
        base_port: kind ``KINDS[i]`` listens on port ``base_port + i``; None picks a free block at start().
        slow_delay: seconds the ``slow`` server waits before answering.
        judge_host / judge_port: the judge the echo servers impersonate; echoed as ``Host`` when a
            request has none (answers never depend on the requested URL otherwise).

    Attributes:
        addresses: kind -> ``"host:port"`` (``{}`` until a port is known).
        conns: kind -> set of its live accepted connections (transports); read it via
            :meth:`connections`.
    """

    def __init__(
        self,
        host_base: str = DEFAULT_HOST_BASE,
        base_port: int | None = None,
        slow_delay: float = DEFAULT_SLOW_DELAY,
        judge_host: str = "127.0.0.1",
        judge_port: int = 8899,
    ) -> None:
        self.hosts = _hosts(host_base)
        if base_port is not None and not 1 <= base_port <= 65535 - len(KINDS):
            raise ValueError(f"base_port out of range: {base_port}")
        if slow_delay < 0:
            raise ValueError(f"slow_delay must be >= 0: {slow_delay}")
        self.host_base = host_base
        self.base_port = base_port
        self.slow_delay = float(slow_delay)
        self.judge_host = judge_host
        self.judge_port = judge_port
        self.conns: dict[str, set] = {k: set() for k in KINDS[:-1]}
        self._trickling: dict = {}
        self._trickler: _Trickler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._refused_sock: socket.socket | None = None

    @property
    def addresses(self) -> dict[str, str]:
        """Kind -> ``"host:port"`` for every kind in :data:`KINDS` (empty while no base port is known)."""
        if self.base_port is None:
            return {}
        return {k: f"{h}:{self.base_port + i}" for i, (k, h) in enumerate(zip(KINDS, self.hosts))}

    def hostport(self, kind: str) -> tuple[str, int]:
        """``(host, port)`` of ``kind``; raises KeyError for an unknown kind, RuntimeError before a port."""
        if self.base_port is None:
            raise RuntimeError("no base port yet: start() the lab first")
        if kind not in KINDS:
            raise KeyError(kind)
        i = KINDS.index(kind)
        return self.hosts[i], self.base_port + i

    def connections(self) -> dict[str, int]:
        """Kind -> number of accepted connections open now (safe from any thread)."""
        return {k: len(s) for k, s in self.conns.items()}

    def _factory(self, kind: str) -> Callable[[], asyncio.Protocol]:
        conns = self.conns[kind]
        if kind == "tarpit":
            return lambda: TarpitProtocol(conns)
        if kind == "trickle":
            return lambda: TrickleProtocol(conns, self._trickling)
        host, port = self.hostport(kind)
        delay = self.slow_delay if kind == "slow" else 0.0
        judge = f"{self.judge_host}:{self.judge_port}"
        return lambda: EchoProtocol(conns, host, (host, port), delay, judge)

    def start(self) -> None:
        """Raise the soft fd limit, bind ``refused``, start the other four; return once all accept.

        Raises :class:`magpie.lab.LabError` naming the address when a port is taken (everything already
        started is stopped again), ``RuntimeError`` when already started.
        """
        if self._loop is not None:
            raise RuntimeError("fault lab already started")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        raise_nofile_limit()
        if self.base_port is None:
            self.base_port = find_free_fault_port(self.host_base)
        host, port = self.hostport("refused")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))  # held, never listening: connections are refused
        except OSError as exc:
            sock.close()
            raise LabError(f"refused port {host}:{port} is in use: {exc}") from None
        self._refused_sock = sock

        self._loop = loop = new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="magpie-lab-faults", daemon=True)
        self._thread.start()
        for kind in KINDS[:-1]:
            host, port = self.hostport(kind)
            coro = loop.create_server(self._factory(kind), host, port, backlog=BACKLOG)
            try:
                self._servers.append(asyncio.run_coroutine_threadsafe(coro, loop).result(START_TIMEOUT))
            except OSError as exc:
                raise LabError(f"{kind} port {host}:{port} is not available: {exc}") from None
        self._trickler = _Trickler(loop, self._trickling, TRICKLE_INTERVAL)
        loop.call_soon_threadsafe(self._trickler.start)
        wait_accepting([(k, *self.hostport(k)) for k in KINDS[:-1]], START_TIMEOUT)

    async def _shutdown(self) -> None:
        if self._trickler is not None:
            self._trickler.stop()
        for s in self._servers:
            s.close()
        for conns in self.conns.values():
            for t in list(conns):
                t.abort()
            conns.clear()
        self._trickling.clear()
        await asyncio.sleep(0)  # let connection_lost callbacks run

    def stop(self) -> None:
        """Close every server and connection, release every port. Idempotent; never raises."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            if thread.is_alive():
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(5.0)
                loop.call_soon_threadsafe(loop.stop)
                thread.join(5.0)
            if not thread.is_alive():
                loop.close()
        self._loop = self._thread = self._trickler = None
        self._servers = []
        if self._refused_sock is not None:
            self._refused_sock.close()
            self._refused_sock = None

    def __enter__(self) -> FaultLab:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_free_fault_lab(host_base: str = DEFAULT_HOST_BASE, slow_delay: float = DEFAULT_SLOW_DELAY,
                         tries: int = 5, **kwargs) -> FaultLab:
    """Start a :class:`FaultLab` on a free port block, retrying up to ``tries`` times when a port is taken
    in between; the caller stops it. ``kwargs`` go to FaultLab. Raises the last LabError."""
    last: LabError | None = None
    for _ in range(tries):
        lab = FaultLab(host_base, None, slow_delay, **kwargs)
        try:
            lab.start()
            return lab
        except LabError as exc:
            last = exc
    assert last is not None
    raise last


# -- populations ------------------------------------------------------------------------------------


def population_lines(address: str, n: int, protocol: str = "http", start: int = 0) -> list[str]:
    """``n`` proxy-list lines for ``n`` distinct routes through the one server at ``address``.

    The routes differ only by user name (``{protocol}://u{i}:x@{address}`` for i in
    ``[start, start + n)``); the route hash covers credentials, so each is a distinct route, and every
    fault server accepts any credentials.

    Args:
        address: ``"host:port"`` (IPv6 bracketed).
        n: number of lines (>= 0).
        protocol: one of :data:`magpie.routes.PROTOCOLS`.
        start: first index; disjoint index ranges give disjoint routes.

    Returns:
        a list of ``n`` str lines without line endings.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if n < 0 or start < 0:
        raise ValueError(f"n and start must be >= 0: {n}, {start}")
    prefix = f"{protocol}://u"
    suffix = f":x@{address}"
    return [f"{prefix}{i}{suffix}" for i in range(start, start + n)]


def mix_counts(n: int, shares: Mapping[str, float]) -> dict[str, int]:
    """Split ``n`` by ``shares`` (non-negative weights, normalised by their sum) into integer counts that
    sum to ``n`` (largest remainder; ties go to the kind listed first)."""
    if n < 0:
        raise ValueError(f"n must be >= 0: {n}")
    if any(w < 0 for w in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError("shares must be non-negative with a positive sum")
    total = sum(shares.values())
    exact = {k: n * w / total for k, w in shares.items()}
    counts = {k: int(v) for k, v in exact.items()}
    order = sorted(shares, key=lambda k: (-(exact[k] - counts[k]), list(shares).index(k)))
    for k in order[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def mix_lines(addresses: Mapping[str, str], n: int, shares: Mapping[str, float],
              protocol: str = "http") -> list[tuple[str, str]]:
    """A deterministic mixed population of ``n`` distinct routes, as ``(kind, line)`` pairs.

    Args:
        addresses: kind -> ``"host:port"`` (e.g. :attr:`FaultLab.addresses`); every kind in ``shares``
            must be present.
        n: total number of routes.
        shares: kind -> weight, e.g. ``{"tarpit": .70, "refused": .10, "echo": .15, "slow": .05}``;
            counts follow :func:`mix_counts`.
        protocol: protocol of every line.

    Returns:
        ``n`` pairs, the kinds spread evenly through the list (any prefix has about the same mix), each
        line from :func:`population_lines` for its kind.
    """
    missing = [k for k in shares if k not in addresses]
    if missing:
        raise KeyError(f"no address for {', '.join(missing)}")
    counts = mix_counts(n, shares)
    slots = []
    for order, (kind, c) in enumerate(counts.items()):
        slots += [((m + 0.5) / c, order, kind) for m in range(c)]
    slots.sort()
    lines = {k: iter(population_lines(addresses[k], c, protocol)) for k, c in counts.items()}
    return [(kind, next(lines[kind])) for _, _, kind in slots]


# -- runner -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m magpie.lab.faults``: start a FaultLab, print its addresses and pid as one JSON line,
    serve until SIGINT/SIGTERM.

    Returns the process exit status (0 after a clean stop, 1 when it cannot start).
    """
    ap = argparse.ArgumentParser(
        prog="python -m magpie.lab.faults", description="Run the lab's fault servers on loopback."
    )
    ap.add_argument("--host-base", default=DEFAULT_HOST_BASE, help="first listen address (5 used)")
    ap.add_argument("--base-port", type=int, default=None, help="first port (5 used); default: a free block")
    ap.add_argument(
        "--slow-delay", type=float, default=DEFAULT_SLOW_DELAY, help="seconds the slow server waits"
    )
    ap.add_argument("--judge-host", default="127.0.0.1", help="judge host the echo servers impersonate")
    ap.add_argument("--judge-port", type=int, default=8899, help="judge port the echo servers impersonate")
    args = ap.parse_args(argv)

    try:
        lab = FaultLab(args.host_base, args.base_port, args.slow_delay, args.judge_host, args.judge_port)
    except ValueError as exc:
        print(f"magpie lab faults: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            lab.start()
        except (LabError, RuntimeError) as exc:
            print(f"magpie lab faults: {exc}", file=sys.stderr)
            return 1
        print(json.dumps({**lab.addresses, "pid": os.getpid()}), flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        lab.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
