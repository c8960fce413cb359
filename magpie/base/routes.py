"""The route value: one proxy endpoint (protocol, host, port, optional credentials).

A :class:`Route` is what the parser yields, what the keyed route hash is computed over and what the
checker dials. Hosts are normalised (lower-case names, IPv6 without brackets in compressed form).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import quote

@dataclass(frozen=True, slots=True)
class Route:
    """One proxy route.

    Attributes:
        protocol: one of :data:`magpie.base.protocols.PROTOCOLS`.
        host: IPv4 address, IPv6 address without brackets, or a lower-case host name.
        port: 1..65535.
        username / password: proxy credentials or ``None``.
    """

    protocol: str
    host: str
    port: int
    username: str | None = None
    password: str | None = None

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host

    @property
    def hostport(self) -> str:
        """``host:port`` with IPv6 hosts bracketed."""
        host = f"[{self.host}]" if self.is_ipv6 else self.host
        return f"{host}:{self.port}"

    def normalized(self) -> str:
        """Canonical text the keyed route hash is computed over (credentials included, percent-encoded)."""
        return self.url()

    def url(self) -> str:
        """``scheme://[user:pass@]host:port`` with credentials percent-encoded (for requests' ``proxies``)."""
        auth = ""
        if self.username is not None:
            auth = quote(self.username, safe="")
            if self.password is not None:
                auth += ":" + quote(self.password, safe="")
            auth += "@"
        return f"{self.protocol}://{auth}{self.hostport}"

    def display(self) -> str:
        """Like :meth:`url` but with the password masked; safe for logs and tables."""
        auth = f"{self.username}:***@" if self.username is not None else ""
        return f"{self.protocol}://{auth}{self.hostport}"


def normalize_host(host: str) -> str:
    """Return ``host`` in canonical form; raises ``ValueError`` for an invalid address or name."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        return str(ipaddress.IPv6Address(h[1:-1]))
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        pass
    name = h.rstrip(".").lower()
    labels = name.split(".")
    if not name or len(name) > 253 or any(
        not lab or len(lab) > 63 or lab.startswith("-") or lab.endswith("-")
        or not all(c.isalnum() or c in "-_" for c in lab)
        for lab in labels
    ):
        raise ValueError(f"bad address {host!r}")
    if all(lab.isdigit() for lab in labels):
        raise ValueError(f"bad address {host!r}")
    return name
