"""Which ``PROXY_ENCRYPTION_KEY`` a database belongs to: record its fingerprint once, compare it at start.

Route hashes and stored credentials derive from the key, so a process running with another key would
duplicate every route on import and fail to read credentials. The first use of a database records
:func:`magpie.base.crypto.key_fingerprint` of the key in ``deployment_keys`` (one row); every later process
compares its own fingerprint with it and refuses to start on a difference (:class:`KeyMismatchError`).

Before recording, the stored data is checked too: a database that already holds routes (created before
fingerprints existed) gets a fingerprint only if its routes' keyed hashes recompute under the key.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from magpie.base.crypto import CredentialError, KeyMismatchError, get_keyring, key_fingerprint
from magpie.errors import MagpieError
from magpie.base.routes import Route

SAMPLE_ROUTES = 20
"""Stored routes whose hashes are recomputed before a first fingerprint is recorded (one match suffices)."""

MISMATCH_MESSAGE = (
    "PROXY_ENCRYPTION_KEY does not match the key this deployment's database was first used with; "
    "set the original key (see \"The encryption key\" in docs/operations.md)"
)

_ROW_ID = 1


class KeyTableMissing(MagpieError):
    """The database has no ``deployment_keys`` table yet: its schema predates this code."""


@dataclass(frozen=True, slots=True)
class KeyStatus:
    """The comparison of this process's key with the database's record.

    Attributes:
        recorded: the stored fingerprint, or None when none is recorded yet.
        current: the fingerprint of this process's ``PROXY_ENCRYPTION_KEY``.
        created: True when this call recorded ``current`` (first use).
    """

    recorded: str | None
    current: str
    created: bool = False

    @property
    def state(self) -> str:
        """``"match"``, ``"mismatch"`` or ``"unrecorded"``."""
        if self.recorded is None:
            return "unrecorded"
        return "match" if self.recorded == self.current else "mismatch"

    def as_json(self) -> dict:
        """``{"state", "recorded", "current", "created"}``; fingerprints shortened to 12 hex characters."""
        return {"state": self.state, "recorded": short(self.recorded), "current": short(self.current),
                "created": self.created}


def short(fingerprint: str | None) -> str | None:
    """A fingerprint cut to its version tag and first 12 hex characters, for display."""
    if fingerprint is None:
        return None
    tag, _, digest = fingerprint.rpartition(":")
    return f"{tag}:{digest[:12]}" if tag else digest[:12]


def _require_table(conn: Connection) -> None:
    if conn.execute(sa.text("SELECT to_regclass('deployment_keys')")).scalar() is None:
        raise KeyTableMissing(
            "PostgreSQL schema out of date: no deployment_keys table (run `magpie db upgrade`)")


def _recorded(conn: Connection) -> str | None:
    return conn.execute(sa.text("SELECT fingerprint FROM deployment_keys WHERE id = :i"),
                        {"i": _ROW_ID}).scalar()


def read_status(engine: Engine, secret: str) -> KeyStatus:
    """Compare ``secret`` with the recorded fingerprint without writing anything.

    Args:
        engine: engine on the magpie database.
        secret: the ``PROXY_ENCRYPTION_KEY`` value.
    Raises:
        KeyTableMissing: the schema predates ``deployment_keys``.
        sqlalchemy.exc.OperationalError: the database is unreachable.
    """
    with engine.connect() as conn:
        _require_table(conn)
        return KeyStatus(_recorded(conn), key_fingerprint(secret))


def _stored_data_verifies(conn: Connection, secret: str) -> bool:
    """Whether the stored routes (or, with none, a webhook secret) were written under ``secret``.

    True for a database without routes or channel secrets. Several routes are tried so that one route
    hashed by an older normalisation does not refuse a right key; a wrong key matches none of them.
    """
    keyring = get_keyring(secret)
    rows = conn.execute(sa.text(
        "SELECT route_hash, protocol, host, port, username_enc, password_enc FROM routes "
        "ORDER BY id LIMIT :n"), {"n": SAMPLE_ROUTES}).all()
    try:
        if rows:
            for rhash, proto, host, port, uenc, penc in rows:
                user = keyring.decrypt(uenc) if uenc is not None else None
                password = keyring.decrypt(penc) if penc is not None else None
                if keyring.route_hash(Route(proto, host, port, user, password)) == rhash.strip():
                    return True
            return False
        has_channels = conn.execute(sa.text("SELECT to_regclass('alert_channels')")).scalar() is not None
        token = conn.execute(sa.text(
            "SELECT secret_enc FROM alert_channels WHERE secret_enc IS NOT NULL LIMIT 1")).scalar() \
            if has_channels else None
        if token is not None:
            keyring.decrypt(token)
        return True
    except CredentialError:
        return False


def verify_key(engine: Engine, secret: str, *, record: bool = True) -> KeyStatus:
    """Check ``secret`` against the database; on first use record its fingerprint.

    Args:
        engine: engine on the magpie database (migrated to a revision with ``deployment_keys``).
        secret: the ``PROXY_ENCRYPTION_KEY`` value.
        record: record the fingerprint when none is recorded (False: only compare).
    Returns:
        :class:`KeyStatus` with state ``"match"`` (or ``"unrecorded"`` when ``record`` is False).
    Raises:
        KeyMismatchError: the recorded fingerprint differs, or (first use) the stored routes do not
            verify under ``secret``. The message names ``PROXY_ENCRYPTION_KEY`` and never the key.
        KeyTableMissing: the schema predates ``deployment_keys``.
        sqlalchemy.exc.OperationalError: the database is unreachable.
    """
    current = key_fingerprint(secret)
    with engine.connect() as conn:
        _require_table(conn)
        recorded = _recorded(conn)
    if recorded is None and record:
        with engine.begin() as conn:
            if not _stored_data_verifies(conn, secret):
                raise KeyMismatchError(
                    "PROXY_ENCRYPTION_KEY does not match the routes stored in PostgreSQL (their keyed "
                    "hashes do not recompute); set the key they were imported with")
            inserted = conn.execute(sa.text(
                "INSERT INTO deployment_keys (id, fingerprint) VALUES (:i, :f) "
                "ON CONFLICT (id) DO NOTHING RETURNING id"), {"i": _ROW_ID, "f": current}).first()
            recorded = current if inserted else _recorded(conn)  # another process may have won
        status = KeyStatus(recorded, current, created=inserted is not None and recorded == current)
    else:
        status = KeyStatus(recorded, current)
    if status.state == "mismatch":
        raise KeyMismatchError(MISMATCH_MESSAGE)
    return status


__all__ = ["KeyStatus", "KeyTableMissing", "MISMATCH_MESSAGE", "read_status", "short", "verify_key"]
