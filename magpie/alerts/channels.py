"""Alert channels: where a workspace's incident transitions are sent.

* ``webhook``: an http(s) URL checked by :func:`magpie.alerts.webhook.check_target` at creation (and again
  at every send) and a per-channel HMAC secret, stored encrypted with ``PROXY_ENCRYPTION_KEY``
  (:class:`magpie.base.crypto.Keyring`). Each transition becomes an ``alert_deliveries`` row.
* ``email``: one recipient address. Each transition becomes an ``email_outbox`` row (kind ``alert``).

Every enabled channel of the workspace receives every transition of the workspace's rules.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.alerts.rules import workspace_id
from magpie.alerts.webhook import check_target
from magpie.base.crypto import get_keyring
from magpie.outbox.service import validate_address

KINDS = ("webhook", "email")


@dataclass(frozen=True, slots=True)
class Channel:
    """One channel. ``secret`` is the plaintext webhook secret, filled in only by
    :func:`create_webhook_channel` (to show it once) and :func:`channel_secret`."""

    id: int
    workspace_id: int
    name: str
    kind: str
    target: str
    enabled: bool
    created_at: datetime
    secret: str | None = None

    def as_json(self) -> dict:
        """Fields as a dict; ``secret`` only when it is set."""
        return {f: getattr(self, f) for f in self.__slots__ if f != "secret"} | (
            {"secret": self.secret} if self.secret else {}
        )


_COLS = "id, workspace_id, name, kind, target, enabled, created_at"


def _insert(engine: Engine, workspace, name: str, kind: str, target: str, secret_enc: str | None) -> int:
    if not name or not name.strip():
        raise ValueError("channel name must not be empty")
    with engine.begin() as conn:
        ws = workspace_id(conn, workspace)
        try:
            with conn.begin_nested():
                return conn.execute(
                    sa.text(
                        "INSERT INTO alert_channels (workspace_id, name, kind, target, secret_enc) "
                        "VALUES (:w, :n, :k, :t, :s) RETURNING id"
                    ),
                    {"w": ws, "n": name.strip(), "k": kind, "t": target, "s": secret_enc},
                ).scalar_one()
        except sa.exc.IntegrityError:
            raise ValueError(f"workspace {workspace!r} already has a channel named {name!r}") from None


def create_webhook_channel(engine: Engine, settings, workspace: int | str, name: str, url: str, *,
                           secret: str | None = None, allow_private: bool | None = None) -> Channel:
    """Add a webhook channel after checking ``url`` (see :func:`magpie.alerts.webhook.check_target`).

    Args:
        engine: PostgreSQL engine. settings: :class:`magpie.config.Settings` (``encryption_key``,
            ``webhook_allow_private``).
        workspace: id or name. name: unique within the workspace.
        url: the receiver's URL. secret: HMAC secret (default: 32 random bytes, URL-safe base64).
        allow_private: overrides ``MAGPIE_WEBHOOK_ALLOW_PRIVATE`` for this check only.
    Returns:
        The :class:`Channel` with ``secret`` set (shown once; stored encrypted).
    Raises:
        magpie.alerts.webhook.WebhookRefused: the URL is refused. ValueError: duplicate name.
        LookupError: unknown workspace.
    """
    allow = settings.webhook_allow_private if allow_private is None else allow_private
    check_target(url, allow_private=allow)
    secret = secret or secrets.token_urlsafe(32)
    cid = _insert(engine, workspace, name, "webhook", url, get_keyring(settings.encryption_key).encrypt(secret))
    ch = get_channel(engine, cid)
    return Channel(**{**{f: getattr(ch, f) for f in ch.__slots__}, "secret": secret})


def create_email_channel(engine: Engine, workspace: int | str, name: str, address: str) -> Channel:
    """Add an email channel sending to ``address``. Raises ValueError (bad address, duplicate name) or
    LookupError (unknown workspace)."""
    cid = _insert(engine, workspace, name, "email", validate_address(address), None)
    return get_channel(engine, cid)


def get_channel(engine: Engine, channel_id: int) -> Channel:
    """The channel ``channel_id`` (without its secret); ``LookupError`` if missing."""
    with engine.connect() as conn:
        row = conn.execute(sa.text(f"SELECT {_COLS} FROM alert_channels WHERE id = :id"),
                           {"id": int(channel_id)}).mappings().first()
    if row is None:
        raise LookupError(f"no such channel: {channel_id}")
    return Channel(**row)


def channel_secret(engine: Engine, settings, channel_id: int) -> str:
    """Decrypt and return a webhook channel's secret (``LookupError`` if not a webhook channel)."""
    with engine.connect() as conn:
        enc = conn.execute(sa.text("SELECT secret_enc FROM alert_channels WHERE id = :id AND kind = 'webhook'"),
                           {"id": int(channel_id)}).scalar()
    if enc is None:
        raise LookupError(f"no webhook channel {channel_id}")
    return get_keyring(settings.encryption_key).decrypt(enc)


def list_channels(engine: Engine, workspace: int | str | None = None) -> list[Channel]:
    """Channels of one workspace (id or name) or of all, by id (secrets not included)."""
    with engine.connect() as conn:
        if workspace is None:
            rows = conn.execute(sa.text(f"SELECT {_COLS} FROM alert_channels ORDER BY id"))
        else:
            ws = workspace_id(conn, workspace)
            rows = conn.execute(sa.text(f"SELECT {_COLS} FROM alert_channels WHERE workspace_id = :w ORDER BY id"),
                                {"w": ws})
        return [Channel(**r) for r in rows.mappings()]


def set_channel_enabled(engine: Engine, channel_id: int, enabled: bool) -> Channel:
    """Enable or disable a channel. Deliveries already queued for a disabled webhook channel fail with
    ``channel disabled``. Raises LookupError if missing."""
    with engine.begin() as conn:
        n = conn.execute(sa.text("UPDATE alert_channels SET enabled = :e, updated_at = now() WHERE id = :id"),
                         {"e": bool(enabled), "id": int(channel_id)}).rowcount
    if n != 1:
        raise LookupError(f"no such channel: {channel_id}")
    return get_channel(engine, channel_id)


def delete_channel(engine: Engine, channel_id: int) -> bool:
    """Delete a channel and its queued deliveries. True if it existed."""
    with engine.begin() as conn:
        return conn.execute(sa.text("DELETE FROM alert_channels WHERE id = :id"),
                            {"id": int(channel_id)}).rowcount == 1
