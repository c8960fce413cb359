"""The result of one proxy check, its Redis Stream encoding, and the judge echo it is graded from.

Error classes in :attr:`CheckResult.error`:

- ``ConnectTimeout``: no connection to the proxy (or no finished proxy handshake) within the connect timeout;
- ``ReadTimeout``: connected, but no complete answer before the attempt's deadline (a tarpit or a
  trickling proxy);
- ``ProxyError``: the HTTP proxy could not be reached, refused the connection or the request (e.g. CONNECT
  failed);
- ``SOCKSError``: the SOCKS proxy could not be reached, refused the connection, the credentials or the
  destination;
- ``SSLError``: TLS to an https judge failed;
- ``ConnectionError``: any other connection failure (e.g. the proxy hung up without an answer);
- ``BadStatus``: the judge (or the proxy) answered with a status other than 200;
- ``BadEcho``: status 200 but the body is not a judge echo (or is larger than the parse limit);
- ``Aborted``: the check was stopped (its lease was lost);
- ``UnsupportedProtocol``: the route's protocol is not one of http, https, socks4, socks5.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from magpie.checker.anonymity import LEVELS
from magpie.routes import Route

CONNECTION_ERRORS = frozenset(
    {"ConnectTimeout", "ReadTimeout", "ProxyError", "SOCKSError", "SSLError", "ConnectionError"}
)
"""Error classes meaning the judge was never reached or never answered."""

MAX_ECHO_BYTES = 64 * 1024
"""Bodies above this size are not parsed as an echo (error ``BadEcho``)."""

USER_AGENT = "magpie-checker/1"

_FIELDS = (
    "alive", "latency_ms", "status", "attempts", "error", "body", "anonymity", "judge", "checked_at_ms"
)


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

    def to_fields(self) -> dict[str, str]:
        """Flat ``str -> str`` dict for a Redis Stream entry; ``alive`` is "1"/"0", None becomes ""."""

        def s(v) -> str:
            if v is None:
                return ""
            if isinstance(v, float):
                return repr(v)
            return str(v)

        return {
            "alive": "1" if self.alive else "0",
            "latency_ms": s(self.latency_ms),
            "status": s(self.status),
            "attempts": str(self.attempts),
            "error": s(self.error),
            "body": s(self.body),
            "anonymity": s(self.anonymity),
            "judge": self.judge,
            "checked_at_ms": str(self.checked_at_ms),
        }

    @classmethod
    def from_fields(cls, d: Mapping[str | bytes, str | bytes]) -> CheckResult:
        """Inverse of :meth:`to_fields`; keys and values may be ``bytes`` (UTF-8), extra keys are ignored.

        Empty strings read back as None (so an empty ``body`` becomes None).
        Raises ``ValueError`` when a field is missing or malformed.
        """
        f: dict[str, str] = {}
        try:
            for k, v in d.items():
                key = k.decode() if isinstance(k, bytes) else str(k)
                if key in _FIELDS:
                    f[key] = v.decode() if isinstance(v, bytes) else str(v)
        except (UnicodeDecodeError, AttributeError) as exc:
            raise ValueError(f"check result fields are not UTF-8 text: {exc}") from None
        missing = [k for k in _FIELDS if k not in f]
        if missing:
            raise ValueError(f"check result fields missing: {', '.join(missing)}")
        if f["alive"] not in ("0", "1"):
            raise ValueError(f"check result alive must be '0' or '1', got {f['alive']!r}")
        if f["anonymity"] and f["anonymity"] not in LEVELS:
            raise ValueError(f"check result anonymity unknown: {f['anonymity']!r}")
        if not f["judge"]:
            raise ValueError("check result judge is empty")
        try:
            latency = float(f["latency_ms"]) if f["latency_ms"] else None
            status = int(f["status"]) if f["status"] else None
            attempts = int(f["attempts"])
            checked_at = int(f["checked_at_ms"])
        except ValueError as exc:
            raise ValueError(f"check result number malformed: {exc}") from None
        if latency is not None and (not math.isfinite(latency) or latency < 0):
            raise ValueError(f"check result latency_ms out of range: {latency!r}")
        if attempts < 0:
            raise ValueError(f"check result attempts negative: {attempts}")
        return cls(
            alive=f["alive"] == "1",
            latency_ms=latency,
            status=status,
            attempts=attempts,
            error=f["error"] or None,
            body=f["body"] or None,
            anonymity=f["anonymity"] or None,
            judge=f["judge"],
            checked_at_ms=checked_at,
        )


def proxy_url(route: Route) -> str:
    """The proxy URL of ``route`` in the notation of curl and requests (credentials percent-encoded).

    ``http`` and ``https`` routes are plain-HTTP proxies (an "https proxy" in proxy lists is one that
    accepts CONNECT); ``socks4`` resolves names locally, ``socks5`` remotely (``socks5h``).
    Raises ``ValueError`` for an unknown protocol.
    """
    scheme = {"http": "http", "https": "http", "socks4": "socks4", "socks5": "socks5h"}.get(route.protocol)
    if scheme is None:
        raise ValueError(f"unsupported protocol {route.protocol!r}")
    return scheme + route.url()[len(route.protocol) :]


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
