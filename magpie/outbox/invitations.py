"""Workspace invitations: the invitation row is the authority; its email is an optional notification.

:func:`create_invitation` writes the ``invitations`` row and an ``email_outbox`` row in one transaction.
The invitation is valid from that commit until it expires, is accepted or is revoked, whatever becomes of
the email (pending, retried, failed): an operator can hand the token over another way.

Tokens: ``secrets.token_urlsafe(32)``; only ``token_hash`` (SHA-256 hex of the token's UTF-8 bytes) is
stored in ``invitations``. The email body carries the token, so the outbox row holds it until the
``outbox_cleanup`` maintenance job deletes the sent row after ``MAGPIE_OUTBOX_RETENTION_SECONDS``.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.outbox.service import enqueue, message_domain, validate_address


def token_hash(token: str) -> str:
    """SHA-256 hex digest of ``token`` (what ``invitations.token_hash`` stores)."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Invitation:
    """A created invitation. ``token`` is the plaintext token (returned once, never stored);
    ``outbox_id`` is the notification email's outbox row."""

    id: int
    workspace_id: int
    email: str
    token: str
    expires_at: datetime
    outbox_id: int | None


def _workspace_id(conn: sa.Connection, workspace: int | str) -> tuple[int, str]:
    if isinstance(workspace, int):
        row = conn.execute(sa.text("SELECT id, name FROM workspaces WHERE id = :w"), {"w": workspace}).first()
    else:
        row = conn.execute(sa.text("SELECT id, name FROM workspaces WHERE name = :w"), {"w": workspace}).first()
    if row is None:
        raise LookupError(f"no such workspace: {workspace!r}")
    return int(row[0]), row[1]


def create_invitation(engine: Engine, settings, workspace: int | str, email: str, *,
                      ttl_seconds: int | None = None, now: datetime | None = None) -> Invitation:
    """Invite ``email`` into ``workspace``: invitation row + notification email, one transaction.

    Args:
        engine: PostgreSQL engine.
        settings: :class:`magpie.config.Settings` (``invitation_ttl_seconds``, ``email_max_attempts``,
            ``smtp_from``).
        workspace: workspace id (int) or name (str).
        email: invitee address.
        ttl_seconds: validity in seconds (default ``MAGPIE_INVITATION_TTL_SECONDS``).
        now: creation time (``None``: database now).
    Returns:
        The :class:`Invitation`, including the plaintext token.
    Raises:
        LookupError: unknown workspace. ValueError: malformed address.
    """
    email = validate_address(email)
    ttl = int(ttl_seconds if ttl_seconds is not None else settings.invitation_ttl_seconds)
    token = secrets.token_urlsafe(32)
    with engine.begin() as conn:
        ws_id, ws_name = _workspace_id(conn, workspace)
        inv_id, expires_at = conn.execute(
            sa.text(
                """
                INSERT INTO invitations (workspace_id, email, token_hash, created_at, expires_at)
                VALUES (:w, :e, :h, COALESCE(CAST(:now AS timestamptz), now()),
                        COALESCE(CAST(:now AS timestamptz), now()) + make_interval(secs => :ttl))
                RETURNING id, expires_at
                """
            ),
            {"w": ws_id, "e": email, "h": token_hash(token), "now": now, "ttl": float(ttl)},
        ).one()
        body = (
            f"You have been invited to the magpie workspace '{ws_name}'.\n\n"
            f"Invitation token: {token}\n"
            f"It expires at {expires_at:%Y-%m-%d %H:%M} UTC.\n\n"
            "If you did not expect this invitation, ignore this message.\n"
        )
        outbox_id = enqueue(conn, email, f"Invitation to the magpie workspace {ws_name}", body,
                            kind="invitation", max_attempts=settings.email_max_attempts,
                            dedupe_key=f"invitation:{inv_id}", now=now, domain=message_domain(settings))
    return Invitation(int(inv_id), ws_id, email, token, expires_at, outbox_id)


def find_valid_invitation(engine: Engine, token: str, *, now: datetime | None = None) -> dict | None:
    """The invitation row for ``token`` if it is neither expired, accepted nor revoked at ``now``; else None.

    Returns a dict with ``id``, ``workspace_id``, ``email``, ``created_at``, ``expires_at``.
    """
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                """
                SELECT id, workspace_id, email, created_at, expires_at FROM invitations
                WHERE token_hash = :h AND accepted_at IS NULL AND revoked_at IS NULL
                  AND expires_at > COALESCE(CAST(:now AS timestamptz), now())
                """
            ),
            {"h": token_hash(token), "now": now},
        ).mappings().first()
    return dict(row) if row else None
