"""The result of one proxy check and the judge echo it is graded from.

The result's Redis Stream encoding is the entry codec :mod:`magpie.stats.entry` (the only place it is
written).

Error classes in :attr:`CheckResult.error`:

- ``ConnectTimeout``: no TCP connection to the proxy within the connect timeout;
- ``ReadTimeout``: connected, but no finished proxy handshake or no complete answer before the attempt's
  deadline (a tarpit or a trickling proxy);
- ``ProxyError``: the HTTP proxy could not be reached, refused the connection or the request (e.g. CONNECT
  failed);
- ``SOCKSError``: the SOCKS proxy could not be reached, refused the connection, the credentials or the
  destination;
- ``SSLError``: TLS to an https judge failed;
- ``ConnectionError``: any other connection failure (e.g. the proxy hung up without an answer);
- ``BadStatus``: the judge (or the proxy) answered with a status other than 200;
- ``BadEcho``: status 200 but the body is not a judge echo (or is larger than the parse limit);
- ``Aborted``: the check was stopped (its lease was lost);
- ``UnsupportedProtocol``: the route's protocol is not one of :data:`magpie.base.protocols.PROTOCOLS`;
- ``EgressRefused``: the proxy's address (or the judge's) is outside the egress policy: no connection was
  made (see :mod:`magpie.base.egress`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from magpie.base.protocols import protocol
from magpie.base.routes import Route

CONNECTION_ERRORS = frozenset(
    {"ConnectTimeout", "ReadTimeout", "ProxyError", "SOCKSError", "SSLError", "ConnectionError"}
)
"""Error classes meaning the judge was never reached or never answered."""

MAX_ECHO_BYTES = 64 * 1024
"""Bodies above this size are not parsed as an echo (error ``BadEcho``)."""

USER_AGENT = "magpie-checker/1"


def now_ms() -> int:
    """Wall-clock time in whole Unix milliseconds."""
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class CheckResult:
    """Outcome of one check of one route.

    Attributes:
        alive: True only when an attempt got HTTP 200 with a valid judge echo.
        latency_ms: elapsed milliseconds of the successful attempt (request sent to body read); None if
            not alive.
        status: HTTP status of the last attempt that got an answer, else None.
        attempts: attempts actually made (0 when aborted before the first one).
        error: error class of the last attempt (see module doc), None when alive.
        body: the last judge response body, first ``body_cap`` bytes decoded as UTF-8 (bad bytes
            replaced), or None when there was no body.
        anonymity: "transparent", "anonymous", "elite", or None (not alive, or own address unknown).
        judge: the judge URL used.
        checked_at_ms: wall clock when the check finished, Unix ms.
        owners: for a route checked under several workspace profiles, each owner's outcome as
            ``"<workspace id>:<1|0>,..."`` (None: the result counts for every owner).
        judge_fault: True when the judge (not the route) failed and no other judge could take the check:
            the check pool retries the route instead of recording the result.
        connect_ms: milliseconds of the last attempt's TCP connect to the proxy (name resolution
            included); None when it did not connect.
        handshake_ms: milliseconds of the last attempt's proxy handshake (CONNECT or SOCKS, and TLS to an
            https judge) after the connect; None when it had none (plain HTTP to an http judge) or did
            not finish it.
        exit_ip: the address the judge saw the request come from (its echo's ``remote_addr``,
            normalized): the proxy's exit address, which may differ from the route's entry host; None
            when no echo came back.
    """

    alive: bool
    latency_ms: float | None
    status: int | None
    attempts: int
    error: str | None
    body: str | None
    anonymity: str | None
    judge: str
    checked_at_ms: int
    owners: str | None = None
    judge_fault: bool = False
    connect_ms: float | None = None
    handshake_ms: float | None = None
    exit_ip: str | None = None


def proxy_url(route: Route) -> str:
    """The proxy URL of ``route`` in the notation of curl and requests (credentials percent-encoded).

    ``http`` and ``https`` routes are plain-HTTP proxies (an "https proxy" in proxy lists is one that
    accepts CONNECT); ``socks4`` resolves names locally, ``socks5`` remotely (``socks5h``): the
    :attr:`~magpie.base.protocols.Protocol.proxy_scheme` of the route's protocol.
    Raises ``ValueError`` for an unknown protocol.
    """
    return protocol(route.protocol).proxy_scheme + route.url()[len(route.protocol) :]


def parse_echo(raw: bytes) -> dict | None:
    """The judge echo in ``raw`` as a dict, or None when ``raw`` is not one.

    A valid echo is a JSON object whose ``remote_addr`` is a string and ``headers`` an object.
    """
    if len(raw) > MAX_ECHO_BYTES:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    if not isinstance(doc.get("remote_addr"), str) or not isinstance(doc.get("headers"), dict):
        return None
    return doc
