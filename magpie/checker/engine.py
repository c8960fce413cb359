"""The asyncio check engine: many thousands of proxy checks in flight on one event loop.

Real proxy lists are mostly dead, and a dead proxy costs a whole timeout, so a check holds nothing but one
socket and one coroutine while it waits. One check is a GET of the judge through the route:

- ``http``/``https`` routes (plain-HTTP proxies): an absolute-URI ``GET`` for an http judge, ``CONNECT``
  plus TLS for an https judge;
- ``socks4`` (the judge's address resolved once by the engine, not per check), ``socks5`` with
  username/password and remote DNS.

Which handshake a protocol takes is its entry of :data:`magpie.base.protocols.REGISTRY`. Through an http
judge an attempt is one bare :class:`asyncio.Protocol` (:class:`_Exchange`; for SOCKS routes
:class:`_SocksExchange`, whose SOCKS4/SOCKS5 handshake is the engine's own): no stream objects and no read
coroutine per chunk, the cheapest way to hold tens of thousands of dead proxies. Through an https judge the
handshakes (CONNECT, SOCKS4, SOCKS5) and TLS come from python-socks. The judge's HTTP response is parsed by
httptools (llhttp). No DNS lookup is made for an IP-literal proxy host.

Deadlines: every attempt has a connect timeout (``connect_timeout``: name resolution and the TCP connect
to the proxy) and a hard total deadline (``timeout``) over the whole attempt, the proxy handshake (CONNECT,
SOCKS, TLS to an https judge) included, so a slow but working proxy is judged the same through an http and
an https judge, and a proxy that trickles bytes is cut at the deadline. Each attempt records its connect
and handshake times. A check therefore never outlives :attr:`CheckEngine.max_check_seconds`. A refused
connection is final: no further attempt is made in that check. Cancelling the coroutine (a lost lease)
stops the attempt in flight at once.

Error classes are those of :mod:`magpie.checker.result`.

One module on purpose: an attempt, its deadlines and the mapping of every way it can fail to an error
class are one piece of policy and read best together; limits, TLS and results live beside it.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import logging
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
from python_socks import ProxyConnectionError, ProxyError, ProxyTimeoutError, ProxyType
from python_socks.async_.asyncio.v2 import Proxy
from python_socks.async_.asyncio.v2._connect import connect_tcp

from magpie.checker.anonymity import classify, normalize_ip
from magpie.checker.result import MAX_ECHO_BYTES, USER_AGENT, CheckResult, now_ms, parse_echo
from magpie.checker.tls import is_https, judge_ssl_context, warn_https_judge
from magpie.base.egress import EgressPolicy, EgressRefused, egress_only_policy, is_ip_literal
from magpie.base.protocols import REGISTRY
from magpie.base.routes import Route
from magpie.checker.rules import needle_of, validate_rule

log = logging.getLogger(__name__)
_JUDGE_REFUSED_LOG_EVERY_S = 60.0

CHECK_SLACK_SECONDS = 1.0
"""Slack added to ``attempts x timeout`` in :attr:`CheckEngine.max_check_seconds`."""

_RELEARN_AFTER_S = 30.0  # back-off before retrying to learn the own address after a failure
_ANSWER_ERRORS = frozenset({"BadStatus", "BadEcho"})  # an answer came, but not the judge's
_LITERALS_MAX = 262_144  # proxy IP literals whose egress verdict is kept (cleared whole when full)
_JUDGE_RESOLVE_TTL_S = 300.0  # a judge host name is re-resolved this often (socks4 needs an address)
OUT_OF_FDS = "TooManyOpenFiles"
"""Error of a check that could not open a socket: this process's descriptors ran out (``EMFILE``) or the
system's (``ENFILE``). It is the checker's fault, not the route's: the check ends with ``judge_fault`` set,
so the pool retries the lease instead of recording a result."""
_OUT_OF_FDS_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
_OUT_OF_FDS_LOG_EVERY_S = 60.0


@dataclass(slots=True)
class _Attempt:
    ok: bool
    status: int | None = None
    error: str | None = None
    raw: bytes | None = None
    echo: dict | None = None
    latency_ms: float | None = None
    final: bool = False  # no further attempt in this check (refused connection)
    connect_ms: float | None = None
    handshake_ms: float | None = None


class _Dialer:
    """python-socks' ``forward`` hook: the TCP connect to the proxy, then ``connected()`` before the
    handshake starts (so the two are timed, and bounded, apart)."""

    __slots__ = ("connected",)

    def __init__(self, connected: Callable[[], None]) -> None:
        self.connected = connected

    async def connect(self, dest_host: str, dest_port: int, **_):
        try:
            stream = await connect_tcp(host=dest_host, port=dest_port, loop=asyncio.get_running_loop())
        except OSError as e:
            raise ProxyConnectionError(e.errno, f"Couldn't connect to proxy {dest_host}:{dest_port} "
                                                f"[{e.strerror}]") from e
        self.connected()
        return stream


class _Response:
    """httptools callbacks collecting one response (status from the parser, body up to ``limit``)."""

    __slots__ = ("headers_done", "complete", "body", "limit", "length")

    def __init__(self, limit: int):
        self.headers_done = False
        self.complete = False
        self.body = bytearray()
        self.limit = limit
        self.length: int | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-length":
            try:
                self.length = int(value)
            except ValueError:
                pass

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if len(self.body) < self.limit:
            self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


class _NoAnswer(Exception):
    """The connection closed before a complete response head arrived."""


_EXPIRED = object()
"""What a bare exchange's futures resolve with when the attempt's deadline passed (no exception)."""


class _Exchange(asyncio.Protocol):
    """The plain-HTTP path's connection: a bare protocol feeding httptools (no stream objects, no read
    coroutine per chunk). ``done`` resolves with None once the response is complete, the body reached the
    limit or the peer closed; with the exception when the connection failed mid-answer. The response and
    its parser exist once the first byte came (``resp`` None: nothing came; most dead proxies send
    nothing)."""

    __slots__ = ("transport", "resp", "parser", "done", "limit")

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self.transport: asyncio.Transport | None = None
        self.resp: _Response | None = None
        self.parser = None
        self.limit = limit
        self.done: asyncio.Future = loop.create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def expire(self) -> None:
        """The deadline passed (a loop timer): resolve with :data:`_EXPIRED`."""
        if not self.done.done():
            self.done.set_result(_EXPIRED)

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        if self.resp is None:
            self.resp = _Response(self.limit)
            self.parser = httptools.HttpResponseParser(self.resp)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.done.set_result(exc)
            return
        if self.resp.complete or len(self.resp.body) >= self.resp.limit:
            self.done.set_result(None)

    def eof_received(self) -> bool:
        if not self.done.done():
            self.done.set_result(None)
        return False

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(exc)




def socks_connect_request(socks4: bool, dest: str, port: int) -> bytes:
    """The CONNECT request to ``dest:port``: SOCKS4 ``VN CD DSTPORT DSTIP`` (``dest`` an IPv4 address; the
    user id follows), SOCKS5 ``VER CMD RSV ATYP DST.ADDR DST.PORT`` (an address, or a name the proxy
    resolves). Raises ``OSError``/``UnicodeError`` for an address or name that cannot be carried."""
    if socks4:
        return b"\x04\x01" + port.to_bytes(2, "big") + socket.inet_aton(dest)
    if is_ip_literal(dest):
        packed = socket.inet_pton(socket.AF_INET6 if ":" in dest else socket.AF_INET, dest)
        addr = (b"\x04" if len(packed) == 16 else b"\x01") + packed
    else:
        name = dest.encode("idna")
        addr = b"\x03" + bytes([len(name)]) + name
    return b"\x05\x01\x00" + addr + port.to_bytes(2, "big")


class _SocksExchange(_Exchange):
    """A SOCKS4 or SOCKS5 CONNECT handshake on the bare protocol, then the plain-HTTP exchange on the same
    connection (an http judge; an https judge goes through python-socks and TLS instead).

    The handshake (RFC 1928 with RFC 1929 username/password for SOCKS5; SOCKS4 with the user id) is
    written by :meth:`begin`; ``ready`` resolves with None once the proxy granted the connection, or with
    a one-line reason (str) when it refused or answered out of protocol, or with the exception that ended
    the connection. Bytes past the grant belong to the judge's answer."""

    __slots__ = ("ready", "buf", "step", "auth", "request")

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int, request: bytes, socks4: bool,
                 username: str | None, password: str | None) -> None:
        """``request``: the CONNECT request (:func:`socks_connect_request`; for SOCKS4 without the user id
        and its NUL, which come from ``username``)."""
        super().__init__(loop, limit)
        self.ready: asyncio.Future = loop.create_future()
        self.buf = b""
        self.auth = None
        if socks4:
            self.step = 4
            self.request = request + (username or "").encode() + b"\x00"
            return
        self.step = 0
        self.request = request
        if username and password:
            user, pw = username.encode(), password.encode()
            if len(user) <= 255 and len(pw) <= 255:
                self.auth = b"\x01" + bytes([len(user)]) + user + bytes([len(pw)]) + pw

    def begin(self) -> None:
        """Write the first handshake message (the connection stands)."""
        # SOCKS5: offer no authentication, and username/password when the route has both
        if self.step == 4:
            self.transport.write(self.request)
        else:
            self.transport.write(b"\x05\x02\x00\x02" if self.auth is not None else b"\x05\x01\x00")

    def _fail(self, reason) -> None:
        if not self.ready.done():
            self.ready.set_result(reason)

    def expire(self) -> None:
        self._fail(_EXPIRED)
        super().expire()

    def data_received(self, data: bytes) -> None:
        if self.ready.done():
            super().data_received(data)
            return
        buf = self.buf + data
        while True:
            if self.step == 0:  # method selection: VER METHOD
                if len(buf) < 2:
                    break
                if buf[0] != 5 or buf[1] not in (0, 2) or buf[1] == 2 and self.auth is None:
                    return self._fail("no acceptable SOCKS5 authentication method")
                if buf[1] == 2:
                    self.transport.write(self.auth)
                    self.step = 1
                else:
                    self.transport.write(self.request)
                    self.step = 2
                buf = buf[2:]
            elif self.step == 1:  # username/password: VER STATUS
                if len(buf) < 2:
                    break
                if buf[1] != 0:
                    return self._fail("SOCKS5 username/password refused")
                self.transport.write(self.request)
                self.step = 2
                buf = buf[2:]
            elif self.step == 2:  # VER REP RSV ATYP BND.ADDR BND.PORT
                if len(buf) < 4:
                    break
                if buf[0] != 5 or buf[1] != 0:
                    return self._fail(f"SOCKS5 connect refused (reply {buf[1]:#04x})")
                if buf[3] not in (1, 3, 4):
                    return self._fail("SOCKS5 reply with an unknown address type")
                if len(buf) < 5:
                    break
                size = {1: 10, 4: 22}.get(buf[3]) or 7 + buf[4]
                if len(buf) < size:
                    break
                return self._granted(buf[size:])
            else:  # SOCKS4: VN CD DSTPORT DSTIP
                if len(buf) < 8:
                    break
                if buf[1] != 0x5A:
                    return self._fail(f"SOCKS4 connect refused (reply {buf[1]:#04x})")
                return self._granted(buf[8:])
        self.buf = buf

    def _granted(self, rest: bytes) -> None:
        self.buf = b""
        self.ready.set_result(None)
        if rest:
            super().data_received(rest)

    def eof_received(self) -> bool:
        self._fail(_NoAnswer())
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        self._fail(exc if exc is not None else _NoAnswer())
        super().connection_lost(exc)


