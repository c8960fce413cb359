"""Line breaks of a proxy list: ``\\n`` (and ``\\r\\n``) only, so reported line numbers are those of editors
and ``grep -n``, whatever other break characters (a lone CR, form feed, U+2028...) a line holds."""

from __future__ import annotations

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


def read_lines(stream: IO[bytes]) -> Iterator[str]:
    """The lines of a binary stream as :func:`split_lines` counts them, decoded as UTF-8 (undecodable
    bytes become U+FFFD). Raises ``OSError`` when the stream cannot be read."""
    for raw in stream:  # a binary stream breaks at b"\n" only
        yield raw.decode("utf-8", errors="replace")


def segments(text: str) -> list[str]:
    """One physical line without its line ending, split at any lone CR left inside it (an old Mac break or
    a stray CR: the parts share the physical line's number)."""
    text = text.rstrip("\n")
    text = text.removesuffix("\r")
    return text.split("\r") if "\r" in text else [text]
