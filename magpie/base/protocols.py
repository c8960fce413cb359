"""The proxy protocols magpie checks, in one registry: every part that names a protocol reads it here.

The route parser and the list formats take their scheme words from :data:`SCHEME_WORDS`; the settings,
the CLI's choices, the web API's types, alert rules, exports, operator filters, judge pools, source
definitions, the schedule's payload and the database's check constraint take the names from
:data:`PROTOCOLS`; the check engine and the rotator dial through a protocol by its :attr:`Protocol.handshake`,
the judge plan picks a judge by :attr:`Protocol.tls_judge`, and curl-style proxy URLs use
:attr:`Protocol.proxy_scheme`.

Adding a protocol: an entry in :data:`REGISTRY` (with a handshake python-socks speaks for an https judge and
the check engine's bare path speaks for an http judge: HTTP, SOCKS4 and SOCKS5 today), a migration that
widens the ``routes.protocol`` check constraint, and, where the lab should serve it, a lab proxy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from python_socks import ProxyType


@dataclass(frozen=True, slots=True)
class Protocol:
    """One proxy protocol.

    Attributes:
        name: the route's protocol as stored and shown (``socks5``).
        default_port: the port servers of this protocol usually listen on (a hint for people; a route
            always names its port, and a list line without one is refused).
        handshake: how a check or a rotator goes through the proxy (python-socks' :class:`ProxyType`):
            ``HTTP`` is an absolute-URI GET for an http judge and CONNECT for an https judge, ``SOCKS4`` and
            ``SOCKS5`` the SOCKS handshakes.
        remote_dns: the proxy resolves the destination name (the judge's host is sent as a name);
            otherwise the checker resolves it once and sends the address.
        passwords: the handshake carries a password (SOCKS4 sends a user id only).
        proxy_scheme: the scheme of the proxy URL in curl and requests notation (``socks5h``).
        aliases: other scheme words of proxy lists read as this protocol (``socks5h``).
        tls_judge: a check prefers an https judge (the route is listed as a CONNECT proxy).
        grading: how the check's anonymity grade applies to routes of this protocol.
    """

    name: str
    default_port: int
    handshake: ProxyType
    remote_dns: bool
    passwords: bool
    proxy_scheme: str
    aliases: tuple[str, ...] = ()
    tls_judge: bool = False
    grading: str = ""

    @property
    def is_socks(self) -> bool:
        """True for a SOCKS handshake (its failures are classed ``SOCKSError``, not ``ProxyError``)."""
        return self.handshake is not ProxyType.HTTP


_HEADERS = ("graded by the judge's echo: transparent when the checker's own address shows, anonymous when "
            "proxy-revealing headers show, elite otherwise")
_TUNNEL = ("the proxy adds no HTTP headers to a tunnel: elite unless the checker's own address shows "
           "(transparent)")

REGISTRY: dict[str, Protocol] = {p.name: p for p in (
    Protocol("http", 8080, ProxyType.HTTP, remote_dns=True, passwords=True, proxy_scheme="http",
             grading=_HEADERS),
    Protocol("https", 8080, ProxyType.HTTP, remote_dns=True, passwords=True, proxy_scheme="http",
             tls_judge=True, grading="an HTTP proxy that accepts CONNECT (what proxy lists call https); " + _HEADERS),
    Protocol("socks4", 1080, ProxyType.SOCKS4, remote_dns=False, passwords=False, proxy_scheme="socks4",
             aliases=("socks4a",), grading=_TUNNEL),
    Protocol("socks5", 1080, ProxyType.SOCKS5, remote_dns=True, passwords=True, proxy_scheme="socks5h",
             aliases=("socks5h",), grading=_TUNNEL),
)}
"""Protocol name -> :class:`Protocol`, in the order shown to users."""

PROTOCOLS: tuple[str, ...] = tuple(REGISTRY)
"""Every protocol name (``("http", "https", "socks4", "socks5")``)."""

ProtocolName = Literal[PROTOCOLS]  # type: ignore[valid-type]
"""The names of :data:`PROTOCOLS` as a ``Literal`` type (request models and query parameters)."""

SCHEME_WORDS: dict[str, str] = {word: p.name for p in REGISTRY.values() for word in (p.name, *p.aliases)}
"""A proxy list's scheme word (a name or an alias, lower case) -> the protocol it is read as."""


def prefers_tls_judge(name: str) -> bool:
    """True when a check of a ``name`` route prefers an https judge (False for an unknown name)."""
    p = REGISTRY.get(name)
    return p is not None and p.tls_judge


def protocol(name: str) -> Protocol:
    """The :class:`Protocol` named ``name``. Raises ``ValueError`` naming the known protocols."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown protocol {name!r}; expected one of {', '.join(PROTOCOLS)}") from None


def sql_check(column: str = "protocol") -> str:
    """The SQL check constraint text that keeps ``column`` to :data:`PROTOCOLS`."""
    return f"{column} IN ({', '.join(repr(p) for p in PROTOCOLS)})"


__all__ = ["PROTOCOLS", "REGISTRY", "SCHEME_WORDS", "Protocol", "ProtocolName", "prefers_tls_judge", "protocol",
           "sql_check"]
