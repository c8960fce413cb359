"""Webhook targets pass the shared egress guard before any connection, table-driven.

No network: names resolve through the module's resolver seam, and the connection pools are replaced by a
stand-in that records the address it would dial (a refused target must never reach it).
"""

from __future__ import annotations

import ipaddress
import socket

import pytest

from magpie.alerts import webhook
from magpie.alerts.webhook import WebhookRefused, check_target, post

REFUSED = [
    ("127.0.0.1", "loopback"),
    ("::1", "loopback"),
    ("10.1.2.3", "private"),
    ("172.16.0.1", "private"),
    ("192.168.1.1", "private"),
    ("100.64.0.1", "shared address space"),
    ("169.254.169.254", "link-local"),
    ("fe80::1", "link-local"),
    ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"),
    ("255.255.255.255", "broadcast"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("240.0.0.1", "reserved"),
    ("192.0.2.1", "reserved"),
    ("198.18.0.1", "reserved"),
    ("fd00::1", "unique-local"),
    ("::ffff:10.0.0.1", "IPv6 form of private IPv4 10.0.0.1"),
    ("::ffff:169.254.169.254", "IPv6 form of link-local IPv4 169.254.169.254"),
    ("::a00:1", "IPv6 form of private IPv4 10.0.0.1"),  # IPv4-compatible
    ("2002:a9fe:a9fe::1", "IPv6 form of link-local IPv4 169.254.169.254"),  # 6to4
    ("2002:7f00:1::", "IPv6 form of loopback IPv4 127.0.0.1"),
    ("64:ff9b::a9fe:a9fe", "IPv6 form of link-local IPv4 169.254.169.254"),  # NAT64
    ("64:ff9b:1::a00:1", "IPv6 form of private IPv4 10.0.0.1"),
    ("2001:0:a9fe:a9fe::", "IPv6 form of link-local IPv4 169.254.169.254"),  # Teredo server
    ("2001:0:4136:e378::80ff:fffe", "IPv6 form of loopback IPv4 127.0.0.1"),  # Teredo client
]
NEVER = {"224.0.0.1", "ff02::1", "0.0.0.0", "::"}  # refused whatever the allow setting


@pytest.fixture(autouse=True)
def _rules_alone(monkeypatch):
    """These units test the private-range rules alone: no ``MAGPIE_EGRESS_ONLY`` allow-list on top (the
    process's socket guard stays in place: nothing is dialled)."""
    monkeypatch.delenv("MAGPIE_EGRESS_ONLY", raising=False)


class Dialled(Exception):
    """Raised by the stand-in pool: the code tried to connect."""


@pytest.fixture
def dial(monkeypatch):
    """Replace every way out (urllib3 pools, socket connects) with a recorder that raises :class:`Dialled`."""
    calls: list[str] = []

    def pool(host, *args, **kwargs):
        calls.append(host)
        raise Dialled(host)

    def connect(*args, **kwargs):
        calls.append(repr(args))
        raise Dialled(args)

    monkeypatch.setattr(webhook.urllib3, "HTTPConnectionPool", pool)
    monkeypatch.setattr(webhook.urllib3, "HTTPSConnectionPool", pool)
    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return calls


def resolver(*addresses):
    def resolve(host, port, **_kw):
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in addresses]
    return resolve


def canon(address: str) -> str:
    return str(ipaddress.ip_address(address))


def literal_url(address: str) -> str:
    return f"http://[{address}]:8080/hook" if ":" in address else f"http://{address}:8080/hook"


@pytest.mark.parametrize("address,why", REFUSED)
@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_literal_target_in_every_refused_range_is_refused_before_connecting(dial, address, why, scheme):
    with pytest.raises(WebhookRefused) as err:
        post(literal_url(address).replace("http", scheme, 1), b"{}", {}, timeout=1, allow_private=False,
             resolve=resolver())
    assert why in str(err.value) and "\n" not in str(err.value)
    if address not in NEVER:
        assert "MAGPIE_WEBHOOK_ALLOW_PRIVATE" in str(err.value)
    assert dial == []


@pytest.mark.parametrize("address,why", REFUSED)
def test_a_name_resolving_into_every_refused_range_is_refused_before_connecting(dial, address, why):
    for addresses in ([address], ["93.184.216.34", address], [address, "93.184.216.34"]):
        with pytest.raises(WebhookRefused, match="'hooks.example.test' resolves to a refused address") as err:
            post("https://hooks.example.test/hook", b"{}", {}, timeout=1, allow_private=False,
                 resolve=resolver(*addresses))
        assert why in str(err.value)
    assert dial == []


def test_localhost_is_refused_before_connecting(dial):
    with pytest.raises(WebhookRefused, match="loopback"):
        post("http://localhost:9/", b"{}", {}, timeout=1, allow_private=False, resolve=resolver("127.0.0.1"))
    assert dial == []


def test_a_public_target_is_dialled_at_the_checked_address(dial):
    """The control: the stand-in does see connections, to the address that passed (no second lookup)."""
    with pytest.raises(Dialled):
        post("https://hooks.example.test/hook", b"{}", {}, timeout=1, allow_private=False,
             resolve=resolver("93.184.216.34"))
    with pytest.raises(Dialled):
        post("http://[2002:5db8:d822::1]/", b"{}", {}, timeout=1, allow_private=False)  # 6to4 of a public v4
    assert dial == ["93.184.216.34", "2002:5db8:d822::1"]


@pytest.mark.parametrize("allow", [True, "true", "1"])
@pytest.mark.parametrize("address,why", REFUSED)
def test_allow_all_lets_private_ranges_through_but_never_multicast_or_unspecified(dial, allow, address, why):
    if address in NEVER:
        with pytest.raises(WebhookRefused):
            check_target(literal_url(address), allow_private=allow)
    else:
        assert check_target(literal_url(address), allow_private=allow).addresses == (canon(address),)


def test_a_cidr_list_allows_exactly_its_networks():
    allow = "10.0.0.0/8, fd00::/8"
    assert check_target("http://10.9.8.7/", allow_private=allow).addresses == ("10.9.8.7",)
    assert check_target("http://[fd00::5]/", allow_private=allow).addresses == ("fd00::5",)
    assert check_target("http://[::ffff:10.0.0.1]/", allow_private=allow).addresses == (canon("::ffff:10.0.0.1"),)
    for url in ("http://192.168.1.1/", "http://127.0.0.1/", "http://[2002:a9fe:a9fe::1]/", "http://[fe80::1]/"):
        with pytest.raises(WebhookRefused, match="MAGPIE_WEBHOOK_ALLOW_PRIVATE"):
            check_target(url, allow_private=allow)


@pytest.mark.parametrize("allow", [False, "false", "", "0"])
def test_allow_none_refuses(allow):
    with pytest.raises(WebhookRefused, match="MAGPIE_WEBHOOK_ALLOW_PRIVATE"):
        check_target("http://10.0.0.1/", allow_private=allow)


def test_a_malformed_allow_list_is_a_refusal_naming_the_setting():
    with pytest.raises(WebhookRefused, match="MAGPIE_WEBHOOK_ALLOW_PRIVATE: not a network"):
        check_target("http://10.0.0.1/", allow_private="10.0.0.0/8,banana")


def test_the_refusal_message_names_neither_the_path_nor_the_query():
    with pytest.raises(WebhookRefused) as err:
        check_target("http://10.0.0.1/hook?token=s3cr3t", allow_private=False)
    assert "s3cr3t" not in str(err.value)
