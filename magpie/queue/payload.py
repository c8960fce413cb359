"""The compact route payload stored at ``proxy:<hash>`` (docs/design.md, "The route schedule").

Wire form: JSON with short keys, no spaces, in one of two versions read side by side::

    {"v":1,"id":42,"p":"socks5","h":"127.0.0.1","o":1080,"u":"user","s":"pass","k":"<hash>","w":[1,7]}
    {"v":2,"id":42,"p":"socks5","h":"127.0.0.1","o":1080,"c":"<token>","k":"<hash>","w":[1,7]}

``v`` payload format version, ``id`` PostgreSQL route id, ``p`` protocol, ``h`` host, ``o`` port,
``u``/``s`` username/password in plaintext (version 1; absent when none), ``c`` both credentials sealed by
:class:`magpie.base.crypto.QueueCipher` (version 2, written when ``PROXY_QUEUE_ENCRYPT_CREDENTIALS`` is on and
the route has credentials), ``k`` stored route hash, ``w`` sorted active workspace ids. ``w`` always comes
last: the Lua scripts merge workspaces by rewriting only the closing ``"w":[...]}`` and keep everything
before it (credentials in either version) as stored.

Decoding a claimed payload reuses ``k``: no hashing on dequeue; a version-2 payload costs one AES-SIV
decryption (``benchmarks/queue_bench.py`` reports it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from magpie.base.crypto import CredentialError, QueueCipher
from magpie.errors import MagpieError
from magpie.base.protocols import PROTOCOLS
from magpie.base.routes import Route

PAYLOAD_VERSION = 1
"""Version of a payload with plaintext (or no) credentials."""
ENCRYPTED_VERSION = 2
"""Version of a payload whose credentials are sealed in ``c``."""


class PayloadError(MagpieError, ValueError):
    """A stored payload is not valid JSON of a known version."""


class PayloadKeyError(PayloadError, CredentialError):
    """A version-2 payload's credentials do not open: no key given, or ``PROXY_ENCRYPTION_KEY`` differs."""


@dataclass(slots=True)
class Payload:
    """Decoded payload. ``workspaces`` is a sorted list of workspace ids (ints); ``version`` is the version
    it was decoded from (informative: :meth:`encode` picks the version from its ``cipher`` argument)."""

    route_id: int
    route: Route
    route_hash: str
    workspaces: list[int] = field(default_factory=list)
    version: int = PAYLOAD_VERSION

    def encode(self, cipher: QueueCipher | None = None) -> str:
        """Compact JSON text (see module docstring).

        Args:
            cipher: seal the credentials into ``c`` (version 2) with this cipher; None writes them in
                plaintext (version 1). A route without credentials is always version 1.
        """
        r = self.route
        creds = r.username is not None or r.password is not None
        d: dict = {"v": ENCRYPTED_VERSION if cipher is not None and creds else PAYLOAD_VERSION,
                   "id": self.route_id, "p": r.protocol, "h": r.host, "o": r.port}
        if cipher is not None and creds:
            d["c"] = cipher.seal(r.username, r.password, self.route_hash)
        else:
            if r.username is not None:
                d["u"] = r.username
            if r.password is not None:
                d["s"] = r.password
        d["k"] = self.route_hash
        d["w"] = sorted(set(self.workspaces))
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes, cipher: QueueCipher | None = None) -> "Payload":
        """Parse a stored payload of either version.

        Args:
            raw: the payload text.
            cipher: opens version-2 credentials (:attr:`magpie.base.crypto.Keyring.queue`); not needed for
                version 1.
        Raises:
            PayloadKeyError: version 2 and ``cipher`` is None or derives from another key (one line naming
                ``PROXY_ENCRYPTION_KEY``; never the token or a credential).
            PayloadError: malformed or of an unknown version.
        """
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise PayloadError(f"payload must be a JSON object, got {type(d).__name__}")
            v = d.get("v")
            if v not in (PAYLOAD_VERSION, ENCRYPTED_VERSION):
                raise PayloadError(f"unknown payload version {v!r}")
            w = d.get("w") or []
            if isinstance(w, dict):  # Lua cjson encodes an empty array as {}
                w = []
            if d["p"] not in PROTOCOLS:
                raise PayloadError(f"unknown protocol {d['p']!r} (expected one of {', '.join(PROTOCOLS)})")
            if not 1 <= int(d["o"]) <= 65535:
                raise PayloadError(f"bad port {d['o']!r}")
            if not isinstance(w, list) or not isinstance(d["k"], str):
                raise PayloadError("'w' must be a list of workspace ids and 'k' the route hash")
            if v == PAYLOAD_VERSION:
                if "c" in d:
                    raise PayloadError("a version 1 payload has plaintext credentials only ('c' needs v 2)")
                user, pw = d.get("u"), d.get("s")
            else:
                user, pw = _open(d, cipher)
            return cls(
                route_id=int(d["id"]),
                route=Route(d["p"], d["h"], int(d["o"]), user, pw),
                route_hash=d["k"],
                workspaces=[int(x) for x in w],
                version=v,
            )
        except PayloadError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise PayloadError(f"malformed route payload: {exc}") from None


