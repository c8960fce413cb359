"""The rotator's destination policy: address rules from the egress guard, allowed ports, names resolved."""

from __future__ import annotations

import asyncio

import pytest

from magpie.base.egress import EgressPolicy
from magpie.base.egress import format_ports, parse_ports
from magpie.rotator.policy import DestinationPolicy, DestinationRefused

NAMES = {"public.test": ["2606:2800:220:1::1", "93.184.216.34"], "mixed.test": ["93.184.216.34", "10.0.0.5"],
         "rebound.test": ["127.0.0.1"], "v6.test": ["2606:4700::1111"]}


async def fake(host, port):
    if host not in NAMES:
        raise OSError("name does not resolve")
    return NAMES[host]


def check(policy, host, port, own=None):
    return asyncio.run(policy.check(host, port, own))


def test_ports_parse_and_normalise():
    assert parse_ports(" 80, 443,8000-8100 ") == ((80, 80), (443, 443), (8000, 8100))
    assert format_ports(parse_ports("443,80-80")) == "443,80"
    for bad in ("", "0", "65536", "80-70", "http", "1-2-3"):
        with pytest.raises(ValueError):
            parse_ports(bad)


def test_destinations_follow_the_egress_rules_and_the_ports(monkeypatch):
    monkeypatch.delenv("MAGPIE_EGRESS_ONLY", raising=False)  # the address rules alone (nothing is dialled)
    p = DestinationPolicy(EgressPolicy(False, "MAGPIE_ROTATOR_ALLOW_PRIVATE"), "80,443", resolver=fake)
    assert check(p, "93.184.216.34", 443) == "93.184.216.34"
    assert check(p, "public.test", 80) == "93.184.216.34"  # an IPv4 address when the name has one
    assert check(p, "v6.test", 443) == "2606:4700::1111"
    for host, port, why in (("127.0.0.1", 443, "loopback"), ("::ffff:127.0.0.1", 443, "loopback"),
                            ("169.254.169.254", 80, "link-local"), ("10.1.2.3", 443, "private"),
                            ("localhost", 443, "loopback"), ("rebound.test", 443, "loopback"),
                            ("mixed.test", 443, "private"), ("nowhere.test", 443, "does not resolve"),
                            ("93.184.216.34", 6379, "port 6379")):
        with pytest.raises(DestinationRefused, match=why):
            check(p, host, port)
    assert check(p, "93.184.216.34", 8080, own=parse_ports("8080")) == "93.184.216.34"
    with pytest.raises(DestinationRefused, match="port 443"):
        check(p, "93.184.216.34", 443, own=parse_ports("8080"))  # a rotator's own list replaces the default
    lab = DestinationPolicy(EgressPolicy("127.0.0.0/8", "MAGPIE_ROTATOR_ALLOW_PRIVATE"), "1-65535", resolver=fake)
    assert check(lab, "rebound.test", 6379) == "127.0.0.1"
    with pytest.raises(DestinationRefused, match="MAGPIE_ROTATOR_ALLOW_PRIVATE"):
        check(lab, "10.0.0.1", 80)
