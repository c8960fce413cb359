"""API tokens in PostgreSQL: create (the secret is shown once), list, revoke, and authenticate a bearer
token.

A secret is ``mgp_`` followed by 43 URL-safe characters (32 random bytes); the table keeps its SHA-256
(hex) and its first 12 characters. Authentication hashes the presented token, finds the row by that hash
(a unique index) and compares the hashes again in constant time; a revoked or expired row answers as
a refusal with its reason, never the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.apitokens.models import ROLES
from magpie.errors import MagpieError

SECRET_PREFIX = "mgp_"
_DURATION = re.compile(r"\s*(\d+)\s*([smhdw])\s*", re.IGNORECASE)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_MAX_NAME = 200


class TokenError(MagpieError, ValueError):
    """A token verb's input is wrong (unknown workspace, bad role, bad duration, no such token)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts for.

    Attributes:
        token_id: the ``api_tokens`` id, or None for ``MAGPIE_WEB_TOKEN``.
        role: ``read``, ``operate`` or ``admin``.
        workspace: the token's workspace name (None: an admin token without one).
        workspace_id: its id (None likewise).
    """

    token_id: int | None
    role: str
    workspace: str | None
    workspace_id: int | None

    @property
    def key(self) -> str:
        """The rate limiter's key for this principal (``web`` for ``MAGPIE_WEB_TOKEN``)."""
        return "web" if self.token_id is None else str(self.token_id)

    def allows(self, role: str) -> bool:
        """True when this principal's role is ``role`` or stronger (:data:`ROLES` order)."""
        return ROLES.index(self.role) >= ROLES.index(role)

    def sees(self, workspace: str | None) -> bool:
        """True when requests may name ``workspace`` (admins: any; others: their own only; None: all)."""
        return self.role == "admin" or workspace == self.workspace


WEB_ADMIN = Principal(None, "admin", None, None)
"""The principal of ``MAGPIE_WEB_TOKEN``."""


class Refused(MagpieError):
    """Authentication failed. ``code``: ``bad_token``, ``revoked`` or ``expired``; ``detail``: one line."""

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


def hash_secret(secret: str) -> str:
    """The hex SHA-256 of ``secret`` (UTF-8), as ``api_tokens.token_hash`` holds it."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def parse_expiry(text: str | None, now: datetime | None = None) -> datetime | None:
    """``now`` plus a duration such as ``30d``, ``12h``, ``90m``, ``2w`` (None or empty: never expires).

    Raises :class:`TokenError` naming the accepted form."""
    if text is None or not text.strip():
        return None
    m = _DURATION.fullmatch(text)
    if not m or int(m.group(1)) <= 0:
        raise TokenError(f"bad --expires {text!r}: use a positive number and a unit, e.g. 30d, 12h, 90m, 2w")
    seconds = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if seconds > 100 * 365 * 86400:
        raise TokenError(f"bad --expires {text!r}: at most 100 years")
    return (now or datetime.now(timezone.utc)) + timedelta(seconds=seconds)


def create_token(engine: Engine, *, role: str, workspace: str | None, name: str | None = None,
                 expires_at: datetime | None = None) -> dict:
    """Create a token; the only time its secret exists outside the caller's hands.

    Args:
        role: one of :data:`ROLES`. workspace: an existing workspace's name (may be None for ``admin``
            only). name: a label (at most 200 characters). expires_at: aware datetime, or None.
    Returns:
        ``{"id", "secret", "prefix", "role", "workspace", "name", "expires_at"}``.
    Raises:
        TokenError: bad role, missing or unknown workspace, bad name.
    """
    if role not in ROLES:
        raise TokenError(f"bad role {role!r}: one of {', '.join(ROLES)}")
    if workspace is None and role != "admin":
        raise TokenError(f"a {role} token needs --workspace (only admin tokens span every workspace)")
    if name is not None and (len(name) > _MAX_NAME or any(ord(c) < 32 or ord(c) == 127 for c in name)):
        raise TokenError(f"bad --name: at most {_MAX_NAME} characters, no control characters")
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    with engine.begin() as conn:
        wid = None
        if workspace is not None:
            wid = conn.execute(sa.text("SELECT id FROM workspaces WHERE name = :n"), {"n": workspace}).scalar()
            if wid is None:
                raise TokenError(f"no workspace named {workspace!r} (create it with "
                                 "`magpie workspaces create`, or import into it first)")
        tid = conn.execute(sa.text(
            "INSERT INTO api_tokens (name, token_hash, prefix, workspace_id, role, expires_at)"
            " VALUES (:name, :h, :p, :w, :role, :exp) RETURNING id"),
            {"name": name, "h": hash_secret(secret), "p": secret[:12], "w": wid, "role": role,
             "exp": expires_at}).scalar_one()
    return {"id": int(tid), "secret": secret, "prefix": secret[:12], "role": role, "workspace": workspace,
            "name": name, "expires_at": expires_at}


def list_tokens(engine: Engine) -> list[dict]:
    """Every token, newest first, without secrets or hashes: ``[{"id", "name", "prefix", "role",
    "workspace", "created_at", "expires_at", "revoked_at", "last_used_at", "state"}]``; ``state`` is
    ``active``, ``expired`` or ``revoked``."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT t.id, t.name, t.prefix, t.role, w.name AS workspace, t.created_at, t.expires_at,"
            " t.revoked_at, t.last_used_at,"
            " CASE WHEN t.revoked_at IS NOT NULL THEN 'revoked'"
            "      WHEN t.expires_at IS NOT NULL AND t.expires_at <= now() THEN 'expired' ELSE 'active' END"
            " AS state FROM api_tokens t LEFT JOIN workspaces w ON w.id = t.workspace_id"
            " ORDER BY t.id DESC")).mappings()
        return [dict(r) for r in rows]


