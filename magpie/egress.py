"""The egress guard: which addresses magpie may connect out to (proxies, judges, webhook targets).

Magpie connects to addresses its users supply, so by default it refuses every address that is not a
public unicast one: loopback, private (RFC 1918), shared/CGNAT (100.64/10), link-local (incl. cloud
metadata at 169.254.169.254), multicast, broadcast, unspecified, documentation and other reserved ranges,
IPv6 unique-local (fc00::/7) and link-local (fe80::/10), and IPv6 addresses that embed such an IPv4
address: IPv4-mapped (``::ffff:a.b.c.d``), IPv4-compatible (``::a.b.c.d``), 6to4 (``2002:AABB:CCDD::/48``),
NAT64 (``64:ff9b::/96`` and ``64:ff9b:1::/48``) and Teredo (``2001:0::/32``, server and client parts).

An :class:`EgressPolicy` may allow chosen networks back (``MAGPIE_CHECK_ALLOW_PRIVATE`` for checks,
``MAGPIE_WEBHOOK_ALLOW_PRIVATE`` for webhooks): a comma-separated list of CIDRs, ``true`` for every
non-public range, or ``false``/empty for none. Unspecified and multicast addresses are never allowed.
Host names are checked after resolution, and the caller connects to the address that passed (no second
lookup a hostile resolver could answer differently).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from functools import lru_cache

from magpie.errors import MagpieError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_SHARED = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_SIXTOFOUR = ipaddress.ip_network("2002::/16")
_TEREDO = ipaddress.ip_network("2001::/32")


def is_ip_literal(host: str) -> bool:
    """True when ``host`` is an IPv4 or IPv6 address (no brackets, optional ``%zone``), not a name."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        return False


class EgressRefused(MagpieError, ValueError):
    """A destination address is outside what the egress policy allows; the message names it and why."""


