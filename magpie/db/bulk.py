"""Bulk parameters for PostgreSQL: whole arrays as one literal, rows as ``COPY`` text.

psycopg2 turns a Python list parameter into ``ARRAY[v1, v2, ...]``, adapting every element in turn, and
the server then parses every element as a constant of its own. A batch statement over thousands of rows
costs less on both sides when each array travels as one string, ``'{1,2,3}'``, cast in the statement
(``%s::bigint[]``): the server parses one literal (``array_in``). The ``*_array`` functions build such
literals; :func:`copy_in` writes rows with ``COPY ... FROM STDIN`` (text format, :func:`copy_field`) in
the transaction of a SQLAlchemy connection.

Text handed to these functions must not hold NUL characters (PostgreSQL text cannot store them; the
results-stream codec removes them, :func:`magpie.stats.entry.parse_entry`).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from datetime import datetime, timedelta

import psycopg2
import psycopg2.extensions
import sqlalchemy as sa

NULL = "\\N"
"""``COPY`` text format's NULL."""


def int_array(values: Iterable[int | None]) -> str:
    """``'{1,NULL,3}'``: an array literal of integers (None is NULL) for ``::bigint[]``, ``::integer[]``,
    ``::smallint[]``."""
    values = values if isinstance(values, (list, tuple)) else list(values)
    try:
        return "{" + ",".join(map(int.__repr__, values)) + "}"
    except TypeError:  # NULLs, or integers of another type
        return "{" + ",".join(["NULL" if v is None else str(int(v)) for v in values]) + "}"


def float_array(values: Iterable[float | None]) -> str:
    """An array literal of floats (``repr``, so a value reads back as the same float8; None is NULL)
    for ``::real[]`` or ``::double precision[]``."""
    return "{" + ",".join(["NULL" if v is None else repr(float(v)) for v in values]) + "}"


def bool_array(values: Iterable[bool | None]) -> str:
    """``'{t,f,NULL}'``: an array literal of booleans for ``::boolean[]``."""
    return "{" + ",".join(["NULL" if v is None else ("t" if v else "f") for v in values]) + "}"


_NAIVE_EPOCH = datetime(1970, 1, 1)
_MILLIS = tuple(f".{i:03d}+00:00" for i in range(1000))
_SECONDS: dict[int, str] = {}  # Unix second -> "YYYY-MM-DDTHH:MM:SS" (UTC), bounded below


def ms_timestamp(ms: int) -> str:
    """Unix time ``ms`` (milliseconds) as ISO 8601 text in UTC, ``"2023-11-14T22:13:20.123+00:00"``,
    for a ``timestamptz`` (array element or ``COPY`` field): the instant ``1970-01-01 UTC + ms``."""
    sec, milli = divmod(ms, 1000)
    head = _SECONDS.get(sec)
    if head is None:
        if len(_SECONDS) >= 4096:
            _SECONDS.clear()
        head = _SECONDS[sec] = (_NAIVE_EPOCH + timedelta(seconds=sec)).isoformat()
    return head + _MILLIS[milli]


def timestamp_array(values: Iterable[datetime | int | None]) -> str:
    """An array literal of instants for ``::timestamptz[]``: a datetime in ISO 8601 (an aware one keeps
    its offset, so the instant does not depend on the session's time zone), an int as Unix milliseconds
    (:func:`ms_timestamp`); None is NULL."""
    return "{" + ",".join(
        ["NULL" if v is None else ms_timestamp(v) if isinstance(v, int) else v.isoformat() for v in values]
    ) + "}"


def text_array(values: Iterable[str | None]) -> str:
    """An array literal of strings for ``::text[]``: every element double-quoted with ``\\`` and ``"``
    escaped, so any text (``NULL``, empty, braces, commas, spaces) reads back as it was; None is NULL."""
    return "{" + ",".join(
        ["NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values]
    ) + "}"


def copy_field(v: str | None) -> str:
    """One text field of ``COPY`` text format: backslash, tab, newline and carriage return escaped;
    None is ``\\N``."""
    if v is None:
        return NULL
    return v.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def copy_in(conn: sa.Connection, table: str, columns: Iterable[str], data: str) -> None:
    """``COPY table (columns) FROM STDIN`` with ``data`` (text format: rows ending in ``\\n``, fields
    separated by tabs, each made by :func:`copy_field` or a number's text) in ``conn``'s transaction.

    ``table`` and ``columns`` are SQL identifiers written into the statement as they are.
    Raises ``sqlalchemy.exc.DBAPIError`` (``DataError``, ``IntegrityError``, ``OperationalError``, ...)
    as a statement run through SQLAlchemy would, with ``connection_invalidated`` set (and the connection
    invalidated) when the server connection was lost; ``UnicodeEncodeError`` for text the connection's
    encoding cannot hold.
    """
    sql = f"COPY {table} ({', '.join(columns)}) FROM STDIN"
    raw = conn.connection.driver_connection
    payload = data.encode(psycopg2.extensions.encodings.get(raw.encoding, raw.encoding))
    try:
        with raw.cursor() as cur:
            cur.copy_expert(sql, io.BytesIO(payload), size=max(8192, len(payload)))
    except psycopg2.Error as exc:
        # what SQLAlchemy does for a statement it runs: wrap, and invalidate a lost connection
        gone = bool(conn.dialect.is_disconnect(exc, raw, None))
        if gone:
            conn.invalidate(exc)
        raise sa.exc.DBAPIError.instance(
            sql, None, exc, psycopg2.Error, connection_invalidated=gone, dialect=conn.dialect
        ) from exc


__all__ = [
    "NULL",
    "bool_array",
    "copy_field",
    "copy_in",
    "float_array",
    "int_array",
    "ms_timestamp",
    "text_array",
    "timestamp_array",
]
