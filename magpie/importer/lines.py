"""Line breaks of a proxy list: ``\\n`` (and ``\\r\\n``) only, so reported line numbers are those of editors
and ``grep -n``, whatever other break characters (a lone CR, form feed, U+2028...) a line holds."""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from typing import IO

__all__ = ["read_lines", "segments", "split_lines"]


def split_lines(text: str) -> list[str]:
    """Split ``text`` into lines at ``\\n`` only (``\\r\\n`` too; no final empty line after a last
    ``\\n``), so line numbers are those of editors and ``grep -n`` whatever other break characters it has."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


# UTF-32 first: its little-endian mark starts with UTF-16's
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def read_lines(stream: IO[bytes]) -> Iterator[str]:
    """The lines of a binary stream as :func:`split_lines` counts them, decoded as UTF-8 (undecodable
    bytes become U+FFFD), or as UTF-16/UTF-32 when the stream starts with that byte-order mark (as editors
    on Windows save text). Raises ``OSError`` when the stream cannot be read."""
    first = True
    for raw in stream:  # a binary stream breaks at b"\n" only
        if first:
            first = False
            encoding = next((enc for bom, enc in _BOMS if raw.startswith(bom)), None)
            if encoding is not None:  # b"\n" is not a line break there: decode incrementally
                dec = codecs.getincrementaldecoder(encoding)(errors="replace")
                pending = ""
                for chunk in (raw, *stream):
                    pending += dec.decode(chunk)
                    *done, pending = pending.split("\n")
                    yield from (line + "\n" for line in done)
                pending += dec.decode(b"", final=True)
                if pending:
                    yield pending
                return
        yield raw.decode("utf-8", errors="replace")


def segments(text: str) -> list[str]:
    """One physical line without its line ending, split at any lone CR left inside it (an old Mac break or
    a stray CR: the parts share the physical line's number)."""
    text = text.rstrip("\n")
    text = text.removesuffix("\r")
    return text.split("\r") if "\r" in text else [text]
