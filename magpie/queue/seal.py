"""Sealed check messages: the leases of one check message, encrypted and authenticated as one unit.

A check message carries route payloads, and payloads carry proxy credentials. The broker stores the
message, and task events (which Flower shows) repeat its arguments, so promote seals the whole lease
list once per message: the compact JSON of the list, encrypted with AES-256-GCM under a key derived from
``PROXY_ENCRYPTION_KEY`` with HKDF (its own ``info`` label, so it shares no key with credentials at rest
or the route hash). The check task opens it; a message changed in transit, forged without the key, or
sealed under another key is refused as a whole. The task is sent with a short ``argsrepr`` (see
:func:`describe`), so events and Flower show a lease count, never the ciphertext or a payload.

Wire form: ``"s2:" + base64(nonce[12] || ciphertext || tag[16])``; the plaintext is the zlib stream
(level 1) of the compact JSON ``{"f": [field names], "r": [[value, ...], ...]}``, one row per lease in the
order of ``f`` (names once per message rather than once per lease: cheaper to encode and decode). The
nonce is random per message (96 bits; a key seals far fewer than 2**32 messages between rotations at
promote's rates). The JSON round trip gives back every payload text byte for byte (the fenced scripts
compare it with the stored payload). ``"s1:"`` messages (the same without zlib, from an earlier promote)
still open; the version is bound into the authenticated data, so one cannot pass for the other.

Compression shrinks a message of 250 leases about six times (67 KB of JSON to 11 KB), and every later step
handles the smaller text: the broker's copies, base64 and JSON encodings, the worker's hand-off to its
process, and the decryption. Compressing before encrypting lets the length of a message say something
about how alike its payloads are; reading it needs access to the broker and many messages whose other
routes the reader controls. ``PROXY_QUEUE_ENCRYPT_CREDENTIALS`` seals each route's credentials on their
own first, which leaves nothing of them for compression to find.
"""

from __future__ import annotations

import binascii
import functools
import json
import os
import zlib

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from magpie.errors import MagpieError
from magpie.queue.lease import Lease

SEAL_PREFIX = "s2:"
"""Marks a sealed lease list, version 2 (compressed; :data:`SEAL_PREFIX_V1` still opens)."""
SEAL_PREFIX_V1 = "s1:"
"""Marks a sealed lease list, version 1 (not compressed)."""
_INFO = b"check-message-v1"  # HKDF label of the message key
_AAD = b"magpie.check_routes"  # binds a sealed body to the check task (version 1)
_AAD_V2 = b"magpie.check_routes/s2"  # and to the version
_NONCE = 12
FIELDS = ("member", "payload", "previous_score", "lease_score", "shard", "stalled", "retry_attempts",
          "server_offset_ms", "alone", "claimed_ms", "dispatched_ms")
"""The :class:`Lease` fields a sealed row carries, in :class:`Lease`'s positional order."""


class SealError(MagpieError, ValueError):
    """A check message could not be opened: not sealed, damaged, or sealed under another key."""


class MessageSeal:
    """Seals and opens check-message lease lists with one key; use :func:`get_seal` for a cached one.

    Args:
        secret: the ``PROXY_ENCRYPTION_KEY`` value (str).
    """

    __slots__ = ("_aead",)

    def __init__(self, secret: str):
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"magpie", info=_INFO).derive(secret.encode())
        self._aead = AESGCM(key)

    def seal(self, leases: list[dict]) -> str:
        """The sealed text of ``leases`` (:meth:`magpie.queue.Lease.to_dict` dicts; every key of
        :data:`FIELDS` present, values JSON-safe).

        One JSON encoding, one zlib compression and one AES-GCM encryption for the whole list. Returns
        ASCII text starting with :data:`SEAL_PREFIX`; raises ``KeyError`` for a dict missing a field.
        """
        doc = {"f": FIELDS, "r": [[d[k] for k in FIELDS] for d in leases]}
        nonce = os.urandom(_NONCE)
        body = zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 1)
        sealed = binascii.b2a_base64(nonce + self._aead.encrypt(nonce, body, _AAD_V2), newline=False)
        return SEAL_PREFIX + sealed.decode("ascii")

    def unseal(self, sealed: str) -> list[dict]:
        """The lease dicts :meth:`seal` sealed (equal to the ones given to it).

        Raises :class:`SealError` as :meth:`unseal_leases` does."""
        names, rows = self._open(sealed)
        return [dict(zip(names, r)) for r in rows]

    def unseal_leases(self, sealed: str) -> list[Lease]:
        """The leases :meth:`seal` sealed, as :class:`Lease` objects with fresh cancellation tokens.

        Raises :class:`SealError` (message without any secret) when ``sealed`` is not sealed text, was
        altered, or was sealed under another ``PROXY_ENCRYPTION_KEY``.
        """
        names, rows = self._open(sealed)
        if names == FIELDS:  # the fast path: positional construction
            return [Lease(*r) for r in rows]
        return [Lease(**dict(zip(names, r))) for r in rows]

    def _open(self, sealed: str) -> tuple[tuple, list]:
        """``(field names, rows)`` of a sealed message; raises :class:`SealError`."""
        if not isinstance(sealed, str) or not sealed.startswith((SEAL_PREFIX, SEAL_PREFIX_V1)):
            raise SealError("check message is not sealed (sent by an older promote?); its leases expire "
                            "and the routes come back")
        v2 = sealed.startswith(SEAL_PREFIX)
        try:
            raw = binascii.a2b_base64(sealed[len(SEAL_PREFIX):], strict_mode=True)
        except (binascii.Error, ValueError):
            raise SealError("check message is damaged (bad base64)") from None
        if len(raw) < _NONCE + 16:
            raise SealError("check message is damaged (too short)")
        try:
            body = self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], _AAD_V2 if v2 else _AAD)
        except InvalidTag:
            raise SealError("cannot open check message: altered, or PROXY_ENCRYPTION_KEY differs between "
                            "promote and this worker") from None
        try:
            doc = json.loads(zlib.decompress(body) if v2 else body)
        except (zlib.error, ValueError):  # authentic, so only a promote of another build could send it
            raise SealError("check message does not hold a lease list") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("f"), list) or not isinstance(doc.get("r"), list):
            raise SealError("check message does not hold a lease list")
        return tuple(doc["f"]), doc["r"]


@functools.lru_cache(maxsize=4)
def get_seal(secret: str) -> MessageSeal:
    """Cached :class:`MessageSeal` for ``secret`` (HKDF runs once per process and secret)."""
    return MessageSeal(secret)


def describe(count: int) -> str:
    """The ``argsrepr`` of a check message of ``count`` leases, e.g. ``"<250 leases>"``."""
    return f"<{count} lease{'' if count == 1 else 's'}>"
