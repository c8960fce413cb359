"""Rewrite the stored route payloads with their credentials sealed or in plaintext (``magpie queue
migrate-payloads``).

The pass walks the payload keys with SCAN in batches: each batch is read with one MGET, rewritten in
Python (:func:`magpie.queue.payload.transcode`) and written back by ``migrate_payload.lua``, which sets a
payload only while it is still the text read (a workspace an import merged in meanwhile is never lost)
and no live lease holds the route (its holder keeps the payload it claimed). A payload changed since the
read is read again and retried; a leased one is left for a later pass. Every rewrite is idempotent, so a
pass stopped anywhere is resumed by running it again: payloads already in the wanted form are skipped.
"""

from __future__ import annotations

from collections.abc import Callable

from magpie.base import redisconn
from magpie.base.crypto import QueueCipher
from magpie.queue.payload import PayloadError, PayloadKeyError, transcode
from magpie.queue.scripts import script_text

REWRITTEN, CHANGED, LEASED = 1, 0, 2
"""Per-item codes of ``migrate_payload.lua``."""


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def migrate_payloads(queue, cipher: QueueCipher, *, encrypt: bool, batch: int = 500, retries: int = 2,
                     progress: Callable[[dict], object] | None = None) -> dict:
    """Rewrite every payload of ``queue`` with its credentials sealed (``encrypt``) or in plaintext.

    Args:
        queue: a :class:`magpie.queue.RouteQueue`.
        cipher: :attr:`magpie.base.crypto.Keyring.queue` of ``PROXY_ENCRYPTION_KEY`` (seals, and opens for
            ``encrypt=False``).
        batch: payload keys per SCAN step and per script call (1..10000).
        retries: re-reads of a payload that changed between the read and the conditional write.
        progress: called with the running counts after each batch.
    Returns:
        ``{"scanned", "changed", "skipped", "deferred", "malformed"}``: payload keys read (SCAN may
        return a key twice), payloads rewritten, payloads left as they are (already in the wanted form,
        without credentials, gone, malformed or deferred), ``deferred`` of those still to rewrite (a
        live lease, or changed on every try: run again later), ``malformed`` of those not decodable.
    Raises:
        magpie.queue.payload.PayloadKeyError: a sealed payload does not open with ``cipher`` (decrypting
            under another ``PROXY_ENCRYPTION_KEY``); payloads rewritten before it stay rewritten.
        ValueError: ``batch`` out of range.
    """
    if not 1 <= int(batch) <= 10_000:
        raise ValueError(f"batch must be within 1..10000, got {batch!r}")
    r = queue.r
    script = r.register_script(script_text("migrate_payload"))
    prefix = queue.keys.payload_prefix
    core = queue.keys.core()
    now = getattr(queue, "_now", lambda: 0)
    counts = {"scanned": 0, "changed": 0, "skipped": 0, "deferred": 0, "malformed": 0}

    def rewrite(pending: dict[str, object]) -> None:
        """``pending``: member -> payload text read (None when gone). Applies, retries, counts."""
        for attempt in range(retries + 1):
            triples: list = []
            for member, raw in pending.items():
                new = None
                if raw is not None:
                    try:
                        new = transcode(raw, cipher, encrypt=encrypt)
                    except PayloadKeyError:
                        raise
                    except PayloadError:
                        counts["malformed"] += 1
                if new is None:
                    counts["skipped"] += 1
                else:
                    triples += [member, raw, new]
            if not triples:
                return
            codes = [int(c) for c in script(keys=core, args=[now(), prefix, *triples])]
            again = []
            for member, code in zip(triples[0::3], codes):
                if code == REWRITTEN:
                    counts["changed"] += 1
                elif code == LEASED or attempt == retries:
                    counts["skipped"] += 1
                    counts["deferred"] += 1
                else:
                    again.append(member)
            if not again:
                return
            pending = dict(zip(again, redisconn.mget(r, [prefix + m for m in again])))

    for keys in _scan_batches(r, _glob_escape(prefix) + "*", int(batch)):
        if keys:
            names = [k.decode() if isinstance(k, bytes) else k for k in keys]
            counts["scanned"] += len(names)
            rewrite(dict(zip((n[len(prefix):] for n in names), redisconn.mget(r, names))))
        if progress is not None:
            progress(dict(counts))
    return counts


def _scan_batches(r, match: str, batch: int):
    """Keys matching ``match`` in lists of about ``batch``: one ``SCAN`` call per list on one server; on a
    cluster ``scan_iter`` over every primary (redis-py's cluster ``SCAN`` answers per node)."""
    if not redisconn.is_cluster(r):
        cursor = 0
        while True:
            cursor, keys = r.scan(cursor, match=match, count=batch)
            yield keys
            if int(cursor) == 0:
                return
    buf: list = []
    for k in r.scan_iter(match=match, count=batch):
        buf.append(k)
        if len(buf) >= batch:
            yield buf
            buf = []
    yield buf
