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

**Deny-by-default egress** (``MAGPIE_EGRESS_ONLY``, e.g. ``127.0.0.0/8,::1``): when set, it is an
allow-list over every destination of the process. Every :class:`EgressPolicy` refuses an address outside
it on top of its own rules (checks, judges, webhooks, blacklist and enrichment fetches, rotator upstreams),
and :func:`install_socket_guard` adds a process-wide audit hook (:pep:`578`) that refuses any Python
socket ``connect``/``sendto`` outside it (Redis, the broker, SMTP, the lab's proxies), so a path without a
policy of its own cannot dial out either. Importing :mod:`magpie` installs the hook when the variable is
set. Connections made outside Python's socket module (uvloop transports, libpq) are covered by the
explicit checks only.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import sys
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


def parse_ports(text: str) -> tuple[tuple[int, int], ...]:
    """``"80,443,8000-8100"`` -> ``((80, 80), (443, 443), (8000, 8100))``.

    Raises ``ValueError`` naming the malformed entry (not a port, or outside 1-65535)."""
    out = []
    for part in str(text or "").split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d{1,5})(?:\s*-\s*(\d{1,5}))?", part)
        lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
        if not m or not 1 <= lo <= hi <= 65535:
            raise ValueError(f"expected ports or ranges within 1-65535 such as 80,443,8000-8100, got {part!r}")
        out.append((lo, hi))
    if not out:
        raise ValueError(f"expected at least one port, got {text!r}")
    return tuple(out)


def format_ports(ranges: tuple[tuple[int, int], ...]) -> str:
    """The stored form of :func:`parse_ports` output (``"80,443,8000-8100"``)."""
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)


class EgressRefused(MagpieError, ValueError):
    """A destination address is outside what the egress policy allows; the message names it and why."""


class EgressBlocked(EgressRefused, PermissionError):
    """A socket ``connect``/``sendto`` outside ``MAGPIE_EGRESS_ONLY``, stopped by the process-wide guard
    before the dial. Also an ``OSError``, so callers that treat a failed connection as one see one."""


EGRESS_ONLY = "MAGPIE_EGRESS_ONLY"
"""The environment variable of the deny-by-default allow-list (inherited by subprocesses)."""

