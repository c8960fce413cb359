"""Connection handlers of the lab's fault servers (:class:`magpie.lab.faults.FaultLab` serves them).

Bare ``asyncio.Protocol`` handlers, no task and no stream objects per connection, so one event loop can
hold tens of thousands of connections (the tarpit accepts none at all: :mod:`magpie.lab.tarpit`):

* :class:`TrickleProtocol` with its shared ticker :class:`Trickler` - ``HTTP/1.1 200 OK``, then one
  header byte a second, never ending the headers;
* :class:`EchoProtocol` - a live elite proxy stand-in that answers as proxy and judge in one hop
  (optionally after a delay: the ``slow`` server).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

from magpie.lab.forward import _HOP_BY_HOP

TRICKLE_INTERVAL = 1.0  # seconds between two trickled bytes
TRICKLE_HEADER = b"X-Trickle: "  # then 'a' forever
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


class TrickleProtocol(_Tracked):
    """Reads the request head, sends ``HTTP/1.1 200 OK\\r\\n``, then one byte of an endless header line
    (``X-Trickle: aaaa...``) every :data:`TRICKLE_INTERVAL` seconds until the client closes.

    The bytes are sent by one shared ticker (:class:`Trickler`), not a timer per connection.

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


class Trickler:
    """The trickle server's ticker: every ``interval``, one more header byte to every answered connection.

    Args:
        loop: the servers' event loop; :meth:`start` and :meth:`stop` must run on it.
        trickling: transport -> header bytes sent so far, shared with the :class:`TrickleProtocol` handlers.
        interval: seconds between two bytes (:data:`TRICKLE_INTERVAL`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, trickling: dict, interval: float) -> None:
        self._loop = loop
        self._trickling = trickling
        self._interval = interval
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Schedule the first tick one interval from now."""
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
        """Cancel the next tick (idempotent)."""
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
