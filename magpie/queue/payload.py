"""The compact route payload stored at ``proxy:<hash>`` (docs/design.md, "The route schedule").

Wire form: JSON with short keys, no spaces::

    {"v":1,"id":42,"p":"socks5","h":"127.0.0.1","o":1080,"u":"user","s":"pass","k":"<hash>","w":[1,7]}

``v`` payload format version, ``id`` PostgreSQL route id, ``p`` protocol, ``h`` host, ``o`` port,
``u``/``s`` username/password (absent when none), ``k`` stored route hash, ``w`` sorted active workspace
ids. Decoding a claimed payload reuses ``k``: no hashing or decryption on dequeue (seed: cost boundary).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from magpie.errors import MagpieError
from magpie.routes import PROTOCOLS, Route

PAYLOAD_VERSION = 1


class PayloadError(MagpieError, ValueError):
    """A stored payload is not valid JSON of a known version."""


@dataclass(slots=True)
class Payload:
    """Decoded payload. ``workspaces`` is a sorted list of workspace ids (ints)."""

    route_id: int
    route: Route
    route_hash: str
    workspaces: list[int] = field(default_factory=list)
    version: int = PAYLOAD_VERSION

    def encode(self) -> str:
        """Compact JSON text (see module docstring)."""
        r = self.route
        d: dict = {"v": self.version, "id": self.route_id, "p": r.protocol, "h": r.host, "o": r.port}
        if r.username is not None:
            d["u"] = r.username
        if r.password is not None:
            d["s"] = r.password
        d["k"] = self.route_hash
        d["w"] = sorted(set(self.workspaces))
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> "Payload":
        """Parse a stored payload; raises :class:`PayloadError` when malformed or of an unknown version."""
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise PayloadError(f"payload must be a JSON object, got {type(d).__name__}")
            if d.get("v") != PAYLOAD_VERSION:
                raise PayloadError(f"unknown payload version {d.get('v')!r}")
            w = d.get("w") or []
            if isinstance(w, dict):  # Lua cjson encodes an empty array as {}
                w = []
            if d["p"] not in PROTOCOLS:
                raise PayloadError(f"unknown protocol {d['p']!r} (expected one of {', '.join(PROTOCOLS)})")
            if not 1 <= int(d["o"]) <= 65535:
                raise PayloadError(f"bad port {d['o']!r}")
            if not isinstance(w, list) or not isinstance(d["k"], str):
                raise PayloadError("'w' must be a list of workspace ids and 'k' the route hash")
            return cls(
                route_id=int(d["id"]),
                route=Route(d["p"], d["h"], int(d["o"]), d.get("u"), d.get("s")),
                route_hash=d["k"],
                workspaces=[int(x) for x in w],
                version=d["v"],
            )
        except PayloadError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise PayloadError(f"malformed route payload: {exc}") from None