def _open(d: dict, cipher: QueueCipher | None) -> tuple[str | None, str | None]:
    if "u" in d or "s" in d or not isinstance(d.get("c"), str):
        raise PayloadError("a version 2 payload carries its credentials sealed in 'c' only")
    if cipher is None:
        raise PayloadKeyError(f"route {d['k']} has encrypted queue credentials and no key derived from "
                              "PROXY_ENCRYPTION_KEY was given to open them")
    try:
        return cipher.open(d["c"], d["k"])
    except CredentialError as exc:
        raise PayloadKeyError(str(exc)) from None


def is_encrypted(raw: str | bytes) -> bool:
    """True when ``raw`` is a version-2 payload (credentials sealed); cheap, no decryption, no validation."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return text.startswith('{"v":2,')


def write_cipher(settings) -> QueueCipher | None:
    """The cipher new and changed payloads are written with: the queue key of ``PROXY_ENCRYPTION_KEY``
    when ``PROXY_QUEUE_ENCRYPT_CREDENTIALS`` is on, else None (plaintext, version 1).

    Args:
        settings: :class:`magpie.config.Settings` (``encrypt_queue_credentials``, ``encryption_key``).
    """
    return read_cipher(settings) if settings.encrypt_queue_credentials else None


def read_cipher(settings) -> QueueCipher:
    """The cipher that opens version-2 payloads (whatever ``PROXY_QUEUE_ENCRYPT_CREDENTIALS`` says: readers
    accept both versions). ``settings``: :class:`magpie.config.Settings` (``encryption_key``)."""
    from magpie.base.crypto import get_keyring

    return get_keyring(settings.encryption_key).queue


def transcode(raw: str | bytes, cipher: QueueCipher, *, encrypt: bool) -> str | None:
    """The payload text ``raw`` rewritten with its credentials sealed (``encrypt``) or in plaintext, or
    None when it is already in that form (or has no credentials). Raises :class:`PayloadError` /
    :class:`PayloadKeyError` as :meth:`Payload.decode` does."""
    if encrypt and is_encrypted(raw):
        return None  # sealed already: not opened (no decryption cost)
    p = Payload.decode(raw, cipher)
    if encrypt:
        if p.version == ENCRYPTED_VERSION or (p.route.username is None and p.route.password is None):
            return None
        return p.encode(cipher)
    return p.encode(None) if p.version == ENCRYPTED_VERSION else None


def schedule_item(record, cipher=None) -> tuple[str, str]:
    """The schedule entry of a stored route, as :meth:`magpie.queue.RouteQueue.schedule` takes it (an
    import, a rebuild of the schedule and a blacklist's release all feed the schedule this way).

    Args:
        record: a :class:`magpie.db.repo.RouteRecord` (or :class:`~magpie.db.repo.StoredRoute`).
        cipher: a :class:`magpie.base.crypto.QueueCipher` to seal the credentials with, or None for plaintext;
            pass :func:`write_cipher` of the settings
            (``PROXY_QUEUE_ENCRYPT_CREDENTIALS``).
    Returns:
        ``(route_hash, payload JSON text)`` (see :mod:`magpie.queue.payload`).
    """
    payload = Payload(record.route_id, record.route, record.route_hash, list(record.workspace_ids))
    return record.route_hash.strip(), payload.encode(cipher)


def payload_revision(raw: str | bytes | None) -> str | None:
    """A short digest of a stored payload text (16 hex characters of its SHA-1), or None without one.

    ``magpie queue inspect`` prints it; ``magpie queue update --expected-revision`` names it, so an update
    built from an older read is refused (``payload_changed``) instead of dropping a workspace added since.
    """
    if raw is None:
        return None
    data = raw.encode() if isinstance(raw, str) else raw
    return hashlib.sha1(data, usedforsecurity=False).hexdigest()[:16]
