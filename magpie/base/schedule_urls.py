"""Schedule URL schemes (``MAGPIE_SCHEDULE_URL``), shared by the settings check and the provider factory."""

from __future__ import annotations

from urllib.parse import urlsplit

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
POSTGRES_SCHEMES = ("postgresql", "postgresql+psycopg2")
SCHEMES = REDIS_SCHEMES + POSTGRES_SCHEMES
"""URL schemes :func:`magpie.queue.provider.create_provider` accepts."""


def scheme_of(url: str) -> str:
    """The lower-case scheme of ``url`` (``""`` when it has none)."""
    return urlsplit(url or "").scheme.lower()
