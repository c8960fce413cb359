"""One HTTP GET through the egress guard, for blacklist URLs and the abuse-reputation provider.

The URL must be ``http`` or ``https`` with a host and no credentials. Its host is resolved (an IP literal is
taken as is) and every resolved address is checked by :class:`magpie.base.egress.EgressPolicy` with
``MAGPIE_ENRICH_ALLOW_PRIVATE``; the request connects to an address that passed (no second lookup), with
``Host`` and the TLS server name set to the URL's host, certificates verified against certifi's bundle.
Redirects are not followed; the body is read up to a byte limit.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import certifi
import urllib3

from magpie.base.egress import EgressPolicy
from magpie.errors import MagpieError

USER_AGENT = "magpie-enrich/1"


class FetchError(MagpieError, RuntimeError):
    """A URL is malformed, refused by the egress guard, unreachable, too large, or answered with an error
    status; the message names the host (never a query string or credentials)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply: HTTP ``status``, ``body`` bytes and lower-cased ``headers``."""

    status: int
    body: bytes
    headers: dict[str, str]


def _addresses(host: str, port: int, policy: EgressPolicy, resolve) -> list[str]:
    try:
        literal = str(ipaddress.ip_address(host))
    except ValueError:
        literal = None
    if literal is not None:
        resolved = [literal]
    else:
        try:
            resolved = [info[4][0] for info in resolve(host, port, type=socket.SOCK_STREAM)]
        except (OSError, UnicodeError) as exc:
            raise FetchError(f"cannot resolve {host!r}: {exc}") from None
    out: list[str] = []
    for raw in resolved:
        ip = str(ipaddress.ip_address(raw.split("%", 1)[0]))
        why = policy.refusal(ip)
        if why:
            raise FetchError(f"{host!r} refused by the egress guard: {why}")
        if ip not in out:
            out.append(ip)
    if not out:
        raise FetchError(f"{host!r} resolves to no address")
    return out


def _read_until(resp, limit: int, deadline: float, shown: str) -> bytes:
    """Up to ``limit`` bytes of ``resp``, read as they arrive; :class:`FetchError` past ``deadline``."""
    parts: list[bytes] = []
    n = 0
    while n < limit:
        if time.monotonic() > deadline:
            raise FetchError(f"GET {shown} took too long (the whole list must arrive in time)")
        part = resp.read1(min(65536, limit - n))
        if not part:
            break
        parts.append(part)
        n += len(part)
    return b"".join(parts)


def get(url: str, *, policy: EgressPolicy, timeout: float, max_bytes: int, headers: dict[str, str] | None = None,
        fields: dict[str, str] | None = None, resolve=socket.getaddrinfo,
        total_timeout: float | None = None) -> Reply:
    """GET ``url`` (plus query ``fields``) after checking every address of its host against ``policy``.

    Args:
        policy: the egress policy (``EgressPolicy(settings.enrich_allow_private, "MAGPIE_ENRICH_ALLOW_PRIVATE")``).
        timeout: seconds for connecting and for reading.
        max_bytes: largest body read; a longer body raises.
        headers: extra request headers (an API key...); never put in messages.
        fields: query parameters, URL-encoded and appended.
        resolve: ``getaddrinfo``-compatible resolver (tests).
        total_timeout: when given, seconds the whole body may take (a server that trickles bytes is cut).
    Returns:
        a :class:`Reply` of any status (the caller decides what a non-2xx means).
    Raises:
        FetchError: bad URL, a refused or unresolvable host, a network error, a body over ``max_bytes``, or
            a body still arriving after ``total_timeout``.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise FetchError(f"malformed URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError("URL must be http:// or https:// with a host")
    if parts.username is not None or parts.password is not None:
        raise FetchError("URL must not carry credentials")
    host = parts.hostname
    port = port or (443 if parts.scheme == "https" else 80)
    ip = _addresses(host, port, policy, resolve)[0]
    tmo = urllib3.Timeout(connect=timeout, read=timeout)
    if parts.scheme == "https":
        pool = urllib3.HTTPSConnectionPool(ip, port, timeout=tmo, retries=False, maxsize=1, cert_reqs="CERT_REQUIRED",
                                           ca_certs=certifi.where(), server_hostname=host, assert_hostname=host)
    else:
        pool = urllib3.HTTPConnectionPool(ip, port, timeout=tmo, retries=False, maxsize=1)
    shown = f"[{host}]" if ":" in host else host
    default = 443 if parts.scheme == "https" else 80
    hdrs = {"Host": shown if port == default else f"{shown}:{port}", "User-Agent": USER_AGENT,
            "Accept-Encoding": "identity", "Connection": "close", **(headers or {})}
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if fields:
        from urllib.parse import urlencode

        path += ("&" if parts.query else "?") + urlencode(fields)
    try:
        resp = pool.urlopen("GET", path, headers=hdrs, redirect=False, retries=False, preload_content=False,
                            assert_same_host=False)
        try:
            body = resp.read(max_bytes + 1) if total_timeout is None else \
                _read_until(resp, max_bytes + 1, time.monotonic() + total_timeout, f"{shown}:{port}")
        finally:
            resp.release_conn()
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise FetchError(f"GET {shown}:{port} failed: {exc.__class__.__name__}") from None
    finally:
        pool.close()
    if len(body) > max_bytes:
        raise FetchError(f"reply from {shown} is larger than {max_bytes} bytes")
    return Reply(resp.status, body, {k.lower(): v for k, v in resp.headers.items()})


__all__ = ["FetchError", "Reply", "get"]
