"""Route populations for the lab: many distinct proxy-list lines through a few lab servers.

Every lab server accepts any credentials, and the route hash covers credentials, so lines that differ
only by user name are distinct routes through one address: :func:`population_lines` makes ``n`` of them,
:func:`spread_lines` spreads them over several addresses (e.g. the tarpit's ports,
:attr:`magpie.lab.faults.FaultLab.tarpit_addresses`) and alternates protocols, :func:`mix_lines` a
deterministic mix over several servers (e.g. :attr:`magpie.lab.faults.FaultLab.addresses`) in given shares,
split by :func:`mix_counts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from magpie.base.protocols import PROTOCOLS


def population_lines(address: str, n: int, protocol: str = "http", start: int = 0) -> list[str]:
    """``n`` proxy-list lines for ``n`` distinct routes through the one server at ``address``.

    The routes differ only by user name (``{protocol}://u{i}:x@{address}`` for i in
    ``[start, start + n)``); the route hash covers credentials, so each is a distinct route, and every
    fault server accepts any credentials.

    Args:
        address: ``"host:port"`` (IPv6 bracketed).
        n: number of lines (>= 0).
        protocol: one of :data:`magpie.base.protocols.PROTOCOLS`.
        start: first index; disjoint index ranges give disjoint routes.

    Returns:
        a list of ``n`` str lines without line endings.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if n < 0 or start < 0:
        raise ValueError(f"n and start must be >= 0: {n}, {start}")
    prefix = f"{protocol}://u"
    suffix = f":x@{address}"
    return [f"{prefix}{i}{suffix}" for i in range(start, start + n)]


def spread_lines(addresses: Sequence[str], n: int, protocols: Sequence[str] = ("http",),
                 start: int = 0) -> list[str]:
    """``n`` lines for ``n`` distinct routes spread over ``addresses``, cycling through ``protocols``.

    Line ``j`` is ``{protocols[j % P]}://u{start + j}:x@{addresses[(j // P) % A]}``: consecutive lines
    alternate protocols, and every address gets each protocol. With one address and one protocol it
    equals :func:`population_lines`.

    Args:
        addresses: one or more ``"host:port"``.
        n: number of lines (>= 0).
        protocols: one or more of :data:`magpie.base.protocols.PROTOCOLS`.
        start: first user index.

    Returns a list of ``n`` str lines. Raises ValueError for an empty ``addresses``/``protocols``, an
    unknown protocol or a negative ``n``/``start``.
    """
    if not addresses or not protocols:
        raise ValueError("addresses and protocols must not be empty")
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad:
        raise ValueError(f"protocol {bad[0]!r} is not one of {', '.join(PROTOCOLS)}")
    if n < 0 or start < 0:
        raise ValueError(f"n and start must be >= 0: {n}, {start}")
    n_p, n_a = len(protocols), len(addresses)
    return [f"{protocols[j % n_p]}://u{start + j}:x@{addresses[(j // n_p) % n_a]}" for j in range(n)]


def mix_counts(n: int, shares: Mapping[str, float]) -> dict[str, int]:
    """Split ``n`` by ``shares`` (non-negative weights, normalised by their sum) into integer counts that
    sum to ``n`` (largest remainder; ties go to the kind listed first)."""
    if n < 0:
        raise ValueError(f"n must be >= 0: {n}")
    if any(w < 0 for w in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError("shares must be non-negative with a positive sum")
    total = sum(shares.values())
    exact = {k: n * w / total for k, w in shares.items()}
    counts = {k: int(v) for k, v in exact.items()}
    order = sorted(shares, key=lambda k: (-(exact[k] - counts[k]), list(shares).index(k)))
    for k in order[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def mix_lines(addresses: Mapping[str, str | Sequence[str]], n: int, shares: Mapping[str, float],
              protocol: str = "http",
              protocols: Mapping[str, Sequence[str]] | None = None) -> list[tuple[str, str]]:
    """A deterministic mixed population of ``n`` distinct routes, as ``(kind, line)`` pairs.

    Args:
        addresses: kind -> ``"host:port"`` or a list of them (e.g. :attr:`FaultLab.addresses`, with
            ``"tarpit"`` replaced by :attr:`FaultLab.tarpit_addresses`); every kind in ``shares`` must be
            present.
        n: total number of routes.
        shares: kind -> weight, e.g. ``{"tarpit": .70, "refused": .10, "echo": .15, "slow": .05}``;
            counts follow :func:`mix_counts`.
        protocol: protocol of the lines of every kind not in ``protocols``.
        protocols: kind -> protocols its lines cycle through (e.g. ``{"tarpit": ("http", "socks5")}``).

    Returns:
        ``n`` pairs, the kinds spread evenly through the list (any prefix has about the same mix), each
        line from :func:`spread_lines` for its kind (its addresses and protocols).
    """
    missing = [k for k in shares if k not in addresses]
    if missing:
        raise KeyError(f"no address for {', '.join(missing)}")
    counts = mix_counts(n, shares)
    slots = []
    for order, (kind, c) in enumerate(counts.items()):
        slots += [((m + 0.5) / c, order, kind) for m in range(c)]
    slots.sort()
    protocols = protocols or {}

    def listed(v: str | Sequence[str]) -> Sequence[str]:
        return [v] if isinstance(v, str) else v

    lines = {k: iter(spread_lines(listed(addresses[k]), c, protocols.get(k, (protocol,))))
             for k, c in counts.items()}
    return [(kind, next(lines[kind])) for _, _, kind in slots]
