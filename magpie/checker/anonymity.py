"""Anonymity grading of a proxy from a judge's echo of the request that came through it.

Levels, from worst to best:

- ``"transparent"``: the checker's own address is visible to the judge, either as the connecting
  address or inside any request header (``X-Forwarded-For: 203.0.113.9, 10.0.0.1``, ``Forwarded: for=…``).
- ``"anonymous"``: the own address is hidden, but a header reveals that a proxy was used (``Via`` …).
- ``"elite"``: neither.

:func:`classify` is pure: it never does I/O.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Collection, Iterator, Mapping

TRANSPARENT = "transparent"
ANONYMOUS = "anonymous"
ELITE = "elite"
LEVELS = (TRANSPARENT, ANONYMOUS, ELITE)

PROXY_HEADERS: frozenset[str] = frozenset(
    h.lower()
    for h in (
        "Via",
        "X-Forwarded-For",
        "Forwarded",
        "Forwarded-For",
        "Forwarded-For-IP",
        "X-Forwarded",
        "X-Forwarded-Host",
        "X-Forwarded-Proto",
        "X-Forwarded-Port",
        "X-Forwarded-Server",
        "X-Real-IP",
        "X-Proxy-ID",
        "X-Proxy-Connection",
        "Proxy-Connection",
        "Proxy-Authorization",
        "Client-IP",
        "X-Client-IP",
        "True-Client-IP",
        "X-Originating-IP",
        "X-Remote-IP",
        "X-Remote-Addr",
        "X-Cluster-Client-IP",
        "X-Coming-From",
        "Coming-From",
        "X-Via",
        "X-BlueCoat-Via",
    )
)
"""Lower-case names of request headers that reveal a proxy on the way (compare case-insensitively)."""

# Headers naming the *server* (the judge), never the client: in a loopback lab the judge's own
# address 127.0.0.1 would otherwise look like a leak of the checker's 127.0.0.1.
_SERVER_SIDE_HEADERS = frozenset(
    {"host", "x-forwarded-host", "x-forwarded-server", "x-host", "referer", "origin"}
)

_TOKEN_SPLIT = re.compile(r"[\s,;]+")
_BRACKETED = re.compile(r"^\[([^\]]+)\](?::\d+)?$")


@functools.lru_cache(maxsize=4096)
def normalize_ip(text: str) -> str | None:
    """Canonical text of an IP address found in ``text``, or ``None`` when it is not one.

    Accepts ``1.2.3.4``, ``1.2.3.4:5678``, ``[::1]:80``, ``"[2001:db8::1]"``, ``fe80::1%eth0`` and
    IPv4-mapped IPv6 (``::ffff:10.0.0.1`` becomes ``10.0.0.1``).
    """
    s = text.strip().strip('"').strip()
    m = _BRACKETED.match(s)
    if m:
        s = m.group(1)
    elif s.count(":") == 1:  # IPv4 with a port
        s = s.split(":", 1)[0]
    s = s.split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(s)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def _addresses_in(value: str) -> Iterator[str]:
    """Every IP address written in one header value (comma/space/semicolon lists; ``for=`` pairs)."""
    for token in _TOKEN_SPLIT.split(value):
        if not token:
            continue
        if "=" in token:
            key, _, token = token.partition("=")
            # Forwarded: only ``for=`` names the client; ``by=`` is the proxy, ``host=`` the judge.
            if key.strip().lower() != "for":
                continue
        ip = normalize_ip(token)
        if ip is not None:
            yield ip


def _own_set(own_addresses: Collection[str]) -> frozenset[str]:
    if isinstance(own_addresses, frozenset):  # the engine's (a few per process): normalized once
        return _own_frozen(own_addresses)
    return _normalized(own_addresses)


def _normalized(own_addresses: Collection[str]) -> frozenset[str]:
    return frozenset(normalize_ip(a) or a.strip().lower() for a in own_addresses if a and a.strip())


_own_frozen = functools.lru_cache(maxsize=16)(_normalized)


def classify(echo: Mapping, own_addresses: Collection[str]) -> str | None:
    """Grade a proxy from a judge echo.

    Args:
        echo: the judge's JSON object; uses ``echo["remote_addr"]`` (str) and ``echo["headers"]``
            (mapping name -> value; names are case-insensitive). Missing or odd-typed parts are tolerated.
        own_addresses: the checker's own addresses as the judge sees them when reached directly
            (IPv4 or IPv6 text, any usual notation).

    Returns:
        ``"transparent"``, ``"anonymous"`` or ``"elite"``; ``None`` when ``own_addresses`` is empty,
        since without knowing the own address no level can be claimed.
    """
    own = _own_set(own_addresses)
    if not own:
        return None
    headers = echo.get("headers") if isinstance(echo, Mapping) else None
    if not isinstance(headers, Mapping):
        headers = {}
    remote = echo.get("remote_addr") if isinstance(echo, Mapping) else None
    if remote is not None and (normalize_ip(str(remote)) or str(remote).strip().lower()) in own:
        return TRANSPARENT
    for name, value in headers.items():
        lname = str(name).strip().lower()
        if lname in _SERVER_SIDE_HEADERS or value is None:
            continue
        if any(ip in own for ip in _addresses_in(str(value))):
            return TRANSPARENT
    if any(str(name).strip().lower() in PROXY_HEADERS for name in headers):
        return ANONYMOUS
    return ELITE
