"""One rotating listener: an asyncio server that tunnels each client connection through the next route.

A client speaks either protocol on the same port (the first byte tells them apart; ``listen`` limits
which are accepted):

- **HTTP proxy**: ``CONNECT host:port`` opens a tunnel (``200 Connection established``); an
  absolute-URI request (``GET http://host/path``) is forwarded (to an HTTP upstream as is, through a
  SOCKS upstream in origin form), with ``Connection: close``. Credentials: ``Proxy-Authorization:
  Basic`` (``407`` without them).
- **SOCKS5** (RFC 1928, ``CONNECT`` only), with username/password authentication (RFC 1929) when the
  rotator has credentials.

Before any route is tried, the destination passes the listener's
:class:`magpie.rotator.policy.DestinationPolicy` (refused: ``403`` / SOCKS5 reply 2), and credentials are
checked under a per-address :class:`magpie.coordination.throttle.FailureThrottle`.

Each connection tries up to ``tries`` routes of its :class:`magpie.rotator.pool.RoutePool`: a route that
fails to connect (or to complete its proxy handshake within ``connect_timeout``) is counted, penalised in
the pool and skipped for the next one. Upstream handshakes (HTTP CONNECT, SOCKS4, SOCKS5, with the
route's credentials) come from python-socks. A tunnel closes when either side closes or after
``idle_timeout`` seconds without traffic.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import ipaddress
import logging
import socket
import struct
from dataclasses import dataclass, field

from python_socks.async_.asyncio import Proxy

from magpie.base.egress import EgressRefused
from magpie.base.protocols import REGISTRY
from magpie.rotator.policy import DestinationPolicy, DestinationRefused, resolve_allowed, system_resolver
from magpie.rotator.pool import RoutePool, Upstream
from magpie.coordination.throttle import FailureLog, FailureThrottle

log = logging.getLogger(__name__)

_HEADER_CAP = 16 * 1024
_HANDSHAKE_S = 15.0
_CHUNK = 64 * 1024


@dataclass
class ListenerSpec:
    """What a listener needs from its ``rotators`` row: ``rotator_id``, ``name``, ``port``, ``listen``
    (set of ``http``/``socks5``), client ``username``/``password`` (clear, in memory only; None = open),
    ``policy``, ``sticky_seconds``, ``revision``, ``workspace_id``, ``filters``, ``allowed_ports`` (the
    rotator's own destination ports as ``((lo, hi), ...)``; None: the deployment's)."""

    rotator_id: int
    name: str
    port: int
    listen: frozenset[str]
    username: str | None
    password: str | None = field(repr=False)
    policy: str
    sticky_seconds: int
    revision: int
    workspace_id: int
    filters: dict
    allowed_ports: tuple[tuple[int, int], ...] | None = None


@dataclass
class ListenerStats:
    """Counters of one listener: ``connections`` accepted, ``active`` now, ``refused`` (auth or protocol),
    ``no_route`` (every try failed or the pool was empty), ``upstream_failures``, ``bytes_up`` (client to
    upstream), ``bytes_down``, ``auth_failures`` (wrong or throttled credentials), ``destination_refused``,
    ``rate_limited`` (connections refused over the per-client rate)."""

    connections: int = 0
    active: int = 0
    refused: int = 0
    no_route: int = 0
    upstream_failures: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    auth_failures: int = 0
    destination_refused: int = 0
    rate_limited: int = 0


class _Refused(Exception):
    """The client's request is refused (already answered); close quietly."""


