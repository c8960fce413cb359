"""Abuse reputation of an address: a provider interface and an AbuseIPDB-style HTTP client.

Off unless ``MAGPIE_ABUSE_API_KEY`` is set (:func:`provider` returns None). The client sends
``GET <MAGPIE_ABUSE_API_URL>?ipAddress=<ip>&maxAgeInDays=<MAGPIE_ABUSE_MAX_AGE_DAYS>`` with the headers
``Key: <api key>`` and ``Accept: application/json`` through the egress guard (``MAGPIE_ENRICH_ALLOW_PRIVATE``)
and reads ``data.abuseConfidenceScore`` (0-100) and ``data.totalReports``. At most
``MAGPIE_ABUSE_RATE_PER_MINUTE`` requests leave a process per minute (a token bucket); a ``429`` reply
empties the bucket for its ``Retry-After`` seconds. Answers are cached per address for
``MAGPIE_ABUSE_CACHE_TTL`` seconds (bounded: ``MAGPIE_ENRICH_CACHE_SIZE``). The key is never logged nor put
in an error message.
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from magpie.enrich.caches import TTLCache
from magpie.errors import MagpieError


@dataclass(frozen=True, slots=True)
class AbuseScore:
    """An address's abuse ``score`` (0-100, higher is worse) and the number of ``reports`` behind it."""

    score: int
    reports: int


class AbuseError(MagpieError, RuntimeError):
    """The provider could not answer (network, refused by the egress guard, bad reply, HTTP error)."""


class RateLimited(AbuseError):
    """No request may leave now: the process's rate or the provider's ``429`` says wait ``retry_after`` s."""

    def __init__(self, retry_after: float):
        super().__init__(f"abuse lookups rate-limited for {retry_after:.1f} s")
        self.retry_after = retry_after


class AbuseProvider(Protocol):
    """What enrichment asks an abuse-reputation provider."""

    def score(self, ip: str) -> AbuseScore:
        """The abuse score of IP address ``ip``. Raises :class:`AbuseError` (:class:`RateLimited`)."""
        ...


class TokenBucket:
    """``rate`` tokens per ``per`` seconds, at most ``rate`` at once. Thread-safe.

    Args:
        clock: monotonic seconds (tests)."""

    def __init__(self, rate: float, per: float = 60.0, *, clock=time.monotonic):
        self.capacity = max(1.0, float(rate))
        self.fill = float(rate) / per
        self._tokens = self.capacity
        self._clock = clock
        self._at = clock()
        self._blocked_until = 0.0
        self._lock = threading.Lock()

    def take(self) -> float:
        """Take a token: 0.0 when one was free, else the seconds until one will be (nothing taken)."""
        with self._lock:
            now = self._clock()
            if now < self._blocked_until:
                return self._blocked_until - now
            self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.fill)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            return (1.0 - self._tokens) / self.fill

    def block(self, seconds: float) -> None:
        """Hand out nothing for ``seconds`` (a provider's ``Retry-After``)."""
        with self._lock:
            self._tokens = 0.0
            self._blocked_until = max(self._blocked_until, self._clock() + seconds)


class AbuseIPDBClient:
    """An AbuseIPDB-style check endpoint (module docstring).

    Args:
        settings: :class:`magpie.config.Settings` (URL, key, rate, cache, timeout, egress allow-list).
        clock: monotonic seconds (tests).
    Raises ``ValueError`` when no API key is configured.
    """

    def __init__(self, settings, *, clock=time.monotonic):
        if not settings.abuse_api_key:
            raise ValueError("MAGPIE_ABUSE_API_KEY is not set")
        from magpie.base.egress import EgressPolicy

        self.url = settings.abuse_api_url
        self._key = settings.abuse_api_key
        self.max_age_days = settings.abuse_max_age_days
        self.timeout = settings.abuse_timeout
        self.policy = EgressPolicy(settings.enrich_allow_private, "MAGPIE_ENRICH_ALLOW_PRIVATE")
        self.bucket = TokenBucket(settings.abuse_rate_per_minute, clock=clock)
        self.cache = TTLCache("abuse", settings.enrich_cache_size, settings.abuse_cache_ttl, clock=clock)
        self.requests = 0

    def score(self, ip: str) -> AbuseScore:
        """See :class:`AbuseProvider`; a cached answer costs no request and no token."""
        ip = str(ipaddress.ip_address(ip))
        hit = self.cache.get(ip)
        if hit is not None:
            return hit
        wait = self.bucket.take()
        if wait > 0:
            raise RateLimited(wait)
        from magpie.enrich.fetch import FetchError, get

        self.requests += 1
        try:
            reply = get(self.url, policy=self.policy, timeout=self.timeout, max_bytes=1 << 20,
                        headers={"Key": self._key, "Accept": "application/json"},
                        fields={"ipAddress": ip, "maxAgeInDays": str(self.max_age_days)})
        except FetchError as exc:
            raise AbuseError(f"abuse provider: {exc}") from None
        if reply.status == 429:
            try:
                retry = float(reply.headers.get("retry-after", "60"))
            except ValueError:
                retry = 60.0
            self.bucket.block(retry)
            raise RateLimited(retry)
        if not 200 <= reply.status < 300:
            raise AbuseError(f"abuse provider answered HTTP {reply.status}")
        try:
            data = json.loads(reply.body)["data"]
            result = AbuseScore(max(0, min(100, int(data["abuseConfidenceScore"]))), int(data.get("totalReports") or 0))
        except (ValueError, KeyError, TypeError):
            raise AbuseError("abuse provider's reply has no data.abuseConfidenceScore") from None
        self.cache.put(ip, result)
        return result


_SHARED: dict[tuple, AbuseIPDBClient] = {}
_SHARED_LOCK = threading.Lock()


def provider(settings) -> AbuseProvider | None:
    """The process's abuse provider for ``settings``, or None when ``MAGPIE_ABUSE_API_KEY`` is unset."""
    if not settings.abuse_api_key:
        return None
    key = (settings.abuse_api_url, settings.abuse_api_key, settings.enrich_allow_private)
    with _SHARED_LOCK:
        client = _SHARED.get(key)
        if client is None:
            client = _SHARED[key] = AbuseIPDBClient(settings)
        return client


__all__ = ["AbuseError", "AbuseIPDBClient", "AbuseProvider", "AbuseScore", "RateLimited", "TokenBucket",
           "provider"]