def _basic(route: Route) -> str:
    raw = f"{route.username or ''}:{route.password or ''}".encode()
    return "Basic " + base64.b64encode(raw).decode()


class CheckEngine:
    """Checks routes against one judge on the running asyncio event loop.

    Args:
        judge_url: the judge to GET (``http://`` or ``https://``).
        timeout: hard deadline in seconds over one whole attempt (connect, handshake, request, response).
        attempts: at most this many attempts per check (>= 1).
        body_cap: bytes of the judge's body kept in a result (>= 0).
        connect_timeout: seconds for name resolution and the TCP connect to the proxy (default:
            ``timeout``); never more than ``timeout``. The proxy handshake counts against ``timeout``.
        own_addresses: known own addresses, skipping :meth:`learn_own_address`.
        ssl_context: TLS context for an https judge (default: the system trust store; see
            :func:`magpie.checker.tls.judge_ssl_context`). An https judge logs one warning that anonymity
            grading cannot see headers a proxy adds (it only relays the TLS tunnel).
        egress: the :class:`magpie.base.egress.EgressPolicy` every proxy and the judge must pass before a
            connection is made (host names after resolution); None guards nothing but
            ``MAGPIE_EGRESS_ONLY`` when that is set (tools and tests).
        rule: what a valid HTTP 200 answer is: ``echo`` (default), ``status`` or ``contains:<text>``
            (:mod:`magpie.checker.rules`).
        resolver: ``await resolver(host, port) -> list[str]`` resolving host names (a shared
            :class:`magpie.judges.dns.DnsCache`); default: the loop's ``getaddrinfo`` on every call.
        limiter / rate: a :class:`magpie.coordination.ratelimit.BlockLimiter` (kind ``judge``) and the judge's
            requests per second across the deployment (<= 0: unlimited). Each attempt takes a token
            first; a check that cannot get one in time ends with error ``"RateLimited"`` and
            ``judge_fault`` set (the route is retried, not recorded), as does one that finds no file
            descriptor left (:data:`OUT_OF_FDS`).

    Raises ``ValueError`` for a non-positive timeout or attempts, a negative body_cap, or a judge URL that
    is not http(s) with a host. An instance belongs to one event loop once it has run a check.
    """

    def __init__(self, judge_url: str, timeout: float = 10.0, attempts: int = 2, body_cap: int = 2048, *,
                 connect_timeout: float | None = None, own_addresses: Iterable[str] | None = None,
                 ssl_context: ssl.SSLContext | None = None, egress: EgressPolicy | None = None,
                 rule: str = "echo", resolver=None, limiter=None, rate: float = 0.0) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts!r}")
        if body_cap < 0:
            raise ValueError(f"body_cap must be >= 0, got {body_cap!r}")
        if connect_timeout is not None and not connect_timeout > 0:
            raise ValueError(f"connect_timeout must be > 0 seconds, got {connect_timeout!r}")
        u = urlsplit(judge_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"judge URL must be http(s)://host[:port]/path, got {judge_url!r}")
        self.judge_url = judge_url
        self.egress = egress if egress is not None else egress_only_policy()
        self.rule = validate_rule(rule)
        self._echo_rule = self.rule == "echo"
        self._needle = needle_of(self.rule)
        self._resolver = resolver
        self.timeout = float(timeout)
        self.connect_timeout = min(float(connect_timeout or timeout), self.timeout)
        self.attempts = int(attempts)
        self.body_cap = int(body_cap)
        self._tls = u.scheme == "https"
        self._judge_host = u.hostname
        self._judge_port = u.port or (443 if self._tls else 80)
        self._ssl = (ssl_context or ssl.create_default_context()) if self._tls else None
        if self._tls:
            warn_https_judge(judge_url)  # anonymity grading cannot see inside the tunnel
        host_hdr = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
        if u.port:
            host_hdr += f":{u.port}"
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        common = f"Host: {host_hdr}\r\nUser-Agent: {USER_AGENT}\r\nAccept: application/json, */*\r\nConnection: close\r\n"
        self._origin_request = f"GET {path} HTTP/1.1\r\n{common}\r\n".encode()
        self._absolute_head = f"GET {u.scheme}://{host_hdr}{path} HTTP/1.1\r\n{common}"
        self._absolute_request = (self._absolute_head + "\r\n").encode()
        self._limit = max(self.body_cap, MAX_ECHO_BYTES) + 1
        self._own: frozenset[str] | None = frozenset(own_addresses) if own_addresses else None
        self._learn_failed_at: float | None = None
        self._learning: asyncio.Future | None = None
        self._judge_ip: str | None = self._judge_host if is_ip_literal(self._judge_host) else None
        self._judge_ip_at = 0.0
        self._judge_ip_allowed: str | None = None  # the judge address the egress policy last allowed
        self._literals: dict[str, bool] = {}  # proxy host -> True when an IP literal the policy allows
        self._socks_requests: dict[tuple[bool, str], bytes] = {}  # (socks4, judge address) -> CONNECT request
        self._probe: asyncio.Future | None = None
        self._probe_at = 0.0
        self._fds_warned = -_OUT_OF_FDS_LOG_EVERY_S  # monotonic time of the last out-of-descriptors warning
        self._probe_ok = True
        self._judge_refused_logged = -_JUDGE_REFUSED_LOG_EVERY_S
        self.limiter = limiter if rate and rate > 0 else None
        self.rate = float(rate or 0.0)
        if self.limiter is not None:
            from magpie.coordination.ratelimit import judge_bucket_name

            self._bucket = judge_bucket_name(judge_url)

    @classmethod
    def from_settings(cls, settings) -> CheckEngine:
        """An engine configured from a :class:`magpie.config.CheckSettings` (or a whole Settings, whose
        ``checks`` slice is used): judge URL, deadlines, attempts, body cap, the egress policy and, for an
        https judge, the CAs of ``MAGPIE_JUDGE_CA_BUNDLE`` (raises ConfigError when it cannot be loaded)."""
        c = getattr(settings, "checks", settings)
        ca_bundle = getattr(c, "judge_ca_bundle", None)
        return cls(c.judge_url, c.timeout, c.attempts, c.body_cap, connect_timeout=c.connect_timeout,
                   egress=EgressPolicy(c.allow_private, "MAGPIE_CHECK_ALLOW_PRIVATE"),
                   ssl_context=judge_ssl_context(ca_bundle) if is_https(c.judge_url) else None)

    @property
    def max_check_seconds(self) -> float:
        """Upper bound in seconds on one check: ``attempts x timeout`` plus :data:`CHECK_SLACK_SECONDS`."""
        return self.attempts * self.timeout + CHECK_SLACK_SECONDS

    @property
    def own_addresses(self) -> frozenset[str] | None:
        """The cached own addresses, or None when not learned yet."""
        return self._own

    # -- one attempt --------------------------------------------------------------------------------
    async def _judge_address(self) -> str:
        """The judge's IP address (SOCKS4 cannot carry a name, and the guard checks it); resolved at most
        every 5 minutes. Raises :class:`EgressRefused` when the policy refuses every address of the judge."""
        if self._judge_ip is not None and (self._judge_ip == self._judge_host
                                           or time.monotonic() - self._judge_ip_at < _JUDGE_RESOLVE_TTL_S):
            if self.egress is not None and self._judge_ip_allowed != self._judge_ip:
                self.egress.check_address(self._judge_ip)
                self._judge_ip_allowed = self._judge_ip
            return self._judge_ip
        self._judge_ip = (await self._resolve(self._judge_host, self._judge_port))[0]
        self._judge_ip_at = time.monotonic()
        return self._judge_ip

    async def _resolve(self, host: str, port: int) -> list[str]:
        """Addresses to dial for ``host``: itself when it is an IP literal, else its resolved addresses;
        only those the egress policy allows (raises :class:`EgressRefused` when none is)."""
        if is_ip_literal(host):
            addrs = [host]
        elif self._resolver is not None:
            addrs = await self._resolver(host, port)
        else:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            addrs = list(dict.fromkeys(info[4][0] for info in infos))
        return self.egress.allowed(addrs) if self.egress is not None else addrs

    async def _dial_host(self, route: Route) -> str:
        """The address to dial for ``route``'s proxy, past the egress guard (an allowed IP literal's
        verdict is kept per host; a host name is resolved), after checking the judge's address too.
        Raises :class:`EgressRefused`."""
        host = route.host
        if not self._literals.get(host):  # the verdict on an allowed IP literal is kept per host
            if is_ip_literal(host):
                if self.egress is not None:
                    self.egress.check_address(host)
                if len(self._literals) >= _LITERALS_MAX:
                    self._literals.clear()
                self._literals[host] = True
            else:
                host = (await self._resolve(host, route.port))[0]
        if self.egress is not None:
            await self._judge_address()  # the judge is guarded too, even when the proxy resolves it
        return host

    async def _open(self, route: Route, connected: Callable[[], None]
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        """Through an https judge: connect through ``route`` (python-socks: CONNECT, SOCKS4 or SOCKS5,
        then TLS); returns the stream and the request to send. ``connected()`` is called once the TCP
        connection to the proxy stands, before any handshake."""
        host = await self._dial_host(route)
        proto = REGISTRY[route.protocol]
        if not proto.is_socks:
            proxy = Proxy(proto.handshake, host, route.port, route.username, route.password,
                          forward=_Dialer(connected))
            stream = await proxy.connect(self._judge_host, self._judge_port, dest_ssl=self._ssl, timeout=3600)
            return stream.reader, stream.writer, self._origin_request
        dest = self._judge_host if proto.remote_dns else await self._judge_address()
        proxy = Proxy(proto.handshake, host, route.port, route.username,
                      route.password if proto.passwords else None, rdns=proto.remote_dns,
                      forward=_Dialer(connected))
        stream = await proxy.connect(dest, self._judge_port, dest_ssl=self._ssl, timeout=3600)
        return stream.reader, stream.writer, self._origin_request

    def _socks_request(self, socks4: bool, dest: str) -> bytes:
        """The CONNECT request to the judge at ``dest``, built once per judge address."""
        request = self._socks_requests.get((socks4, dest))
        if request is None:
            if socks4 and ":" in dest:
                raise ProxyError("SOCKS4 cannot carry an IPv6 judge address")
            request = self._socks_requests[(socks4, dest)] = socks_connect_request(socks4, dest, self._judge_port)
        return request

    async def _bare_attempt(self, route: Route, marks: list[float]) -> _Attempt:
        """One attempt through an http judge on a bare protocol (:class:`_Exchange`, :class:`_SocksExchange`).

        The deadlines are one timer: until the TCP connection stands it cancels the attempt (a connect
        timeout: the only exception path), from then on it resolves the exchange as expired, so a dead
        proxy that accepts and never answers (the common case) ends without an exception. Never raises for
        network trouble; appends the phase times to ``marks`` like :meth:`_timed_attempt`."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        marks.append(started)
        t0 = loop.time()
        task = asyncio.current_task()
        fired = False

        def connect_deadline() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        handle = loop.call_at(t0 + self.connect_timeout, connect_deadline)
        proto = REGISTRY[route.protocol]
        socks = proto.is_socks
        exchange: _Exchange | None = None
        try:
            try:
                host = await self._dial_host(route)
                if socks:
                    socks4 = proto.handshake is ProxyType.SOCKS4
                    dest = self._judge_host if proto.remote_dns else await self._judge_address()
                    exchange = _SocksExchange(loop, self._limit, self._socks_request(socks4, dest), socks4,
                                              route.username, route.password)
                else:
                    exchange = _Exchange(loop, self._limit)
                await loop.create_connection(lambda: exchange, host, route.port)
            except asyncio.CancelledError:
                if fired and task.uncancel() == 0:
                    return _Attempt(ok=False, error="ConnectTimeout")
                raise
            marks.append(time.perf_counter())
            handle.cancel()
            handle = loop.call_at(t0 + self.timeout, exchange.expire)
            if socks:
                exchange.begin()
                failed = await exchange.ready
                if failed is _EXPIRED:
                    return _Attempt(ok=False, error="ReadTimeout")
                if failed is not None:  # refused, out of protocol, or hung up during the handshake
                    return _Attempt(ok=False, error="SOCKSError")
                request = self._origin_request
            elif route.username is None:
                request = self._absolute_request
            else:
                request = f"{self._absolute_head}Proxy-Authorization: {_basic(route)}\r\n\r\n".encode()
            marks.append(time.perf_counter())
            exchange.transport.write(request)
            failed = await exchange.done
            if failed is _EXPIRED:
                return _Attempt(ok=False, error="ReadTimeout")
            if failed is not None:  # a parse error or a reset
                return _Attempt(ok=False, error="ConnectionError")
            if exchange.resp is None:
                raise _NoAnswer()
            return self._verdict(exchange.parser, exchange.resp, started)
        except EgressRefused:
            return _Attempt(ok=False, error="EgressRefused", final=True)
        except ProxyError:
            return _Attempt(ok=False, error="SOCKSError" if socks else "ProxyError")
        except ConnectionRefusedError:
            return _Attempt(ok=False, error="SOCKSError" if socks else "ProxyError", final=True)
        except (_NoAnswer, OSError) as exc:
            if getattr(exc, "errno", None) in _OUT_OF_FDS_ERRNOS:
                return _Attempt(ok=False, error=OUT_OF_FDS, final=True)
            if len(marks) < 3:  # the proxy hung up before any answer could start
                return _Attempt(ok=False, error="SOCKSError" if socks else "ProxyError")
            return _Attempt(ok=False, error="ConnectionError")
        finally:
            handle.cancel()
            if exchange is not None and exchange.transport is not None:
                exchange.transport.abort()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes,
                        started: float) -> _Attempt:
        writer.write(request)
        resp = _Response(self._limit)
        parser = httptools.HttpResponseParser(resp)
        while not resp.complete and len(resp.body) < self._limit:
            data = await reader.read(65536)
            if not data:
                break
            try:
                parser.feed_data(data)
            except httptools.HttpParserError:
                return _Attempt(ok=False, error="ConnectionError")
        return self._verdict(parser, resp, started)

    def _verdict(self, parser, resp: _Response, started: float) -> _Attempt:
        """The attempt's outcome from a collected response (``started``: ``perf_counter`` at its start).
        Raises :class:`_NoAnswer` when no complete response head arrived."""
        if not resp.headers_done:
            raise _NoAnswer()
        status = parser.get_status_code()
        raw = bytes(resp.body)
        if not resp.complete and len(raw) < self._limit and resp.length is not None:
            return _Attempt(ok=False, status=status, error="ConnectionError", raw=raw)  # cut mid-body
        elapsed_ms = round((time.perf_counter() - started) * 1000.0, 3)
        if status != 200:
            return _Attempt(ok=False, status=status, error="BadStatus", raw=raw)
        if self._echo_rule:
            echo = parse_echo(raw)
            if echo is None:
                return _Attempt(ok=False, status=200, error="BadEcho", raw=raw)
        else:
            if self._needle is not None and self._needle not in raw:
                return _Attempt(ok=False, status=200, error="BadEcho", raw=raw)
            echo = parse_echo(raw) if raw[:1] == b"{" else None  # graded when the judge echoes anyway
        return _Attempt(ok=True, status=200, raw=raw, echo=echo, latency_ms=elapsed_ms)

    async def _attempt(self, route: Route) -> _Attempt:
        """One attempt (:meth:`_timed_attempt`) with its connect and handshake times in ms: None for a
        phase not reached, and ``handshake_ms`` None too when there is none (plain HTTP to an http judge)."""
        marks: list[float] = []  # perf_counter at the start, at the TCP connect, at the handshake's end
        att = await (self._timed_attempt(route, marks) if self._tls else self._bare_attempt(route, marks))
        if len(marks) >= 2:
            att.connect_ms = round((marks[1] - marks[0]) * 1000.0, 3)
        if len(marks) >= 3 and (self._tls or REGISTRY[route.protocol].is_socks):
            att.handshake_ms = round((marks[2] - marks[1]) * 1000.0, 3)
        return att

    async def _timed_attempt(self, route: Route, marks: list[float]) -> _Attempt:
        """One attempt: the connect under the connect timeout, all of it (the handshake included) under
        the total deadline; never raises for network trouble. Appends the phase times to ``marks``."""
        if not self._tls:
            return await self._bare_attempt(route, marks)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        marks.append(started)
        t0 = loop.time()
        transport = None
        socks = REGISTRY[route.protocol].is_socks
        window = asyncio.timeout_at(t0 + self.connect_timeout)

        def connected() -> None:
            marks.append(time.perf_counter())
            window.reschedule(t0 + self.timeout)

        try:
            async with window:
                reader, writer, request = await self._open(route, connected)
                marks.append(time.perf_counter())
                transport = writer.transport
                return await self._exchange(reader, writer, request, started)
        except EgressRefused:
            return _Attempt(ok=False, error="EgressRefused", final=True)
        except TimeoutError:
            return _Attempt(ok=False, error="ConnectTimeout" if len(marks) < 2 else "ReadTimeout")
        except ssl.SSLError:
            return _Attempt(ok=False, error="SSLError")
        except ProxyTimeoutError:
            return _Attempt(ok=False, error="ConnectTimeout")
        except ProxyConnectionError as exc:
            refused = getattr(exc, "errno", None) == errno.ECONNREFUSED or "refused" in str(exc).lower()
            return _Attempt(ok=False, error="SOCKSError" if socks else "ProxyError", final=refused)
        except ProxyError:
            return _Attempt(ok=False, error="SOCKSError" if socks else "ProxyError")
        except ConnectionRefusedError:
            return _Attempt(ok=False, error="SOCKSError" if socks else "ProxyError", final=True)
        except (_NoAnswer, asyncio.IncompleteReadError, EOFError, OSError) as exc:
            if getattr(exc, "errno", None) in _OUT_OF_FDS_ERRNOS:
                return _Attempt(ok=False, error=OUT_OF_FDS, final=True)
            if len(marks) < 3:  # the proxy hung up during its handshake (e.g. refused credentials)
                return _Attempt(ok=False, error="SOCKSError" if socks else "ProxyError")
            return _Attempt(ok=False, error="ConnectionError")
        finally:
            if transport is not None:
                transport.abort()

    # -- the check ----------------------------------------------------------------------------------
    def _body(self, raw: bytes | None, route: Route) -> str | None:
        """The body kept in the result: capped, and with the route's credentials masked (a proxy that
        forwards ``Proxy-Authorization`` to the judge would otherwise have them echoed into history)."""
        if raw is None:
            return None
        text = raw[: self.body_cap].decode("utf-8", "replace")
        if route.username is not None:
            for secret in (_basic(route)[6:], route.password):
                if secret and secret in text:
                    text = text.replace(secret, "***")
        return text

    async def check(self, route: Route, before_attempt: Callable[[int], bool] | None = None) -> CheckResult:
        """Check ``route`` against the judge; at most :attr:`max_check_seconds`.

        Args:
            route: the proxy to go through.
            before_attempt: called as ``before_attempt(n)`` before attempt ``n`` (1-based); returning False
                stops the check with error ``"Aborted"``.
        Returns a :class:`CheckResult`; network failures never raise. Cancelling the calling task stops
        the attempt in flight (``CancelledError`` propagates). The own address, when not known yet, is
        learned on the first successful attempt (one direct GET; retried at most every 30 s).
        """
        if route.protocol not in REGISTRY:
            return CheckResult(False, None, None, 0, "UnsupportedProtocol", None, None, self.judge_url, now_ms())
        last: _Attempt | None = None
        made = 0
        start_by = None  # loop time by which an attempt must start to end within max_check_seconds
        if self.limiter is not None:
            start_by = asyncio.get_running_loop().time() + self.max_check_seconds - self.timeout
        for n in range(1, self.attempts + 1):
            if before_attempt is not None and not before_attempt(n):
                return CheckResult(False, None, last.status if last else None, made, "Aborted",
                                   self._body(last.raw, route) if last else None, None, self.judge_url, now_ms())
            if start_by is not None and not await self.limiter.acquire(self._bucket, self.rate, start_by):
                return CheckResult(False, None, last.status if last else None, made, "RateLimited", None, None,
                                   self.judge_url, now_ms(), judge_fault=True)
            made += 1
            last = await self._attempt(route)
            if last.ok or last.final:
                break
        assert last is not None
        if last.error == OUT_OF_FDS:
            self._warn_out_of_fds()
            return CheckResult(False, None, None, made, OUT_OF_FDS, None, None, self.judge_url, now_ms(),
                               judge_fault=True)
        anonymity = exit_ip = None
        if last.ok and last.echo is not None:
            own = await self._own_for_grading()
            anonymity = classify(last.echo, own) if own else None
            exit_ip = normalize_ip(last.echo["remote_addr"])
        return CheckResult(
            alive=last.ok, latency_ms=last.latency_ms if last.ok else None, status=last.status, attempts=made,
            error=None if last.ok else last.error, body=self._body(last.raw, route), anonymity=anonymity,
            judge=self.judge_url, checked_at_ms=now_ms(), connect_ms=last.connect_ms,
            handshake_ms=last.handshake_ms, exit_ip=exit_ip)

    def _warn_out_of_fds(self) -> None:
        now = time.monotonic()
        if now - self._fds_warned >= _OUT_OF_FDS_LOG_EVERY_S:
            self._fds_warned = now
            log.warning("no file descriptor left for a check (EMFILE/ENFILE): its route is retried, not "
                        "recorded; lower MAGPIE_CHECKS_PER_PROCESS or raise the open-file limit")

    # -- the judge itself ---------------------------------------------------------------------------
    async def _direct(self) -> tuple[_Attempt, str | None]:
        """One direct GET of the judge; returns the attempt and the local address used."""
        started = time.perf_counter()
        writer = None
        try:
            async with asyncio.timeout(self.timeout):
                address = await self._judge_address()
                reader, writer = await asyncio.open_connection(
                    address, self._judge_port, ssl=self._ssl,
                    server_hostname=self._judge_host if self._tls else None)
                sockname = writer.get_extra_info("sockname")
                local = normalize_ip(sockname[0]) if sockname else None
                return await self._exchange(reader, writer, self._origin_request, started), local
        except EgressRefused as exc:
            now = time.monotonic()
            if now - self._judge_refused_logged >= _JUDGE_REFUSED_LOG_EVERY_S:
                self._judge_refused_logged = now  # every failed route is retried, not blamed: say why
                log.warning("judge %s refused by the egress guard (%s); routes are retried, none is recorded",
                            self._judge_host, exc)
            return _Attempt(ok=False, error="EgressRefused"), None
        except (TimeoutError, OSError, _NoAnswer, asyncio.IncompleteReadError, EOFError):
            return _Attempt(ok=False, error="ConnectionError"), None
        finally:
            if writer is not None:
                writer.transport.abort()

    async def learn_own_address(self, refresh: bool = False) -> set[str] | None:
        """Learn (and cache) the addresses the judge sees for this host when reached without a proxy.

        One direct GET of the judge (concurrent callers share it). The result holds the echoed
        ``remote_addr`` plus the local source address towards the judge (they differ behind NAT),
        normalized. Returns None when the judge is unreachable or its answer is not an echo.
        """
        if not refresh and self._own is not None:
            return set(self._own)
        if self._learning is None or self._learning.done():
            self._learning = asyncio.ensure_future(self._learn())
        return await asyncio.shield(self._learning)

    async def _learn(self) -> set[str] | None:
        started = time.monotonic()
        att, local = await self._direct()
        self._probe_at, self._probe_ok = started, att.ok
        if not att.ok or att.echo is None:
            self._learn_failed_at = time.monotonic()
            return None
        own = {normalize_ip(att.echo["remote_addr"]) or att.echo["remote_addr"].strip()}
        if local:
            own.add(local)
        self._own = frozenset(own)
        self._learn_failed_at = None
        return set(own)

    async def _own_for_grading(self) -> frozenset[str] | None:
        if self._own is not None:
            return self._own
        failed = self._learn_failed_at
        if failed is not None and time.monotonic() - failed < _RELEARN_AFTER_S:
            return None
        learned = await self.learn_own_address()
        return frozenset(learned) if learned else None

    async def judge_reachable(self, max_age: float = 2.0, since: float | None = None) -> bool:
        """Whether the judge answers a direct GET by its rule; one probe per ``max_age`` seconds at most,
        shared by concurrent callers. With ``since`` (a ``time.monotonic()`` value), only a probe started
        at or after it counts. A route is not blamed for a failure while this is False."""
        if (self._probe_at >= since) if since is not None else (time.monotonic() - self._probe_at < max_age):
            return self._probe_ok
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self.learn_own_address(refresh=True))
        await asyncio.shield(self._probe)
        return self._probe_ok

    async def probe(self) -> tuple[bool, str | None]:
        """One direct GET of the judge now: ``(True, None)`` when it answers by the rule, else
        ``(False, reason)`` with the error class (and the HTTP status when there was one)."""
        started = time.monotonic()
        att, _local = await self._direct()
        self._probe_at, self._probe_ok = started, att.ok
        if att.ok:
            return True, None
        return False, att.error + (f" (HTTP {att.status})" if att.status is not None else "")

    # -- the check pool's face ------------------------------------------------------------------------
    async def check_payload(self, payload, before_attempt: Callable[[int], bool] | None = None) -> CheckResult:
        """Check the route of a :class:`magpie.queue.Payload` (one engine: its owners do not matter)."""
        return await self.check(payload.route, before_attempt)

    async def blame_judge(self, res: CheckResult, started: float | None = None) -> bool:
        """True when a failed ``res`` is the judge's fault (it does not answer a direct GET now): the
        route is then retried, not recorded. An answer that did come back but was wrong (``BadStatus``,
        ``BadEcho``: often a proxy's 502 for an unreachable judge) is compared with a probe started after
        the check (``started``, ``time.monotonic()``); other failures with the probe of the last 2 s."""
        if res.alive:
            return False
        fresh = started is not None and res.error in _ANSWER_ERRORS
        return not await self.judge_reachable(since=started if fresh else None)

