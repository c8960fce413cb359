"""Keys derived from ``PROXY_ENCRYPTION_KEY``: the keyed route hash, credential encryption at rest and
credential encryption in queue payloads (``PROXY_QUEUE_ENCRYPT_CREDENTIALS``).

Independent subkeys come from the root secret with HKDF-SHA256 (``info`` separates them), so the
route fingerprint never reuses an encryption key. Changing ``PROXY_ENCRYPTION_KEY`` changes every
route hash and makes stored credentials unreadable: keep it stable (seed: Redis credential ADR).
:func:`key_fingerprint` (its own subkey) is what the database records to tell a changed key at start.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac

from cryptography.exceptions import InvalidTag
from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from magpie.errors import MagpieError
from magpie.base.routes import Route

ROUTE_HASH_HEX = 24
"""Length of a route hash in hex characters (96 bits): short members keep Redis memory per route low."""


class CredentialError(MagpieError, ValueError):
    """Stored credentials could not be decrypted (wrong or rotated ``PROXY_ENCRYPTION_KEY``)."""


def _derive(secret: str, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"magpie", info=info).derive(secret.encode())


class QueueCipher:
    """Authenticated encryption of a route's credentials inside its Redis queue payload.

    AES-256-SIV (RFC 5297, deterministic authenticated encryption) under a 64-byte subkey of its own
    (HKDF ``info`` ``queue-credentials-v1``, distinct from the at-rest Fernet key), with the route hash as
    associated data: a token opens only under its own route, and sealing the same route twice gives the
    same text (a rebuild rewrites nothing). Use :attr:`Keyring.queue`.

    Args:
        key: 64 bytes.
    """

    __slots__ = ("_siv",)

    def __init__(self, key: bytes):
        self._siv = AESSIV(key)

    def seal(self, username: str | None, password: str | None, route_hash: str) -> str:
        """Encrypt ``(username, password)`` (either may be None) bound to ``route_hash``.

        Returns an unpadded URL-safe base64 token (``[A-Za-z0-9_-]``): the 16-byte SIV tag, then the sealed
        form ``flags (1 byte: bit 0 username present, bit 1 password present) | username length (LEB128) |
        username | password`` (UTF-8), e.g. 39 characters for ``alice``/``s3cret``."""
        user = b"" if username is None else username.encode("utf-8", "surrogatepass")
        pw = b"" if password is None else password.encode("utf-8", "surrogatepass")
        n, size = len(user), bytearray()
        while True:
            size.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                break
        flags = (username is not None) | (password is not None) << 1
        sealed = self._siv.encrypt(bytes([flags]) + bytes(size) + user + pw, [route_hash.encode()])
        return base64.urlsafe_b64encode(sealed).rstrip(b"=").decode()

    def open(self, token: str, route_hash: str) -> tuple[str | None, str | None]:
        """Decrypt a :meth:`seal` token of ``route_hash``; returns ``(username, password)``.

        Raises :class:`CredentialError` (naming ``PROXY_ENCRYPTION_KEY``, never the token or a secret) when
        the key differs from the sealing key, the token was altered, or it belongs to another route."""
        try:
            plain = self._siv.decrypt(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)),
                                      [route_hash.encode()])
        except (InvalidTag, ValueError, TypeError):
            raise CredentialError(
                f"cannot decrypt the queue credentials of route {route_hash}: PROXY_ENCRYPTION_KEY is not "
                "the key they were encrypted with (or the payload was altered)") from None
        try:
            flags, n, shift, i = plain[0], 0, 0, 1
            while True:
                b = plain[i]
                n |= (b & 0x7F) << shift
                i, shift = i + 1, shift + 7
                if not b & 0x80:
                    break
            if flags & ~3 or i + n > len(plain):
                raise ValueError
            user = plain[i:i + n].decode("utf-8", "surrogatepass") if flags & 1 else None
            pw = plain[i + n:].decode("utf-8", "surrogatepass") if flags & 2 else None
        except (IndexError, ValueError):
            raise CredentialError(f"queue credentials of route {route_hash} are in an unknown form") from None
        return user, pw


class Keyring:
    """Subkeys of one root secret; use :func:`get_keyring` for a cached instance.

    Args:
        secret: the ``PROXY_ENCRYPTION_KEY`` value (str, at least 16 characters).
    """

    def __init__(self, secret: str):
        self._hash_key = _derive(secret, b"route-hash-v1")
        self._fernet = Fernet(base64.urlsafe_b64encode(_derive(secret, b"credentials-v1")))
        self.queue = QueueCipher(_derive(secret, b"queue-credentials-v1", 64))
        """:class:`QueueCipher` of the credentials in Redis queue payloads."""

    def route_hash(self, route: Route) -> str:
        """Keyed route hash: HMAC-SHA256 of :meth:`Route.normalized`, first 24 hex chars."""
        digest = hmac.new(self._hash_key, route.normalized().encode(), hashlib.sha256).hexdigest()
        return digest[:ROUTE_HASH_HEX]

    def encrypt(self, plaintext: str) -> str:
        """Encrypt text with Fernet (AES-128-CBC + HMAC); returns an ASCII token."""
        return self._fernet.encrypt(plaintext.encode()).decode()

    def decrypt(self, token: str) -> str:
        """Decrypt a token from :meth:`encrypt`; raises :class:`CredentialError` on a wrong key or damage."""
        try:
            return self._fernet.decrypt(token.encode()).decode()
        except InvalidToken:
            raise CredentialError("cannot decrypt stored credentials: PROXY_ENCRYPTION_KEY differs") from None


FINGERPRINT_PREFIX = "v1:"
"""Version tag of :func:`key_fingerprint` values (stored in PostgreSQL; a new scheme gets a new tag)."""

_FINGERPRINT_MESSAGE = b"magpie deployment key fingerprint"


class KeyMismatchError(MagpieError):
    """``PROXY_ENCRYPTION_KEY`` differs from the key this deployment's database was first used with."""


def key_fingerprint(secret: str) -> str:
    """Fingerprint of a ``PROXY_ENCRYPTION_KEY``: safe to store and show, never the key itself.

    HMAC-SHA256 of a fixed constant under a subkey derived with HKDF (its own ``info``, so it shares
    nothing with the route-hash or credential keys). Two processes agree on it exactly when their keys
    are equal.

    Args:
        secret: the ``PROXY_ENCRYPTION_KEY`` value.
    Returns:
        ``"v1:"`` followed by 64 lower-case hex characters.
    """
    mac = hmac.new(_derive(secret, b"key-fingerprint-v1"), _FINGERPRINT_MESSAGE, hashlib.sha256)
    return FINGERPRINT_PREFIX + mac.hexdigest()


@functools.lru_cache(maxsize=8)
def get_keyring(secret: str) -> Keyring:
    """Cached :class:`Keyring` for ``secret`` (HKDF runs once per process and secret)."""
    return Keyring(secret)
