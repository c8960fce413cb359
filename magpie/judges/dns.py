"""A bounded, TTL-respecting DNS cache for judge and proxy host names, shared by a process's engines.

:class:`DnsCache` resolves through ``getaddrinfo`` on the running loop (the system's resolver: hosts
file, nsswitch) and keeps each answer for its TTL: the resolver's own when it gives one (a resolver
callable returning ``(addresses, ttl)``), else ``MAGPIE_DNS_TTL``, never longer. Failures are remembered
for ``MAGPIE_DNS_NEGATIVE_TTL`` seconds. At most ``MAGPIE_DNS_CACHE_SIZE`` names are kept (least recently
used leave first); concurrent lookups of one name share one resolution. IP literals never reach it.

:meth:`DnsCache.stats` gives ``hits``, ``misses``, ``negative_hits``, ``evictions``, ``size`` and
``max_size`` (the process's cache record carries them to the metrics exporter).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

Resolve = Callable[[str, int], Awaitable[tuple[list[str], float | None]]]


async def system_resolve(host: str, port: int) -> tuple[list[str], float | None]:
    """``getaddrinfo`` on the running loop: the distinct addresses, in the resolver's order, and no TTL.

    Raises ``OSError`` (``socket.gaierror``) when the name does not resolve."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos)), None


class DnsCache:
    """Host name -> addresses with a TTL, size-bounded (see the module doc).

    Args:
        max_size: most names kept (>= 1).
        ttl: seconds an answer is kept when the resolver gives no TTL, and the upper bound otherwise.
        negative_ttl: seconds a failure is remembered (0: not at all).
        resolve: ``await resolve(host, port) -> (addresses, ttl or None)``; default :func:`system_resolve`.
        clock: monotonic seconds (tests).

    Use on one event loop at a time (the engines of a check pool share its loop). Raises ``ValueError``
    for a max_size below 1 or a non-positive ttl.
    """

    def __init__(self, max_size: int = 10_000, ttl: float = 300.0, negative_ttl: float = 30.0, *,
                 resolve: Resolve | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size!r}")
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
        self.max_size = int(max_size)
        self.ttl = float(ttl)
        self.negative_ttl = max(0.0, float(negative_ttl))
        self._resolve = resolve or system_resolve
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, list[str] | None, str | None]] = OrderedDict()
        self._inflight: dict[str, asyncio.Future] = {}
        self.hits = self.misses = self.negative_hits = self.evictions = 0

    async def __call__(self, host: str, port: int = 0) -> list[str]:
        """The addresses of ``host`` (cached while fresh). Raises ``OSError`` when it does not resolve
        (a cached failure raises again until its negative TTL ends)."""
        key = host.lower()
        hit = self._entries.get(key)
        if hit is not None:
            expires, addrs, error = hit
            if self._clock() < expires:
                self._entries.move_to_end(key)
                if addrs is None:
                    self.negative_hits += 1
                    raise socket.gaierror(socket.EAI_NONAME, error or "name does not resolve")
                self.hits += 1
                return addrs
            del self._entries[key]
        self.misses += 1
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._lookup(key, port))
            self._inflight[key] = fut
            fut.add_done_callback(lambda _f, k=key: self._inflight.pop(k, None))
        return list(await asyncio.shield(fut))

    async def _lookup(self, key: str, port: int) -> list[str]:
        try:
            addrs, ttl = await self._resolve(key, port)
        except OSError as exc:
            if self.negative_ttl > 0:
                self._put(key, self._clock() + self.negative_ttl, None, str(exc)[:200])
            raise
        if not addrs:
            raise socket.gaierror(socket.EAI_NONAME, f"{key} has no address")
        life = self.ttl if ttl is None else max(0.0, min(float(ttl), self.ttl))
        if life > 0:
            self._put(key, self._clock() + life, list(addrs), None)
        return list(addrs)

    def _put(self, key: str, expires: float, addrs: list[str] | None, error: str | None) -> None:
        self._entries[key] = (expires, addrs, error)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        """Counters and size (see the module doc)."""
        return {"hits": self.hits, "misses": self.misses, "negative_hits": self.negative_hits,
                "evictions": self.evictions, "size": len(self._entries), "max_size": self.max_size}

    @classmethod
    def from_settings(cls, settings) -> DnsCache:
        """A cache sized and timed by ``MAGPIE_DNS_CACHE_SIZE``, ``MAGPIE_DNS_TTL``, ``MAGPIE_DNS_NEGATIVE_TTL``."""
        return cls(settings.dns_cache_size, settings.dns_ttl, settings.dns_negative_ttl)