def _embedded_v4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries (mapped, compatible, 6to4, NAT64, Teredo)."""
    out = []
    if ip.ipv4_mapped is not None:
        out.append(ip.ipv4_mapped)
    n = int(ip)
    if n >> 32 == 0 and n > 1:  # IPv4-compatible ::a.b.c.d (not :: or ::1)
        out.append(ipaddress.IPv4Address(n & 0xFFFFFFFF))
    if ip in _SIXTOFOUR:
        out.append(ipaddress.IPv4Address((n >> 80) & 0xFFFFFFFF))
    if any(ip in net for net in _NAT64):
        out.append(ipaddress.IPv4Address(n & 0xFFFFFFFF))
    if ip in _TEREDO:
        out.append(ipaddress.IPv4Address((n >> 64) & 0xFFFFFFFF))  # server
        out.append(ipaddress.IPv4Address(~n & 0xFFFFFFFF))  # client, obfuscated by XOR
    return out


_RFC1918 = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))


def _category(ip: IPAddress) -> str | None:
    """Why ``ip`` is not a public unicast address (a phrase such as ``"loopback"``), or None when it is one."""
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_multicast:
        return "multicast"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if isinstance(ip, ipaddress.IPv4Address):
        if ip in _SHARED:
            return "shared address space (CGNAT)"
        if ip == ipaddress.IPv4Address("255.255.255.255"):
            return "broadcast"
        if any(ip in net for net in _RFC1918):
            return "private"
        if ip.is_private or ip.is_reserved or not ip.is_global:
            return "reserved"
        return None
    if ip in ipaddress.ip_network("fc00::/7"):
        return "unique-local"
    embedded = _embedded_v4(ip)
    for v4 in embedded:
        inner = _category(v4)
        if inner is not None:
            return f"an IPv6 form of {inner} IPv4 {v4}"
    if embedded:
        return None  # mapped, compatible or a transition prefix carrying public IPv4 addresses
    if ip.is_private or ip.is_reserved or not ip.is_global:
        return "reserved"
    return None


def parse_allow(value: str | bool | None) -> tuple[bool, tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]]:
    """Parse an allow setting: ``(allow_all_private, networks)``.

    Accepts ``True``/``"true"``/``"1"`` (every non-public range), ``False``/``"false"``/``""``/None (none),
    or a comma-separated list of CIDRs or addresses. Raises ``ValueError`` naming a malformed entry.
    """
    if value is None or value is False:
        return False, ()
    if value is True:
        return True, ()
    text = str(value).strip()
    if text.lower() in ("", "false", "0", "no", "off"):
        return False, ()
    if text.lower() in ("true", "1", "yes", "on"):
        return True, ()
    nets = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            nets.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"not a network or address: {part!r}") from None
    return False, tuple(nets)


_LEGACY_IPV4 = re.compile(r"(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}")


def legacy_ipv4(host: str) -> str | None:
    """The dotted-quad IPv4 address a numeric host spelling stands for, or None for any other name.

    ``inet_aton`` (and so ``getaddrinfo``) accepts shortened, hexadecimal, octal and single-number forms
    (``127.1``, ``0x7f.1``, ``0177.0.0.1``, ``2130706433``, ``0``) that :mod:`ipaddress` rejects; a guard
    checking only canonical literals would let them through to loopback.
    """
    if not _LEGACY_IPV4.fullmatch(host):
        return None
    try:
        return socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        return None


class EgressPolicy:
    """Decides whether magpie may connect to an address.

    Args:
        allow: see :func:`parse_allow` (``True``, ``False``, or CIDRs such as ``"127.0.0.0/8,::1"``).
        setting: the setting's name, used in refusal messages.

    Raises ``ValueError`` for a malformed ``allow``.
    """

    def __init__(self, allow: str | bool | None = False, setting: str = "MAGPIE_CHECK_ALLOW_PRIVATE"):
        self.allow_all, self.networks = parse_allow(allow)
        self.setting = setting
        self._refusal = lru_cache(maxsize=65536)(self._refusal_uncached)

    def _refusal_uncached(self, address: str) -> str | None:
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return f"{address!r} is not an IP address"
        why = _category(ip)
        if why is None:
            return None
        if ip.is_unspecified or ip.is_multicast:
            return f"{address} is {why}"
        if self.allow_all or any(ip in net for net in self.networks if net.version == ip.version):
            return None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            v4 = ip.ipv4_mapped
            if any(v4 in net for net in self.networks if net.version == 4):
                return None
        return f"{address} is {why} (allow it with {self.setting})"

    def refusal(self, address: str) -> str | None:
        """Why connecting to IP ``address`` is refused, or None when it is allowed (cached per address)."""
        return self._refusal(address)

    def check_address(self, address: str) -> None:
        """Raise :class:`EgressRefused` unless IP ``address`` is allowed."""
        why = self._refusal(address)
        if why is not None:
            raise EgressRefused(f"destination refused: {why}")

    def allowed(self, addresses: Iterable[str]) -> list[str]:
        """The allowed ones of resolved ``addresses``, in order. Raises :class:`EgressRefused` naming the
        first refusal when none is allowed (or the input is empty)."""
        addresses = list(addresses)
        ok = [a for a in addresses if self._refusal(a) is None]
        if not ok:
            why = self._refusal(addresses[0]) if addresses else "no address"
            raise EgressRefused(f"destination refused: {why}")
        return ok

    def check_host(self, host: str) -> None:
        """Refuse at import time what can be refused without resolving: IP literals outside the policy and
        ``localhost`` names. Host names are checked again after resolution, before any connection."""
        h = host.strip("[]").rstrip(".").lower()
        if h == "localhost" or h.endswith(".localhost"):
            self.check_address("127.0.0.1")
            return
        try:
            ipaddress.ip_address(h.split("%", 1)[0])
        except ValueError:
            legacy = legacy_ipv4(h)
            if legacy is not None:  # 127.1, 0x7f000001, 2130706433, 0177.0.0.1: resolvers read them as IPv4
                self.check_address(legacy)
            return
        self.check_address(h)
