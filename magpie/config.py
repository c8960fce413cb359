"""Settings read from the environment (and an optional ``.env``) with pydantic-settings.

Names follow DESIGN.md: the seed documents' own names where they give one (``PROXY_QUEUE_SHARDS``,
``PROXY_QUEUE_ENCRYPT_CREDENTIALS``, ``PROXY_ENCRYPTION_KEY``), ``MAGPIE_*`` for the rest. Defaults work
against this machine kind's local services (PostgreSQL, Redis and RabbitMQ on 127.0.0.1).

A bad value raises :class:`ConfigError` at start with the variable's name in the message.
"""

from __future__ import annotations

import functools

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConfigError(ValueError):
    """A setting from the environment is missing or malformed; the message names the variable."""


class Settings(BaseSettings):
    """All runtime settings. Units are in the field names or descriptions (seconds unless ``_ms``)."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", populate_by_name=True)

    database_url: str = Field(
        "postgresql+psycopg2://postgres@127.0.0.1:5432/magpie", alias="MAGPIE_DATABASE_URL"
    )
    redis_url: str = Field("redis://127.0.0.1:6379/0", alias="MAGPIE_REDIS_URL")
    broker_url: str = Field("redis://127.0.0.1:6379/1", alias="MAGPIE_BROKER_URL")
    result_backend: str | None = Field(None, alias="MAGPIE_RESULT_BACKEND")
    broker_key_prefix: str = Field("", alias="MAGPIE_BROKER_KEY_PREFIX")
    """Key prefix for a Redis broker's own keys (kombu ``global_keyprefix``), to share one Redis database."""
    redis_prefix: str = Field("magpie:", alias="MAGPIE_REDIS_PREFIX")

    check_interval: float = Field(300.0, alias="MAGPIE_CHECK_INTERVAL", gt=0)
    """Seconds between two checks of one route."""
    lease_seconds: float = Field(300.0, alias="MAGPIE_LEASE_SECONDS", gt=0)
    """Lease length in seconds given by a claim or a renewal (DESIGN: 5 minutes)."""
    renew_below_seconds: float = Field(120.0, alias="MAGPIE_RENEW_BELOW_SECONDS", ge=0)
    """A check renews its lease between attempts when fewer than this many seconds remain."""
    max_inflight: int = Field(10000, alias="MAGPIE_MAX_INFLIGHT", ge=1)
    """Upper bound on outstanding leases that promote will hand out."""
    promote_interval: float = Field(1.0, alias="MAGPIE_PROMOTE_INTERVAL", gt=0)
    """Seconds between two beat-triggered promote passes."""
    promote_budget: int = Field(5000, alias="MAGPIE_PROMOTE_BUDGET", ge=1)
    """Most routes one promote pass claims."""
    routes_per_task: int = Field(16, alias="MAGPIE_ROUTES_PER_TASK", ge=1, le=1000)
    """Leases carried by one check-task message."""
    pop_batch: int = Field(64, alias="MAGPIE_POP_BATCH", ge=1, le=1000)
    """Routes claimed by one pop script call."""

    max_stalled: int = Field(3, alias="MAGPIE_MAX_STALLED", ge=0)
    """A route re-claimed after lease expiry more than this many times in a row is dead-lettered."""
    retry_base: float = Field(5.0, alias="MAGPIE_RETRY_BASE", gt=0)
    """Seconds of the first backoff delay after an infrastructure failure (judge unreachable)."""
    retry_cap: float = Field(300.0, alias="MAGPIE_RETRY_CAP", gt=0)
    """Upper bound in seconds on a backoff delay."""

    queue_shards: int = Field(16, alias="PROXY_QUEUE_SHARDS", ge=1, le=128)
    encrypt_queue_credentials: bool = Field(False, alias="PROXY_QUEUE_ENCRYPT_CREDENTIALS")
    encryption_key: str = Field(
        "magpie-development-key-change-me", alias="PROXY_ENCRYPTION_KEY", min_length=16
    )
    """Root secret: credential encryption at rest and the keyed route hash derive from it. Keep it stable."""

    judge_url: str = Field("http://127.0.0.1:8899/", alias="MAGPIE_JUDGE_URL")
    check_timeout: float = Field(10.0, alias="MAGPIE_CHECK_TIMEOUT", gt=0)
    """Per-attempt timeout in seconds."""
    check_attempts: int = Field(2, alias="MAGPIE_CHECK_ATTEMPTS", ge=1, le=10)
    body_cap: int = Field(2048, alias="MAGPIE_BODY_CAP", ge=0)
    """Bytes of the judge's response body kept per check."""

    stats_stream_maxlen: int = Field(1_000_000, alias="MAGPIE_STATS_STREAM_MAXLEN", ge=1000)
    stats_batch: int = Field(500, alias="MAGPIE_STATS_BATCH", ge=1)
    stats_interval: float = Field(1.0, alias="MAGPIE_STATS_INTERVAL", gt=0)
    """Seconds between beat-triggered statistics ingestion passes."""

    @field_validator("redis_prefix")
    @classmethod
    def _prefix_nonempty(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("database_url")
    @classmethod
    def _pg_only(cls, v: str) -> str:
        if not v.startswith("postgresql"):
            raise ValueError("must be a postgresql:// URL")
        return v


def load_settings(**overrides) -> Settings:
    """Build settings from the environment plus explicit ``overrides`` (field names).

    Raises :class:`ConfigError` naming the environment variable when a value is invalid.
    """
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = err["loc"][0] if err["loc"] else "?"
            field = Settings.model_fields.get(str(loc))
            name = field.alias if field is not None and field.alias else str(loc)
            parts.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError("invalid magpie configuration: " + "; ".join(parts)) from None


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, loaded once (see :func:`load_settings`)."""
    return load_settings()
