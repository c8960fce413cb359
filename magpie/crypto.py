"""Keys derived from ``PROXY_ENCRYPTION_KEY``: the keyed route hash and credential encryption at rest.

Two independent subkeys come from the root secret with HKDF-SHA256 (``info`` separates them), so the
route fingerprint never reuses the encryption key. Changing ``PROXY_ENCRYPTION_KEY`` changes every
route hash and makes stored credentials unreadable: keep it stable (seed: Redis credential ADR).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from magpie.errors import MagpieError
from magpie.routes import Route

ROUTE_HASH_HEX = 24
"""Length of a route hash in hex characters (96 bits): short members keep Redis memory per route low."""


class CredentialError(MagpieError, ValueError):
    """Stored credentials could not be decrypted (wrong or rotated ``PROXY_ENCRYPTION_KEY``)."""


def _derive(secret: str, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"magpie", info=info).derive(secret.encode())


class Keyring:
    """Subkeys of one root secret; use :func:`get_keyring` for a cached instance.

    Args:
        secret: the ``PROXY_ENCRYPTION_KEY`` value (str, at least 16 characters).
    """

    def __init__(self, secret: str):
        self._hash_key = _derive(secret, b"route-hash-v1")
        self._fernet = Fernet(base64.urlsafe_b64encode(_derive(secret, b"credentials-v1")))

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


@functools.lru_cache(maxsize=8)
def get_keyring(secret: str) -> Keyring:
    """Cached :class:`Keyring` for ``secret`` (HKDF runs once per process and secret)."""
    return Keyring(secret)