LOOPBACK = "127.0.0.0/8,::1"
"""The allow-list the test suite, the demo, the lab and the benchmarks run with."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@lru_cache(maxsize=8)
def _parse_only(value: str) -> tuple[Network, ...] | None:
    """The networks of a ``MAGPIE_EGRESS_ONLY`` value; None when empty (no restriction)."""
    if not value.strip():
        return None
    allow_all, nets = parse_allow(value)
    if allow_all or value.strip().lower() in ("false", "0", "no", "off"):
        raise ValueError(f"{EGRESS_ONLY} takes CIDRs or addresses such as {LOOPBACK!r}, not {value!r}")
    return nets


def parse_egress_only(value: str | None) -> tuple[Network, ...] | None:
    """Parse a ``MAGPIE_EGRESS_ONLY`` value: a comma-separated list of CIDRs or addresses; None or empty
    means no restriction (returns None). Raises ``ValueError`` naming a malformed entry, or for
    ``true``/``false`` (the allow-list must name its networks)."""
    return _parse_only(value or "")


def egress_only() -> tuple[Network, ...] | None:
    """The networks ``MAGPIE_EGRESS_ONLY`` (environment, read on every call) allows, or None when unset.
    A malformed value allows nothing (an empty tuple): a typo never opens the egress."""
    try:
        return _parse_only(os.environ.get(EGRESS_ONLY, ""))
    except ValueError:
        return ()


def _in(ip: IPAddress, nets: tuple[Network, ...]) -> bool:
    if any(ip in net for net in nets if net.version == ip.version):
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return any(ip.ipv4_mapped in net for net in nets if net.version == 4)
    return False


@lru_cache(maxsize=65536)
def _only_refusal(address: str, value: str) -> str | None:
    try:
        nets = _parse_only(value)
    except ValueError:
        return f"{EGRESS_ONLY} is malformed ({value!r}): nothing may be dialled"
    if nets is None:
        return None
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"{address!r} is not an IP address"
    if _in(ip, nets):
        return None
    return f"{address} is outside {EGRESS_ONLY} ({value})"


def egress_only_refusal(address: str) -> str | None:
    """Why ``MAGPIE_EGRESS_ONLY`` refuses IP ``address`` (a phrase naming the address and the setting), or
    None when the variable is unset or the address is inside it (cached per address and value)."""
    return _only_refusal(address, os.environ.get(EGRESS_ONLY, ""))


def check_dial(host: str, port: int) -> None:
    """Refuse before a blocking dial of ``host:port`` (a name is resolved with ``getaddrinfo``) unless every
    address it resolves to is inside ``MAGPIE_EGRESS_ONLY``; a no-op when the variable is unset.
    Raises :class:`EgressRefused` naming the address and the setting; resolver errors (``OSError``) pass."""
    if not os.environ.get(EGRESS_ONLY, "").strip():
        return
    h = host.strip("[]")
    addrs = [h] if is_ip_literal(h) else list(dict.fromkeys(
        info[4][0] for info in socket.getaddrinfo(h, port, type=socket.SOCK_STREAM)))
    for a in addrs:
        why = egress_only_refusal(a)
        if why is not None:
            raise EgressRefused(f"destination refused: {why}")


_blocked: list[tuple[str, object]] = []
_installed = False
_installed_value = ""


def blocked_dials() -> list[tuple[str, object]]:
    """``(event, address)`` of every dial the socket guard stopped in this process, oldest first (tests
    assert on it; at most the last 1,000)."""
    return list(_blocked)


def _guard_hook(event: str, args: tuple) -> None:
    if event not in ("socket.connect", "socket.sendto"):
        return
    value = os.environ.get(EGRESS_ONLY, "") or _installed_value
    if not value.strip():
        return
    sock, address = args[0], args[1]
    if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6) \
            or not isinstance(address, tuple):
        return
    host = str(address[0])
    if is_ip_literal(host):
        why = _only_refusal(host, value)
    else:
        try:
            addrs = {info[4][0] for info in socket.getaddrinfo(host, address[1], type=socket.SOCK_STREAM)}
        except OSError:
            return  # the connect itself fails the same way
        why = next((w for w in (_only_refusal(a, value) for a in sorted(addrs)) if w is not None), None)
    if why is not None:
        _blocked.append((event, address))
        del _blocked[:-1000]
        raise EgressBlocked(f"connection refused by the egress guard: {why}")


def install_socket_guard() -> bool:
    """Add the process-wide audit hook that refuses every Python socket ``connect``/``sendto`` to an IPv4
    or IPv6 address outside ``MAGPIE_EGRESS_ONLY`` (read on every dial, so a later change applies; once
    installed, unsetting the variable falls back to the value it had then: the guard never switches off).
    Installed at most once per process (an audit hook cannot be removed). Returns True when this call
    installed it."""
    global _installed, _installed_value
    if _installed:
        return False
    _installed_value = os.environ.get(EGRESS_ONLY, "")
    sys.addaudithook(_guard_hook)
    _installed = True
    return True


def restrict_to_loopback() -> None:
    """Set ``MAGPIE_EGRESS_ONLY`` to loopback for this process and its children unless it is already set to
    a non-empty value, and install the socket guard (the demo, the lab and the benchmarks call it)."""
    if not os.environ.get(EGRESS_ONLY, "").strip():
        os.environ[EGRESS_ONLY] = LOOPBACK
    install_socket_guard()


class EgressOnlyPolicy:
    """Stand-in for callers that have no policy of their own (no private-range rules): refuses only what
    ``MAGPIE_EGRESS_ONLY`` refuses. Same methods as :class:`EgressPolicy`."""

    setting = EGRESS_ONLY

    def refusal(self, address: str) -> str | None:
        """Why ``MAGPIE_EGRESS_ONLY`` refuses IP ``address``, or None."""
        return egress_only_refusal(address)

    def check_address(self, address: str) -> None:
        """Raise :class:`EgressRefused` unless IP ``address`` is inside ``MAGPIE_EGRESS_ONLY``."""
        why = egress_only_refusal(address)
        if why is not None:
            raise EgressRefused(f"destination refused: {why}")

    def allowed(self, addresses: Iterable[str]) -> list[str]:
        """The ones of ``addresses`` inside ``MAGPIE_EGRESS_ONLY``; raises :class:`EgressRefused` when none
        is."""
        addresses = list(addresses)
        ok = [a for a in addresses if egress_only_refusal(a) is None]
        if not ok:
            why = egress_only_refusal(addresses[0]) if addresses else "no address"
            raise EgressRefused(f"destination refused: {why}")
        return ok

    def check_host(self, host: str) -> None:
        """Refuse an IP literal outside ``MAGPIE_EGRESS_ONLY`` (names are checked after resolution)."""
        h = host.strip("[]").rstrip(".")
        if is_ip_literal(h):
            self.check_address(h)


def egress_only_policy() -> EgressOnlyPolicy | None:
    """An :class:`EgressOnlyPolicy` while ``MAGPIE_EGRESS_ONLY`` is set, else None (no guard)."""
    return EgressOnlyPolicy() if os.environ.get(EGRESS_ONLY, "").strip() else None


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
        """Why connecting to IP ``address`` is refused, or None when it is allowed (cached per address).
        An address these rules allow must also be inside ``MAGPIE_EGRESS_ONLY`` when that is set."""
        return self._refusal(address) or egress_only_refusal(address)

    def check_address(self, address: str) -> None:
        """Raise :class:`EgressRefused` unless IP ``address`` is allowed."""
        why = self.refusal(address)
        if why is not None:
            raise EgressRefused(f"destination refused: {why}")

    def allowed(self, addresses: Iterable[str]) -> list[str]:
        """The allowed ones of resolved ``addresses``, in order. Raises :class:`EgressRefused` naming the
        first refusal when none is allowed (or the input is empty)."""
        addresses = list(addresses)
        ok = [a for a in addresses if self.refusal(a) is None]
        if not ok:
            why = self.refusal(addresses[0]) if addresses else "no address"
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
