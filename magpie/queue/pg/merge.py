"""Workspace-id merges on payload text, the same rules as the Lua helpers (``split_w`` in ``lua/lib.lua``).

Only the closing ``"w":[...]}`` of a payload is read and rewritten; everything before it (credentials in
either payload version) stays as stored.
"""

from __future__ import annotations

import json
import re

_W = re.compile(r'^(.*"w":)\[([\d,]*)\]}$', re.DOTALL)


def split_w(text: str) -> tuple[str, str] | tuple[None, None]:
    """``(head, ids_csv)`` of a payload, or ``(None, None)`` when its shape is foreign."""
    m = _W.match(text or "")
    return (m.group(1), m.group(2)) if m else (None, None)


def id_list(csv: str | None) -> tuple[set[int], list[int]]:
    """The ids of ``csv`` as a set and as a list in first-seen order, without duplicates."""
    seen: set[int] = set()
    out: list[int] = []
    for part in re.findall(r"\d+", csv or ""):
        v = int(part)
        if v not in seen:
            seen.add(v)
            out.append(v)
    return seen, out


def join_w(head: str, ids: list[int]) -> str:
    """``head`` followed by the sorted ids and the closing ``]}``."""
    return head + "[" + ",".join(str(v) for v in sorted(ids)) + "]}"


def merge_import(stored: str, incoming: str) -> str | None:
    """The stored payload with ``incoming``'s new workspace ids added, or None when nothing changes."""
    head, have = split_w(stored)
    _, add = split_w(incoming)
    if head is None or add is None:
        return None
    seen, ids = id_list(have)
    extra = [v for v in id_list(add)[1] if v not in seen]
    return join_w(head, ids + extra) if extra else None


def ws_set(text: str) -> set[int] | None:
    """The ``"w"`` ids of a worker's payload in any JSON encoding, or None when it has no such list."""
    try:
        doc = json.loads(text)
        ids = doc["w"] if isinstance(doc, dict) else None
        return {int(v) for v in ids} if isinstance(ids, list) else None
    except (ValueError, TypeError, KeyError):
        return None


def apply_delta(stored: str, original: str, desired: str) -> str | None:
    """Apply a worker's change (ids removed or added between ``original`` and ``desired``, JSON of any
    encoding) to ``stored`` (compact form).

    Returns the new text ("" when no workspace is left), or None when a shape cannot be merged.
    """
    head, have = split_w(stored)
    orig, want = ws_set(original), ws_set(desired)
    if head is None or orig is None or want is None:
        return None
    result = [v for v in id_list(have)[1] if not (v in orig and v not in want)]
    result += [v for v in sorted(want) if v not in orig and v not in result]
    return join_w(head, result) if result else ""
