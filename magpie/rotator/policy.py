"""Where a rotator may tunnel to, and which upstream addresses it may dial.

A rotator is a proxy anyone who reaches its port may use, so the destinations its clients ask for pass a
:class:`DestinationPolicy` before any upstream is tried: the egress guard's rules
(:class:`magpie.base.egress.EgressPolicy`: loopback, private, link-local, reserved... refused unless
``MAGPIE_ROTATOR_ALLOW_PRIVATE`` allows them back) and a port allow-list (``MAGPIE_ROTATOR_ALLOWED_PORTS``,
or the rotator's own ``allowed_ports``). A destination name is resolved by the rotator and every address
must pass; the upstream is then handed the checked address, never the name, so no later lookup can
answer differently. Upstream routes given by name are resolved before each dial and their addresses
checked the same way (:func:`resolve_allowed`), against the checks' policy.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from magpie.base.egress import EgressPolicy, EgressRefused, egress_only_refusal, is_ip_literal, parse_ports

DEFAULT_PORTS = "80,443"
"""Destination ports a rotator tunnels to unless configured otherwise."""


class DestinationRefused(EgressRefused):
    """A client asked for a destination the rotator's policy refuses; the message names it and why."""


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` from the loop's ``getaddrinfo`` (TCP), deduplicated, in order.
    Raises ``OSError`` when the name does not resolve."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


async def resolve_allowed(host: str, port: int, egress: EgressPolicy | None, resolver=system_resolver) -> str:
    """The address to dial for upstream ``host``: itself when an IP literal, else its first resolved address
    the ``egress`` policy allows (with no policy, the first ``MAGPIE_EGRESS_ONLY`` allows, every one when it
    is unset). Raises :class:`EgressRefused` (no address allowed) or ``OSError``."""
    if is_ip_literal(host):
        addrs = [host]
    else:
        if egress is not None:
            egress.check_host(host)
        addrs = await resolver(host, port)
    if egress is not None:
        return egress.allowed(addrs)[0]
    for a in addrs:
        if egress_only_refusal(a) is None:
            return a
    raise EgressRefused(f"destination refused: {egress_only_refusal(addrs[0]) if addrs else 'no address'}")


class DestinationPolicy:
    """Decides whether a rotator may tunnel to ``host:port``.

    Args:
        egress: the address rules (an :class:`EgressPolicy` built from ``MAGPIE_ROTATOR_ALLOW_PRIVATE``).
        ports: the deployment's allowed destination ports (:func:`parse_ports` syntax).
        resolver: ``await resolver(host, port) -> list[str]`` (default :func:`system_resolver`).
        resolve_timeout: seconds a destination name may take to resolve (then it is refused).

    Raises ``ValueError`` for malformed ``ports``.
    """

    def __init__(self, egress: EgressPolicy, ports: str = DEFAULT_PORTS, resolver=system_resolver,
                 resolve_timeout: float = 10.0):
        self.egress = egress
        self.resolve_timeout = float(resolve_timeout)
        self.ports = parse_ports(ports)
        self.resolver = resolver

    def port_allowed(self, port: int, own: tuple[tuple[int, int], ...] | None = None) -> bool:
        """True when ``port`` is in ``own`` (a rotator's list, replacing the deployment's) or the default."""
        return any(lo <= port <= hi for lo, hi in (own or self.ports))

    async def check(self, host: str, port: int, own_ports: tuple[tuple[int, int], ...] | None = None) -> str:
        """The checked address to hand the upstream for destination ``host:port`` (an IPv4 one when the
        name has one).

        Every resolved address of a name must pass (one refused address refuses the name).
        Raises :class:`DestinationRefused` naming the port or the address and why."""
        if not self.port_allowed(port, own_ports):
            raise DestinationRefused(f"destination refused: port {port} is not an allowed port "
                                     "(MAGPIE_ROTATOR_ALLOWED_PORTS or the rotator's --allowed-ports)")
        name = host.strip("[]")
        try:
            if is_ip_literal(name):
                addrs = [name.split("%", 1)[0]]
            else:
                self.egress.check_host(name)
                try:
                    addrs = await asyncio.wait_for(self.resolver(name, port), self.resolve_timeout)
                except (OSError, UnicodeError, TimeoutError):
                    raise DestinationRefused(f"destination refused: {name[:100]!r} does not resolve") from None
            for a in addrs:
                self.egress.check_address(a)
        except DestinationRefused:
            raise
        except EgressRefused as exc:
            raise DestinationRefused(str(exc)) from None
        if not addrs:
            raise DestinationRefused(f"destination refused: {name[:100]!r} has no address")
        ips = [ipaddress.ip_address(a.split("%", 1)[0]) for a in addrs]
        return str(next((ip for ip in ips if ip.version == 4), ips[0]))  # most upstreams speak IPv4


__all__ = ["DEFAULT_PORTS", "DestinationPolicy", "DestinationRefused", "format_ports", "parse_ports",
           "resolve_allowed", "system_resolver"]
