"""The results-stream entry format: one codec from a check result to stream entry fields and back.

The checker returns a :class:`magpie.checker.result.CheckResult`; :func:`entry_fields` turns it (with the
route's id and hash) into the flat entry a producer publishes, :func:`parse_entry` turns an entry read by
the consumer back into a :class:`StreamEntry` holding a ``CheckResult``, and :func:`decode_result` reads
the result part alone. Nothing else in magpie spells these fields.

Entry fields (all ``str``; ``""`` means ``None``): ``route_id``, ``route_hash``, ``alive``
(``"1"``/``"0"``), ``latency_ms`` (milliseconds), ``status``, ``attempts``, ``error``, ``body``,
``anonymity``, ``judge``, ``checked_at_ms`` (Unix time in ms), and, only when the judge echoed one,
``exit_ip`` (the address the judge saw; optional, so entries written before it existed still read).
An entry moved back from the dead-letter stream (``magpie stats redrive``) also carries ``origin_id``, the id it was first published under: the
replay ledger and ``check_history.stream_id`` record that id (:attr:`StreamEntry.ledger_id`), so an entry
applied once is never applied again, however often it is redriven.

An entry that cannot be applied goes to the dead-letter stream as a :class:`DeadLetter`, written with
:func:`dead_letter_fields`: ``stream_id``, ``reason``, ``consumer``, ``dead_at_ms`` and ``entry`` (the
original fields as JSON).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from magpie.checker.anonymity import LEVELS, normalize_ip
from magpie.checker.result import CheckResult
from magpie.errors import MagpieError
from magpie.queue.streams import id_parts, ledger_id

ROUTE_FIELDS = ("route_id", "route_hash")
"""Fields naming the checked route."""

RESULT_FIELDS = (
    "alive", "latency_ms", "status", "attempts", "error", "body", "anonymity", "judge", "checked_at_ms",
)
"""Fields carrying the :class:`~magpie.checker.result.CheckResult`."""

OPTIONAL_RESULT_FIELDS = ("exit_ip",)
"""Result fields written only when set (absent reads back as None)."""

FIELDS = ROUTE_FIELDS + RESULT_FIELDS + OPTIONAL_RESULT_FIELDS
"""Every field of a published entry, in the order written."""

ORIGIN_FIELD = "origin_id"
"""Field of a redriven entry: the stream id it was first published under."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MAX_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z, the last instant Python's datetime holds
_MAX_LATENCY_MS = 1e9
_INT32 = 2**31 - 1
_INT64 = 2**63 - 1
_SMALLINT = 32767
_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
_UNSET = object()
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")  # an IPv4 address as normalize_ip writes it


class MalformedEntry(MagpieError, ValueError):
    """A stream entry's fields are missing or unusable; the message is the dead-letter reason."""


# -------------------------------------------------------------------------------------------- encode


def _str(v) -> str:
    return "" if v is None else str(v)


def entry_fields(
    result: CheckResult, route_id: int | None = None, route_hash: str | None = None
) -> dict[str, str]:
    """The stream entry (flat ``str -> str``) of one check result; ``None`` becomes ``""``.

    Args:
        result: the checker's result (``latency_ms`` in ms, ``checked_at_ms`` Unix ms).
        route_id / route_hash: the checked route; with ``route_id`` None only the result fields are
            returned (the form :func:`decode_result` reads).
    Returns:
        :data:`FIELDS` (or :data:`RESULT_FIELDS`) mapped to their text.
    """
    out: dict[str, str] = {}
    if route_id is not None:
        out["route_id"] = str(int(route_id))
        out["route_hash"] = _str(route_hash)
    out.update(
        alive="1" if result.alive else "0",
        latency_ms="" if result.latency_ms is None else repr(float(result.latency_ms)),
        status=_str(result.status),
        attempts=str(int(result.attempts)),
        error=_str(result.error),
        body=_str(result.body),
        anonymity=_str(result.anonymity),
        judge=_str(result.judge),
        checked_at_ms=str(int(result.checked_at_ms)),
    )
    if result.exit_ip is not None:
        out["exit_ip"] = result.exit_ip
    return out


def encode_result(
    *,
    route_id: int,
    route_hash: str | None,
    alive: bool,
    checked_at_ms: int,
    latency_ms: float | None = None,
    status: int | None = None,
    attempts: int = 1,
    error: str | None = None,
    body: str | None = None,
    anonymity: str | None = None,
    judge: str | None = None,
    exit_ip: str | None = None,
) -> dict[str, str]:
    """:func:`entry_fields` from keywords instead of a :class:`CheckResult` (tools and tests).

    ``latency_ms`` in milliseconds, ``checked_at_ms`` Unix time in milliseconds.
    """
    result = CheckResult(alive, latency_ms, status, attempts, error, body, anonymity, judge, checked_at_ms,
                         exit_ip=exit_ip)
    return entry_fields(result, route_id, route_hash)


