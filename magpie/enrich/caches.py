"""Bounded in-process caches with a TTL, and their hit/miss/size metrics.

:class:`TTLCache` keeps at most ``max_size`` entries (least recently used leave first) for at most ``ttl``
seconds each, and counts hits, misses, expirations and evictions. Every cache made here registers itself by
name; :class:`CacheCollector` exports all of them for Prometheus as ``magpie_enrich_cache_hits_total``,
``magpie_enrich_cache_misses_total``, ``magpie_enrich_cache_evictions_total`` and
``magpie_enrich_cache_size`` / ``magpie_enrich_cache_max_size`` (label ``cache``). Thread-safe.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable

_MISSING = object()
_REGISTRY: weakref.WeakValueDictionary[str, TTLCache] = weakref.WeakValueDictionary()


class TTLCache:
    """A size- and age-bounded mapping.

    Args:
        name: the ``cache`` label of its metrics (the newest cache of a name is the one exported).
        max_size: most entries (>= 1).
        ttl: seconds an entry is served after it was put (> 0).
        clock: monotonic seconds (tests).
    Raises ``ValueError`` for a max_size below 1 or a non-positive ttl.
    """

    def __init__(self, name: str, max_size: int, ttl: float, *, clock: Callable[[], float] = time.monotonic):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size!r}")
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
        self.name = name
        self.max_size = int(max_size)
        self.ttl = float(ttl)
        self._clock = clock
        self._data: OrderedDict[Hashable, tuple[float, object]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = self.expirations = 0
        _REGISTRY[name] = self

    def get(self, key: Hashable, default=None):
        """The fresh value of ``key`` (a hit), else ``default`` (a miss; an expired entry is dropped)."""
        with self._lock:
            got = self._data.get(key, _MISSING)
            if got is not _MISSING:
                expires, value = got
                if self._clock() < expires:
                    self._data.move_to_end(key)
                    self.hits += 1
                    return value
                del self._data[key]
                self.expirations += 1
            self.misses += 1
            return default

    def put(self, key: Hashable, value, ttl: float | None = None) -> None:
        """Store ``value`` for ``ttl`` seconds (default: the cache's); evicts the least recently used."""
        with self._lock:
            self._data[key] = (self._clock() + (self.ttl if ttl is None else float(ttl)), value)
            self._data.move_to_end(key)
            while len(self._data) > self.max_size:
                self._data.popitem(last=False)
                self.evictions += 1

    def clear(self) -> None:
        """Drop every entry (counters stay)."""
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def stats(self) -> dict:
        """``{"hits", "misses", "evictions", "expirations", "size", "max_size", "ttl_s"}``."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "expirations": self.expirations, "size": len(self._data), "max_size": self.max_size,
                    "ttl_s": self.ttl}


def caches() -> dict[str, TTLCache]:
    """The live caches of this process by name."""
    return dict(_REGISTRY)


class CacheCollector:
    """Prometheus collector of every live :class:`TTLCache` of the process (register it on a registry)."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        fams = {
            "hits": CounterMetricFamily("magpie_enrich_cache_hits", "Cache lookups that found a fresh entry",
                                        labels=["cache"]),
            "misses": CounterMetricFamily("magpie_enrich_cache_misses", "Cache lookups that found none",
                                          labels=["cache"]),
            "evictions": CounterMetricFamily("magpie_enrich_cache_evictions", "Entries dropped for room",
                                             labels=["cache"]),
            "size": GaugeMetricFamily("magpie_enrich_cache_size", "Entries held", labels=["cache"]),
            "max_size": GaugeMetricFamily("magpie_enrich_cache_max_size", "Most entries held", labels=["cache"]),
        }
        for name, cache in sorted(caches().items()):
            st = cache.stats()
            for key, fam in fams.items():
                fam.add_metric([name], st[key])
        yield from fams.values()


__all__ = ["CacheCollector", "TTLCache", "caches"]