def revoke_token(engine: Engine, token_id: int) -> bool:
    """Revoke token ``token_id`` at once; returns False when it was already revoked.

    Raises :class:`TokenError` when there is no such token."""
    with engine.begin() as conn:
        got = conn.execute(sa.text("UPDATE api_tokens SET revoked_at = now() WHERE id = :i AND revoked_at IS NULL"
                                   " RETURNING id"), {"i": int(token_id)}).first()
        if got is None:
            if conn.execute(sa.text("SELECT 1 FROM api_tokens WHERE id = :i"), {"i": int(token_id)}).first() is None:
                raise TokenError(f"no token with id {token_id}")
            return False
    return True


def authenticate(engine: Engine, presented: str) -> Principal:
    """The :class:`Principal` of a presented bearer token.

    Raises :class:`Refused` (``bad_token``: unknown; ``revoked``; ``expired``) and
    ``sqlalchemy.exc.SQLAlchemyError`` when PostgreSQL fails. Refreshes ``last_used_at`` at most once a
    minute."""
    if not presented.startswith(SECRET_PREFIX) or len(presented) > 200:
        raise Refused("bad_token", "the token is not a valid API token")
    digest = hash_secret(presented)
    with engine.connect() as conn:
        row = conn.execute(sa.text(
            "SELECT t.id, t.token_hash, t.role, w.name, t.workspace_id, t.revoked_at IS NOT NULL,"
            " t.expires_at IS NOT NULL AND t.expires_at <= now(),"
            " t.last_used_at IS NULL OR t.last_used_at < now() - interval '1 minute'"
            " FROM api_tokens t LEFT JOIN workspaces w ON w.id = t.workspace_id WHERE t.token_hash = :h"),
            {"h": digest}).first()
    if row is None or not hmac.compare_digest(row[1], digest):
        raise Refused("bad_token", "the token is not a valid API token")
    if row[5]:
        raise Refused("revoked", "the token was revoked")
    if row[6]:
        raise Refused("expired", "the token has expired")
    if row[7]:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE api_tokens SET last_used_at = now() WHERE id = :i"), {"i": row[0]})
    return Principal(int(row[0]), row[2], row[3], row[4])


__all__ = ["SECRET_PREFIX", "WEB_ADMIN", "Principal", "Refused", "TokenError", "authenticate", "create_token",
           "hash_secret", "list_tokens", "parse_expiry", "revoke_token"]