class Listener:
    """Serves one rotator on ``host:spec.port`` (see the module doc).

    Args:
        spec: the rotator (:meth:`update` swaps in a changed one without dropping connections).
        pool: its eligible routes.
        host: bind address. tries: routes tried per connection. connect_timeout / idle_timeout: seconds.
        on_failure: ``on_failure(spec, upstream)`` for every failed upstream (metrics); optional.
        destinations: the :class:`magpie.rotator.policy.DestinationPolicy` client destinations pass
            (None: any destination; tools and tests only).
        upstream_egress: the checks' :class:`magpie.base.egress.EgressPolicy` every upstream address passes
            before the dial, after resolving a route's name (None: no check).
        resolver: ``await resolver(host, port) -> list[str]`` for upstream names (default: getaddrinfo).
        throttle / auth_log: per-address backoff of failed authentications and their rate log (shared by
            the process's listeners; default: a private one each).
        rate_limiter / client_rate: a :class:`magpie.coordination.ratelimit.BlockLimiter` (kind ``rotator``) and the
            new connections per second one client address may open to this rotator across the
            deployment (``MAGPIE_ROTATOR_CLIENT_RATE``; <= 0: unlimited). A connection over it is closed
            at once, unread, and counted in :attr:`ListenerStats.rate_limited`.
    """

    def __init__(self, spec: ListenerSpec, pool: RoutePool, *, host: str = "127.0.0.1", tries: int = 3,
                 connect_timeout: float = 10.0, idle_timeout: float = 300.0, on_failure=None,
                 limit: asyncio.Semaphore | None = None, destinations: DestinationPolicy | None = None,
                 upstream_egress=None, resolver=system_resolver, throttle: FailureThrottle | None = None,
                 auth_log: FailureLog | None = None, rate_limiter=None, client_rate: float = 0.0):
        self.spec = spec
        self.pool = pool
        self.host = host
        self.tries = int(tries)
        self.connect_timeout = float(connect_timeout)
        self.idle_timeout = float(idle_timeout)
        self.on_failure = on_failure
        self.limit = limit
        self.destinations = destinations
        self.upstream_egress = upstream_egress
        self.resolver = resolver
        self.throttle = throttle or FailureThrottle()
        self.auth_log = auth_log or FailureLog(log, "rotator: failed authentications")
        self.stats = ListenerStats()
        self.rate_limiter = rate_limiter if client_rate and client_rate > 0 else None
        self.client_rate = float(client_rate or 0.0)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Bind and serve. Raises ``OSError`` when the port cannot be bound."""
        self._server = await asyncio.start_server(self._serve, self.host, self.spec.port, reuse_address=True,
                                                  limit=_HEADER_CAP * 2)

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    def update(self, spec: ListenerSpec) -> None:
        """Apply a changed rotator (credentials, policy, filters) in place; connections stay up."""
        self.spec = spec
        self.pool.policy = spec.policy
        self.pool.sticky_seconds = float(spec.sticky_seconds)

    async def stop(self) -> None:
        """Stop accepting and close this listener's open tunnels."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- one client ----------------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.stats.connections += 1
        self.stats.active += 1
        try:
            if self.rate_limiter is not None and not await self.rate_limiter.try_acquire(
                    f"{self.spec.rotator_id}:{self._client_key(writer)}", self.client_rate):
                self.stats.rate_limited += 1
                self.rate_limiter.counts.add("refused")
                if self.rate_limiter.counts.due():
                    asyncio.get_running_loop().run_in_executor(None, self.rate_limiter.flush)
                raise _Refused
            if self.limit is not None:
                async with self.limit:
                    await self._handle(reader, writer)
            else:
                await self._handle(reader, writer)
        except (_Refused, asyncio.IncompleteReadError, ConnectionError, TimeoutError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - one client never takes the listener down
            log.exception("rotator %s: client connection failed", self.spec.name)
        finally:
            self.stats.active -= 1
            self._tasks.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, reader, writer) -> None:
        first = await asyncio.wait_for(reader.readexactly(1), _HANDSHAKE_S)
        if first == b"\x05":
            if "socks5" not in self.spec.listen:
                self.stats.refused += 1
                raise _Refused
            await self._socks5(reader, writer)
        else:
            if "http" not in self.spec.listen:
                self.stats.refused += 1
                raise _Refused
            await self._http(first, reader, writer)

    def _client_key(self, writer) -> str:
        peer = writer.get_extra_info("peername") or ("?",)
        return str(peer[0])

    def _auth_ok(self, client: str, user: str | None, password: str | None) -> bool:
        """Check the client's credentials, unless its address is blocked by the failure throttle."""
        spec = self.spec
        if spec.password is None:
            return True
        if user is None or password is None:
            return False  # no credentials yet (a 407 challenge), not a guess
        if self.throttle.blocked(client) > 0:
            self.stats.auth_failures += 1
            self.auth_log.failed(client, blocked=True)
            return False
        ok_user = hmac.compare_digest(user.encode(), (spec.username or "").encode())
        ok_pw = hmac.compare_digest(password.encode(), spec.password.encode())
        if ok_user and ok_pw:
            self.throttle.succeeded(client)
            return True
        self.stats.auth_failures += 1
        self.throttle.failed(client)
        self.auth_log.failed(client)
        return False

    async def _destination(self, host: str, port: int) -> str:
        """The address to hand the upstream for ``host:port`` (checked by the destination policy).
        Raises :class:`DestinationRefused`."""
        if self.destinations is None:
            return host
        try:
            return await self.destinations.check(host, port, self.spec.allowed_ports)
        except DestinationRefused as exc:
            self.stats.destination_refused += 1
            log.debug("rotator %s: %s", self.spec.name, exc)
            raise

    # -- SOCKS5 --------------------------------------------------------------------------------------
    async def _socks5(self, reader, writer) -> None:
        n = (await asyncio.wait_for(reader.readexactly(1), _HANDSHAKE_S))[0]
        methods = await asyncio.wait_for(reader.readexactly(n), _HANDSHAKE_S)
        need_auth = self.spec.password is not None
        want = 0x02 if need_auth else 0x00
        if want not in methods:
            writer.write(b"\x05\xff")
            await writer.drain()
            self.stats.refused += 1
            raise _Refused
        writer.write(bytes([5, want]))
        await writer.drain()
        if need_auth:
            ver = (await reader.readexactly(1))[0]
            ulen = (await reader.readexactly(1))[0]
            user = (await reader.readexactly(ulen)).decode("utf-8", "replace")
            plen = (await reader.readexactly(1))[0]
            pw = (await reader.readexactly(plen)).decode("utf-8", "replace")
            if ver != 1 or not self._auth_ok(self._client_key(writer), user, pw):
                writer.write(b"\x01\x01")
                await writer.drain()
                self.stats.refused += 1
                raise _Refused
            writer.write(b"\x01\x00")
            await writer.drain()
        ver, cmd, _rsv, atyp = await asyncio.wait_for(reader.readexactly(4), _HANDSHAKE_S)
        if atyp == 1:
            host = socket.inet_ntop(socket.AF_INET, await reader.readexactly(4))
        elif atyp == 4:
            host = socket.inet_ntop(socket.AF_INET6, await reader.readexactly(16))
        elif atyp == 3:
            ln = (await reader.readexactly(1))[0]
            host = (await reader.readexactly(ln)).decode("idna")
        else:
            await self._socks_reply(writer, 8)
            raise _Refused
        (port,) = struct.unpack("!H", await reader.readexactly(2))
        if ver != 5 or cmd != 1:
            await self._socks_reply(writer, 7)  # command not supported
            self.stats.refused += 1
            raise _Refused
        try:
            dest = await self._destination(host, port)
        except DestinationRefused:
            await self._socks_reply(writer, 2)  # connection not allowed by ruleset
            raise _Refused from None
        up = await self._open(dest, port, self._client_key(writer))
        if up is None:
            await self._socks_reply(writer, 4)  # host unreachable
            raise _Refused
        await self._socks_reply(writer, 0)
        await self._splice(reader, writer, *up)

    @staticmethod
    async def _socks_reply(writer, code: int) -> None:
        writer.write(bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0]))
        await writer.drain()

    # -- HTTP proxy ----------------------------------------------------------------------------------
    async def _http(self, first: bytes, reader, writer) -> None:
        head = first + await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HANDSHAKE_S)
        if len(head) > _HEADER_CAP:
            await self._http_reply(writer, 431, "Request Header Fields Too Large")
            raise _Refused
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ")
        except ValueError:
            await self._http_reply(writer, 400, "Bad Request")
            raise _Refused from None
        headers = [ln for ln in lines[1:] if ln]
        user = password = None
        kept = []
        for h in headers:
            name, _, value = h.partition(":")
            lname = name.strip().lower()
            if lname == "proxy-authorization":
                scheme, _, cred = value.strip().partition(" ")
                if scheme.lower() == "basic":
                    with contextlib.suppress(Exception):
                        user, _, password = base64.b64decode(cred.strip()).decode("utf-8").partition(":")
            elif lname not in ("proxy-connection", "connection", "keep-alive"):
                kept.append(h)
        client = self._client_key(writer)
        if not self._auth_ok(client, user, password):
            self.stats.refused += 1
            await self._http_reply(writer, 407, "Proxy Authentication Required",
                                   'Proxy-Authenticate: Basic realm="magpie"\r\n')
            raise _Refused
        if method.upper() == "CONNECT":
            host, port = _split_hostport(target, 443)
            if host is None:
                await self._http_reply(writer, 400, "Bad Request")
                raise _Refused
            dest = await self._http_destination(writer, host, port)
            up = await self._open(dest, port, client)
            if up is None:
                await self._http_reply(writer, 502, "Bad Gateway")
                raise _Refused
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await self._splice(reader, writer, *up)
            return
        if not target.lower().startswith("http://"):
            await self._http_reply(writer, 400, "Bad Request")
            raise _Refused
        rest = target[7:]
        hostport, slash, path = rest.partition("/")
        host, port = _split_hostport(hostport, 80)
        if host is None:
            await self._http_reply(writer, 400, "Bad Request")
            raise _Refused
        origin = "/" + path if slash else "/"
        dest = await self._http_destination(writer, host, port)
        got = await self._open(dest, port, client, forward_http=True)
        if got is None:
            await self._http_reply(writer, 502, "Bad Gateway")
            raise _Refused
        ur, uw, upstream = got
        if not any(h.partition(":")[0].strip().lower() == "host" for h in kept):
            kept.insert(0, f"Host: {hostport}")
        if not REGISTRY[upstream.protocol].is_socks:
            pinned = f"[{dest}]" if ":" in dest else dest
            line = f"{method} http://{pinned}:{port}{origin} {version}"
            auth = ([f"Proxy-Authorization: Basic {_basic(upstream.username, upstream.password)}"]
                    if upstream.password is not None else [])
        else:
            line, auth = f"{method} {origin} {version}", []
        req = "\r\n".join([line, *kept, *auth, "Connection: close", "", ""]).encode("latin-1")
        uw.write(req)
        self.stats.bytes_up += len(req)
        await self._splice(reader, writer, ur, uw, upstream)

    async def _http_destination(self, writer, host: str, port: int) -> str:
        try:
            return await self._destination(host, port)
        except DestinationRefused:
            await self._http_reply(writer, 403, "Forbidden")
            raise _Refused from None

    @staticmethod
    async def _http_reply(writer, status: int, reason: str, extra: str = "") -> None:
        writer.write(f"HTTP/1.1 {status} {reason}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
                     .encode("latin-1"))
        with contextlib.suppress(Exception):
            await writer.drain()

    # -- upstream ------------------------------------------------------------------------------------
    async def _open(self, host: str, port: int, client: str, forward_http: bool = False):
        """``(reader, writer, upstream)`` through the first route that connects, or None."""
        tried: set[int] = set()
        for _ in range(self.tries):
            u = self.pool.pick(client, tried)
            if u is None:
                break
            tried.add(u.route_id)
            try:
                addr = await asyncio.wait_for(resolve_allowed(u.host, u.port, self.upstream_egress, self.resolver),
                                              self.connect_timeout)
                if forward_http and not REGISTRY[u.protocol].is_socks:
                    r, w = await asyncio.wait_for(asyncio.open_connection(addr, u.port), self.connect_timeout)
                else:
                    proxy = Proxy.create(REGISTRY[u.protocol].handshake, addr, u.port, u.username, u.password,
                                         rdns=True)
                    sock = await proxy.connect(host, port, timeout=self.connect_timeout)
                    r, w = await asyncio.wait_for(asyncio.open_connection(sock=sock), self.connect_timeout)
                return r, w, u
            except Exception as exc:  # noqa: BLE001 - any upstream failure: count it, try the next route
                if isinstance(exc, EgressRefused):
                    log.warning("rotator %s: upstream route %s not dialled: %s", self.spec.name, u.route_id, exc)
                self.stats.upstream_failures += 1
                self.pool.failed(u)
                if self.on_failure is not None:
                    with contextlib.suppress(Exception):
                        self.on_failure(self.spec, u)
        self.stats.no_route += 1
        return None

    async def _splice(self, cr, cw, ur, uw, _upstream: Upstream) -> None:
        loop = asyncio.get_running_loop()
        last = [loop.time()]

        async def pump(src, dst, up: bool):
            while True:
                data = await src.read(_CHUNK)
                if not data:
                    break
                last[0] = loop.time()
                if up:
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                dst.write(data)
                await dst.drain()
            with contextlib.suppress(Exception):
                if dst.can_write_eof():
                    dst.write_eof()

        tasks = [asyncio.ensure_future(pump(cr, uw, True)), asyncio.ensure_future(pump(ur, cw, False))]
        try:
            while True:  # until both directions ended, one failed, or no traffic for idle_timeout
                done, _ = await asyncio.wait(tasks, timeout=min(5.0, self.idle_timeout),
                                             return_when=asyncio.FIRST_EXCEPTION)
                if len(done) == 2 or any(not t.cancelled() and t.exception() for t in done):
                    break
                if loop.time() - last[0] > self.idle_timeout:
                    break
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                uw.close()


def _split_hostport(text: str, default: int) -> tuple[str | None, int]:
    """``host:port`` / ``[v6]:port`` / ``host`` -> (host, port); (None, 0) when malformed."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_s = text.partition(":")
    else:
        host, port_s = text, ""
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(text)
    try:
        port = int(port_s) if port_s else default
    except ValueError:
        return None, 0
    if not host or not 1 <= port <= 65535:
        return None, 0
    return host, port


def _basic(user: str | None, password: str | None) -> str:
    return base64.b64encode(f"{user or ''}:{password or ''}".encode()).decode()
