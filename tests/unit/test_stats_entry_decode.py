"""The consumer's decoding of stream replies and the values a parsed entry derives once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from magpie.checker.anonymity import normalize_ip
from magpie.queue.streams import ledger_id, text
from magpie.stats.consumer import _decode_fields
from magpie.stats.entry import MalformedEntry, encode_result, parse_entry

T0 = 1_700_000_000_000


def _fields(**kw) -> dict[str, str]:
    base = dict(route_id=7, route_hash="ab" * 12, alive=True, checked_at_ms=T0, latency_ms=12.5, status=200,
                judge="http://127.0.0.1:8899/")
    base.update(kw)
    return encode_result(**base)


@pytest.mark.parametrize("raw", [
    {b"route_id": b"7", b"body": "ünï ✓".encode()},
    {b"bad": b"\xff\xfe ok \xc3", b"\xc3(": b"x"},  # not UTF-8: replaced, as redis text() does
    {"route_id": "7", "body": "already text"},  # a client decoding replies itself
    {b"mixed": "text", "other": b"bytes"},
    {b"nul": b"a\x00b"},
])
def test_decoded_fields_are_what_text_gives_field_by_field(raw):
    assert _decode_fields(raw) == {text(k): text(v) for k, v in raw.items()}


@pytest.mark.parametrize("raw", [None, {}])
def test_a_deleted_entry_decodes_as_no_fields(raw):
    assert _decode_fields(raw) == {}


def test_checked_at_follows_the_result():
    e = parse_entry(f"{T0}-0", _fields())
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert e.checked_at == epoch + timedelta(milliseconds=T0)
    assert e.checked_at is e.checked_at  # computed once
    e.result.checked_at_ms = T0 + 1500
    assert e.checked_at == epoch + timedelta(milliseconds=T0 + 1500)
    assert e.order == (e.checked_at, T0, 0)


def test_ledger_id_follows_the_ids_and_the_space():
    e = parse_entry(f"{T0}-3", _fields())
    assert e.ledger_id == f"{T0}-3"
    e.space = 2
    assert e.ledger_id == ledger_id(f"{T0}-3", 2)
    e.origin_id = f"{T0 - 5}-1"
    assert e.ledger_id == ledger_id(f"{T0 - 5}-1", 2)
    e.origin_id, e.space = None, 0
    e.stream_id = f"{T0}-9"
    assert e.ledger_id == f"{T0}-9"


def test_derived_values_do_not_take_part_in_equality_or_repr():
    a = parse_entry(f"{T0}-0", _fields())
    b = parse_entry(f"{T0}-0", _fields())
    assert a.ledger_id and a.checked_at  # a's derived values are filled, b's are not
    assert a == b and repr(a) == repr(b) and ", _" not in repr(a)


@pytest.mark.parametrize("raw, want", [
    ("10.1.2.3", "10.1.2.3"),
    ("0.0.0.0", "0.0.0.0"),
    ("255.255.255.255", "255.255.255.255"),
    (" 10.1.2.3 ", "10.1.2.3"),
    ("10.1.2.3:8080", "10.1.2.3"),
    ("::ffff:10.1.2.3", "10.1.2.3"),
    ("2001:DB8::1", "2001:db8::1"),
])
def test_exit_addresses_are_stored_in_normal_form(raw, want):
    assert parse_entry(f"{T0}-0", _fields(exit_ip=raw)).result.exit_ip == want


@pytest.mark.parametrize("raw", ["010.1.2.3", "256.1.2.3", "1.2.3", "1.2.3.4.5", "١.2.3.4", "host"])
def test_malformed_exit_addresses_are_refused(raw):
    with pytest.raises(MalformedEntry, match="exit_ip"):
        parse_entry(f"{T0}-0", _fields(exit_ip=raw))


_octet = st.one_of(st.integers(0, 300).map(str), st.sampled_from(["00", "01", "007", "", "0x1", "1 ", "٣"]))


@given(st.lists(_octet, min_size=3, max_size=5).map(".".join))
def test_dotted_addresses_read_as_normalize_ip_reads_them(raw):
    try:
        got = parse_entry(f"{T0}-0", _fields(exit_ip=raw)).result.exit_ip
    except MalformedEntry:
        got = None
    assert got == (normalize_ip(raw.strip()) if raw.strip() else None)