# -------------------------------------------------------------------------------------------- decode


def _int(fields: Mapping[str, str], name: str, lo: int, hi: int, *, required: bool, default=None):
    raw = fields.get(name)
    if raw is None and required:
        raise MalformedEntry(f"missing field {name!r}")
    raw = (raw or "").strip()
    if raw == "":
        if required:
            raise MalformedEntry(f"empty field {name!r}")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise MalformedEntry(f"field {name!r} is not an integer: {raw[:40]!r}") from None
    if not lo <= value <= hi:
        raise MalformedEntry(f"field {name!r} out of range [{lo}, {hi}]: {value}")
    return value


def _text(fields: Mapping[str, str], name: str) -> str | None:
    raw = fields.get(name) or ""
    return raw.replace("\x00", "") or None  # PostgreSQL text cannot hold NUL


def _latency(fields: Mapping[str, str]) -> float | None:
    raw = (fields.get("latency_ms") or "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise MalformedEntry(f"field 'latency_ms' is not a number: {raw[:40]!r}") from None
    if not math.isfinite(value) or not 0 <= value <= _MAX_LATENCY_MS:
        raise MalformedEntry(f"field 'latency_ms' out of range [0, {_MAX_LATENCY_MS:g}]: {raw[:40]}")
    return value


def _exit_ip(fields: Mapping[str, str]) -> str | None:
    raw = (fields.get("exit_ip") or "").strip()
    if not raw:
        return None
    if _IPV4.fullmatch(raw):  # already in normal form (what a check writes); anything else is parsed
        return raw
    ip = normalize_ip(raw) if len(raw) <= 64 else None
    if ip is None:
        raise MalformedEntry(f"field 'exit_ip' is not an IP address: {raw[:40]!r}")
    return ip


def _result(fields: Mapping[str, str], *, complete: bool) -> CheckResult:
    """The result part of decoded fields; ``complete`` requires ``attempts`` (else it defaults to 0)."""
    alive = fields.get("alive")
    if alive not in ("1", "0"):
        raise MalformedEntry(f"field 'alive' must be '1' or '0', got {alive!r}")
    checked_at_ms = _int(fields, "checked_at_ms", 0, _MAX_MS, required=True)
    return CheckResult(
        alive=alive == "1",
        latency_ms=_latency(fields),
        status=_int(fields, "status", -_INT32 - 1, _INT32, required=False),
        attempts=_int(fields, "attempts", 0, _SMALLINT, required=complete, default=0),
        error=_text(fields, "error"),
        body=_text(fields, "body"),
        anonymity=_text(fields, "anonymity"),
        judge=_text(fields, "judge"),
        checked_at_ms=checked_at_ms,
        exit_ip=_exit_ip(fields),
    )


def decode_result(fields: Mapping[str | bytes, str | bytes]) -> CheckResult:
    """Inverse of :func:`entry_fields` for the result part: keys and values may be ``bytes`` (UTF-8),
    fields outside :data:`RESULT_FIELDS` are ignored, ``""`` reads back as None.

    Raises:
        MalformedEntry (a ``ValueError``): a field is missing, not UTF-8, or malformed (``alive`` not
            ``"0"``/``"1"``, a number that does not parse or is out of range, an unknown anonymity
            level, an empty judge).
    """
    f: dict[str, str] = {}
    try:
        for k, v in fields.items():
            key = k.decode() if isinstance(k, bytes) else str(k)
            if key in RESULT_FIELDS or key in OPTIONAL_RESULT_FIELDS:
                f[key] = v.decode() if isinstance(v, bytes) else str(v)
    except (UnicodeDecodeError, AttributeError) as exc:
        raise MalformedEntry(f"check result fields are not UTF-8 text: {exc}") from None
    missing = [k for k in RESULT_FIELDS if k not in f]
    if missing:
        raise MalformedEntry(f"check result fields missing: {', '.join(missing)}")
    result = _result(f, complete=True)
    if result.anonymity is not None and result.anonymity not in LEVELS:
        raise MalformedEntry(f"check result anonymity unknown: {result.anonymity!r}")
    if not result.judge:
        raise MalformedEntry("check result judge is empty")
    return result


@dataclass(slots=True)
class StreamEntry:
    """A parsed, validated stream entry: which route was checked, and the check's result.

    Attributes:
        stream_id: ``"<ms>-<seq>"`` id of the entry in the results stream.
        route_id / route_hash: the route (``route_hash`` None when the producer did not send one).
        result: the :class:`CheckResult`; ``latency_ms`` rounded to 3 decimals (microseconds).
        fields: the entry's decoded fields as read (kept for a dead letter).
        origin_id: the id the entry was first published under when it was redriven, else None.
        space: the ledger id space of the stream it was read from (:func:`magpie.queue.streams.ledger_id`).
    """

    stream_id: str
    route_id: int
    route_hash: str | None
    result: CheckResult
    fields: dict[str, str]
    origin_id: str | None = None
    space: int = 0
    # derived values, computed on first use and again only when what they derive from changed (plain
    # slots: no extra object per entry for the garbage collector to track)
    _at_ms: object = field(default=_UNSET, init=False, repr=False, compare=False)
    _at: datetime | None = field(default=None, init=False, repr=False, compare=False)
    _lid_of: object = field(default=_UNSET, init=False, repr=False, compare=False)
    _lid_origin: str | None = field(default=None, init=False, repr=False, compare=False)
    _lid_space: int = field(default=0, init=False, repr=False, compare=False)
    _lid: str = field(default="", init=False, repr=False, compare=False)

    @property
    def ledger_id(self) -> str:
        """The id the replay ledger and ``check_history.stream_id`` record: :attr:`origin_id` for a
        redriven entry, else :attr:`stream_id`, in the stream's ledger space
        (:func:`magpie.queue.streams.ledger_id`; unchanged for the untagged stream)."""
        if self._lid_of is not self.stream_id or self._lid_origin is not self.origin_id \
                or self._lid_space != self.space:
            self._lid = ledger_id(self.origin_id or self.stream_id, self.space)
            self._lid_of, self._lid_origin, self._lid_space = self.stream_id, self.origin_id, self.space
        return self._lid

    @property
    def checked_at(self) -> datetime:
        """``result.checked_at_ms`` as an aware UTC datetime."""
        ms = self.result.checked_at_ms
        if self._at_ms is not ms:
            self._at = _EPOCH + timedelta(milliseconds=ms)
            self._at_ms = ms
        return self._at

    @property
    def order(self) -> tuple[datetime, int, int]:
        """Sort key: check time, then stream id (ties of one millisecond keep publication order)."""
        return (self.checked_at, *id_parts(self.stream_id))


def parse_entry(stream_id: str, fields: Mapping[str, str], space: int = 0) -> StreamEntry:
    """Validate one entry's decoded fields against the columns they are stored in; ``space`` is the ledger
    id space of the stream it came from (:func:`magpie.queue.streams.stream_space`).

    Raises:
        MalformedEntry: a required field (``route_id``, ``alive``, ``checked_at_ms``) is missing or
            garbage, an optional numeric field is not a number in the column's range, or ``origin_id``
            is not a stream id.
    """
    route_id = _int(fields, "route_id", 1, _INT64, required=True)
    result = _result(fields, complete=False)
    if result.latency_ms is not None:
        result.latency_ms = round(result.latency_ms, 3)
    origin = (fields.get(ORIGIN_FIELD) or "").strip() or None
    if origin is not None and not _STREAM_ID.fullmatch(origin):
        raise MalformedEntry(f"field {ORIGIN_FIELD!r} is not a stream id: {origin[:40]!r}")
    return StreamEntry(
        stream_id=stream_id,
        route_id=route_id,
        route_hash=(fields.get("route_hash") or "").strip() or None,
        result=result,
        fields=dict(fields),
        origin_id=origin,
        space=int(space),
    )


# ------------------------------------------------------------------------------------- dead letters


@dataclass(slots=True)
class DeadLetter:
    """An entry that cannot be applied, with the reason; written to the dead-letter stream.

    Attributes:
        stream_id: the entry's id in the results stream.
        reason: one line (malformed, unknown route, trimmed, rejected by the database, ...).
        fields: the entry's fields (empty when it was trimmed before ingestion).
        ack: acknowledge it too (False when ``XAUTOCLAIM`` already dropped it from the pending list).
    """

    stream_id: str
    reason: str
    fields: dict[str, str]
    ack: bool = True


def dead_letter_fields(dead: DeadLetter, consumer: str, dead_at_ms: int) -> dict[str, str]:
    """The dead-letter stream entry of ``dead``, dead-lettered by ``consumer`` at ``dead_at_ms`` (Unix ms)."""
    return {
        "stream_id": dead.stream_id,
        "reason": dead.reason,
        "consumer": consumer,
        "dead_at_ms": str(int(dead_at_ms)),
        "entry": json.dumps(dead.fields, separators=(",", ":")),
    }


__all__ = [
    "FIELDS",
    "OPTIONAL_RESULT_FIELDS",
    "ORIGIN_FIELD",
    "RESULT_FIELDS",
    "ROUTE_FIELDS",
    "DeadLetter",
    "MalformedEntry",
    "StreamEntry",
    "dead_letter_fields",
    "decode_result",
    "encode_result",
    "entry_fields",
    "parse_entry",
]
