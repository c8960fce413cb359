"""The egress guard, table-driven: every non-public range is refused, allowed networks come back."""

from __future__ import annotations

import pytest

from magpie.base.egress import EgressPolicy, EgressRefused, parse_allow

REFUSED = [
    ("127.0.0.1", "loopback"), ("127.255.0.9", "loopback"), ("::1", "loopback"),
    ("10.0.0.1", "private"), ("172.16.0.1", "private"), ("172.31.255.254", "private"), ("192.168.1.1", "private"),
    ("100.64.0.1", "CGNAT"), ("100.127.255.254", "CGNAT"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("255.255.255.255", "broadcast"), ("192.0.2.1", "reserved"), ("198.51.100.7", "reserved"),
    ("203.0.113.9", "reserved"), ("240.0.0.1", "reserved"), ("2001:db8::1", "reserved"),
    ("fd00::1", "unique-local"), ("fc00::5", "unique-local"),
    ("::ffff:10.0.0.1", "private IPv4 10.0.0.1"), ("::ffff:169.254.169.254", "link-local IPv4"),
    ("::10.0.0.1", "private IPv4 10.0.0.1"),
    ("2002:a9fe:a9fe::1", "link-local IPv4 169.254.169.254"), ("2002:c0a8:0101::1", "private IPv4 192.168.1.1"),
    ("64:ff9b::a9fe:a9fe", "link-local IPv4 169.254.169.254"), ("64:ff9b:1::a00:1", "private IPv4 10.0.0.1"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "reserved IPv4 192.0.2.45"),
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8", "2002:0808:0808::1", "64:ff9b::808:808"]


@pytest.fixture(autouse=True)
def _rules_alone(monkeypatch):
    """These units test the private-range rules alone: no ``MAGPIE_EGRESS_ONLY`` allow-list on top (the
    process's socket guard stays in place: nothing is dialled)."""
    monkeypatch.delenv("MAGPIE_EGRESS_ONLY", raising=False)


@pytest.mark.parametrize("address,why", REFUSED)
def test_non_public_addresses_are_refused(address, why):
    p = EgressPolicy()
    reason = p.refusal(address)
    assert reason is not None and why in reason, reason
    with pytest.raises(EgressRefused, match="destination refused"):
        p.check_address(address)


@pytest.mark.parametrize("address", ALLOWED)
def test_public_addresses_pass(address):
    assert EgressPolicy().refusal(address) is None


def test_allowed_networks_come_back_but_nothing_else():
    p = EgressPolicy("127.0.0.0/8, ::1")
    assert p.refusal("127.0.0.5") is None and p.refusal("::1") is None
    assert p.refusal("::ffff:127.0.0.5") is None  # the mapped form of an allowed IPv4 address
    assert "private" in p.refusal("10.0.0.1")
    assert "MAGPIE_CHECK_ALLOW_PRIVATE" in p.refusal("10.0.0.1")


def test_allow_all_private_still_refuses_unspecified_and_multicast():
    p = EgressPolicy(True)
    assert p.refusal("10.0.0.1") is None and p.refusal("169.254.169.254") is None
    assert "multicast" in p.refusal("224.0.0.1") and "unspecified" in p.refusal("0.0.0.0")


def test_localhost_names_and_literals_are_refused_without_resolving():
    p = EgressPolicy()
    for host in ("localhost", "LOCALHOST.", "db.localhost", "10.1.2.3", "[fd00::1]"):
        with pytest.raises(EgressRefused):
            p.check_host(host)
    p.check_host("proxy.example.net")  # names are checked after resolution, not here


def test_resolved_addresses_keep_only_allowed_ones():
    p = EgressPolicy()
    assert p.allowed(["10.0.0.1", "8.8.8.8"]) == ["8.8.8.8"]
    with pytest.raises(EgressRefused, match="10.0.0.1 is private"):
        p.allowed(["10.0.0.1", "192.168.0.1"])


@pytest.mark.parametrize("text,expect", [
    ("", (False, 0)), ("false", (False, 0)), ("true", (True, 0)), ("127.0.0.0/8,::1", (False, 2)),
])
def test_parse_allow(text, expect):
    allow_all, nets = parse_allow(text)
    assert (allow_all, len(nets)) == expect


def test_parse_allow_names_a_bad_entry():
    with pytest.raises(ValueError, match="'nonsense'"):
        parse_allow("127.0.0.0/8,nonsense")
