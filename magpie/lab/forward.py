"""A small asyncio HTTP forward proxy for the lab, with a configurable header policy and delay.

It serves absolute-form requests (``GET http://host:port/path HTTP/1.1``), forwarding them in origin form
with hop-by-hop headers removed, and ``CONNECT host:port`` tunnels. Per instance it can add
``X-Forwarded-For: <client address>`` (a transparent proxy), a ``Via`` header (an anonymous proxy), wait
``delay`` seconds before dialing out (a slow proxy), and dial out from an ``egress`` address. One request
per client connection; upstream is asked to close after the response.

Destinations are filtered by ``allow`` (by default loopback only) and ``MAGPIE_EGRESS_ONLY``: the lab is
never an open proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Callable
from urllib.parse import urlsplit

from magpie.base.egress import egress_only_refusal, is_ip_literal

VIA_VALUE = "1.1 magpie-lab"
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
    }
)
_HEAD_LIMIT = 64 * 1024
_CLIENT_HEAD_TIMEOUT = 30.0
_DIAL_TIMEOUT = 10.0


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and any address in 127.0.0.0/8 or ``::1`` (brackets allowed)."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _split_hostport(target: str, default_port: int) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` / ``host`` -> (host, port); raises ValueError."""
    u = urlsplit("//" + target)
    if not u.hostname:
        raise ValueError(f"no host in {target!r}")
    return u.hostname, u.port or default_port


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()


async def _reply(writer: asyncio.StreamWriter, status: str) -> None:
    body = status.encode()
    writer.write(
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(Exception):
        await writer.drain()


class ForwardProxy:
    """Configuration and connection handler of one forward proxy.

    Args:
        egress: local address to dial out from (e.g. ``"127.0.0.106"``), or None for the OS default.
        forwarded_for: add ``X-Forwarded-For`` with the client's address (plain HTTP requests only).
        via: add ``Via: 1.1 magpie-lab`` (plain HTTP requests only).
        delay: seconds to wait before dialing out (GET and CONNECT alike).
        allow: destination host filter; a refused host gets ``403``.
    """

    def __init__(
        self,
        *,
        egress: str | None = None,
        forwarded_for: bool = False,
        via: bool = False,
        delay: float = 0.0,
        allow: Callable[[str], bool] = is_loopback_host,
    ) -> None:
        self.egress = egress
        self.forwarded_for = forwarded_for
        self.via = via
        self.delay = delay
        self.allow = allow

    async def start(self, host: str, port: int) -> asyncio.base_events.Server:
        """Listen on ``host:port``; raises ``OSError`` when the address is taken."""
        return await asyncio.start_server(self.handle, host, port, limit=_HEAD_LIMIT)

    def _rewrite(self, lines: list[str], path: str, version: str, client_ip: str) -> bytes:
        out = [f"GET {path} {version}"]
        via = xff = None
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep:
                continue
            lname = name.strip().lower()
            if lname in _HOP_BY_HOP:
                continue
            if lname == "via":
                via = value.strip()
                continue
            if lname == "x-forwarded-for":
                xff = value.strip()
                continue
            out.append(f"{name.strip()}: {value.strip()}")
        if self.forwarded_for:
            xff = f"{xff}, {client_ip}" if xff else client_ip
        if self.via:
            via = f"{via}, {VIA_VALUE}" if via else VIA_VALUE
        if xff:
            out.append(f"X-Forwarded-For: {xff}")
        if via:
            out.append(f"Via: {via}")
        out.append("Connection: close")
        return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one client connection (one request)."""
        upstream_w: asyncio.StreamWriter | None = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _CLIENT_HEAD_TIMEOUT)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, OSError):
                return
            lines = head[:-4].decode("latin-1").split("\r\n")
            try:
                method, target, version = lines[0].split(" ", 2)
                if method == "CONNECT":
                    host, port = _split_hostport(target, 443)
                    path = ""
                else:
                    u = urlsplit(target)
                    if u.scheme != "http" or not u.hostname:
                        raise ValueError("not an absolute-form http URL")
                    host, port = u.hostname, u.port or 80
                    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            except ValueError:
                await _reply(writer, "400 Bad Request")
                return
            if method not in ("CONNECT", "GET", "HEAD"):
                await _reply(writer, "405 Method Not Allowed")
                return
            if not self.allow(host) or (is_ip_literal(host) and egress_only_refusal(host)):
                await _reply(writer, "403 Forbidden")
                return
            if self.delay > 0:
                await asyncio.sleep(self.delay)
            try:
                local = (self.egress, 0) if self.egress else None
                upstream_r, upstream_w = await asyncio.wait_for(
                    asyncio.open_connection(host, port, local_addr=local), _DIAL_TIMEOUT
                )
            except (OSError, asyncio.TimeoutError):
                await _reply(writer, "502 Bad Gateway")
                return
            if method == "CONNECT":
                writer.write(f"{version} 200 Connection established\r\n\r\n".encode("latin-1"))
                await writer.drain()
            else:
                client_ip = (writer.get_extra_info("peername") or ("unknown",))[0]
                request = self._rewrite(lines[1:], path, version, client_ip)
                if method == "HEAD":
                    request = b"HEAD" + request[3:]
                upstream_w.write(request)
                await upstream_w.drain()
            # tunnel (CONNECT) or relay the rest: request body one way, the response the other
            up = asyncio.ensure_future(_pipe(reader, upstream_w))
            await _pipe(upstream_r, writer)
            up.cancel()
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (upstream_w, writer):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()
