"""Deny-by-default egress (``MAGPIE_EGRESS_ONLY``): nothing outside the allow-list is ever dialled.

The suite runs with ``MAGPIE_EGRESS_ONLY=127.0.0.0/8,::1`` (``tests/conftest.py``). 192.0.2.1 (TEST-NET-1)
appears here only where the guard refuses before any dial; each test also asserts that the process-wide
socket guard saw no attempt, i.e. the explicit check stopped it first and no packet left.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from magpie.base import egress
from magpie.base.egress import EgressBlocked, EgressPolicy, EgressRefused

OUTSIDE = "192.0.2.1"


@pytest.fixture
def no_dial():
    """Assert that the socket guard stopped no dial during the test (the explicit guard refused first)."""
    before = len(egress.blocked_dials())
    yield
    assert egress.blocked_dials()[before:] == []


def test_the_suite_runs_with_loopback_only():
    assert os.environ["MAGPIE_EGRESS_ONLY"] == "127.0.0.0/8,::1"
    assert egress.egress_only_refusal("127.0.0.9") is None and egress.egress_only_refusal("::1") is None
    assert egress.egress_only_refusal("::ffff:127.0.0.1") is None


def test_a_policy_that_allows_every_range_still_refuses_outside_the_allow_list(no_dial):
    p = EgressPolicy(True, "MAGPIE_CHECK_ALLOW_PRIVATE")
    assert p.refusal("10.0.0.1") == "10.0.0.1 is outside MAGPIE_EGRESS_ONLY (127.0.0.0/8,::1)"
    with pytest.raises(EgressRefused, match=f"{OUTSIDE} is outside MAGPIE_EGRESS_ONLY"):
        p.check_address(OUTSIDE)
    with pytest.raises(EgressRefused, match="8.8.8.8 is outside MAGPIE_EGRESS_ONLY"):
        p.allowed(["8.8.8.8", "2606:4700::1111"])
    assert p.allowed(["8.8.8.8", "127.0.0.1"]) == ["127.0.0.1"]


def test_unset_means_no_allow_list(monkeypatch):
    monkeypatch.delenv("MAGPIE_EGRESS_ONLY")
    assert egress.egress_only_refusal(OUTSIDE) is None
    assert egress.egress_only_policy() is None
    assert EgressPolicy(True).refusal("8.8.8.8") is None


def test_a_malformed_value_allows_nothing(monkeypatch):
    monkeypatch.setenv("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,bogus")
    assert "malformed" in egress.egress_only_refusal("127.0.0.1")
    with pytest.raises(ValueError, match="'bogus'"):
        egress.parse_egress_only("127.0.0.0/8,bogus")
    with pytest.raises(ValueError, match="MAGPIE_EGRESS_ONLY takes CIDRs"):
        egress.parse_egress_only("true")


def test_a_bad_setting_fails_at_start_naming_the_variable(monkeypatch):
    from magpie.config import ConfigError, load_settings

    monkeypatch.setenv("MAGPIE_EGRESS_ONLY", "10.0.0.0/33")
    with pytest.raises(ConfigError, match="MAGPIE_EGRESS_ONLY"):
        load_settings()


def test_the_socket_guard_refuses_a_raw_connect_before_it_leaves():
    before = len(egress.blocked_dials())
    with pytest.raises(EgressBlocked, match=f"{OUTSIDE} is outside MAGPIE_EGRESS_ONLY"):
        socket.create_connection((OUTSIDE, 9), timeout=1)
    assert egress.blocked_dials()[before:] == [("socket.connect", (OUTSIDE, 9))]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, pytest.raises(OSError):
        s.sendto(b"x", (OUTSIDE, 9))  # an OSError too: callers that handle a failed dial handle this


def test_a_subprocess_inherits_the_guard():
    code = ("import socket, magpie\n"
            "try:\n    socket.create_connection(('192.0.2.1', 9), timeout=1)\n"
            "except OSError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=os.environ)
    assert out.returncode == 0, out.stderr
    assert "192.0.2.1 is outside MAGPIE_EGRESS_ONLY" in out.stdout


def test_a_check_to_an_outside_proxy_is_refused(no_dial):
    from magpie.checker.engine import CheckEngine
    from magpie.base.routes import Route

    async def run():
        for guard in (EgressPolicy(True), None):  # allowing every range, or no policy of its own
            engine = CheckEngine("http://127.0.0.1:9/", timeout=2, attempts=2, egress=guard)
            result = await engine.check(Route(protocol="socks5", host=OUTSIDE, port=1080))
            assert not result.alive and result.error == "EgressRefused" and result.attempts == 1

    asyncio.run(run())


def test_an_outside_webhook_is_refused(no_dial):
    from magpie.alerts.webhook import WebhookRefused, post

    with pytest.raises(WebhookRefused, match=f"{OUTSIDE} is outside MAGPIE_EGRESS_ONLY"):
        post(f"http://{OUTSIDE}/hook", b"{}", {}, timeout=2, allow_private=True)


def test_an_outside_blacklist_fetch_is_refused(settings, no_dial):
    from magpie.blacklists.sources import SourceError, read_source

    s = settings.model_copy(update={"enrich_allow_private": "true"})
    with pytest.raises(SourceError, match=f"{OUTSIDE} is outside MAGPIE_EGRESS_ONLY"):
        read_source(f"http://{OUTSIDE}/drop.txt", s)


def test_an_outside_smtp_server_is_refused(settings, no_dial):
    from email.message import EmailMessage

    from magpie.outbox.smtp import TemporarySmtpError, send_message

    s = settings.model_copy(update={"smtp_host": OUTSIDE})
    msg = EmailMessage()
    msg["To"], msg["From"], msg["Subject"] = "ops@example.net", "magpie@localhost", "x"
    with pytest.raises(TemporarySmtpError, match=f"{OUTSIDE} is outside MAGPIE_EGRESS_ONLY"):
        send_message(msg, s)


def test_an_outside_rotator_upstream_is_refused(no_dial, caplog):
    from magpie.rotator.listener import Listener, ListenerSpec
    from magpie.rotator.pool import RoutePool, Upstream

    async def run():
        spec = ListenerSpec(rotator_id=1, name="r1", port=0, listen=frozenset({"http", "socks5"}),
                            username=None, password=None, policy="next", sticky_seconds=0, revision=1,
                            workspace_id=1, filters={})
        pool = RoutePool([Upstream(route_id=7, protocol="socks5", host=OUTSIDE, port=1080)])
        lis = Listener(spec, pool, tries=1, connect_timeout=2, upstream_egress=EgressPolicy(True))
        assert await lis._open("127.0.0.1", 80, "127.0.0.1") is None
        assert lis.stats.upstream_failures == 1 and lis.stats.no_route == 1

    with caplog.at_level("WARNING", logger="magpie.rotator.listener"):
        asyncio.run(run())
    want = f"upstream route 7 not dialled: destination refused: {OUTSIDE} is outside MAGPIE_EGRESS_ONLY"
    assert want in caplog.text


def test_a_value_from_settings_only_reaches_the_guard_and_subprocesses(monkeypatch):
    from magpie.config import load_settings

    monkeypatch.delenv("MAGPIE_EGRESS_ONLY")  # as if it were set in .env only
    s = load_settings(egress_only=" 127.0.0.0/8 ")
    assert s.egress_only == "127.0.0.0/8" and os.environ["MAGPIE_EGRESS_ONLY"] == "127.0.0.0/8"
    assert egress.egress_only_refusal("::1") == "::1 is outside MAGPIE_EGRESS_ONLY (127.0.0.0/8)"


def test_an_outside_route_is_refused_at_import_and_an_outside_judge_when_added(settings, db):
    from magpie.importer.service import egress_refusal
    from magpie.judges.store import add_judge
    from magpie.base.routes import Route

    s = settings.model_copy(update={"check_allow_private": "true"})
    refuse = egress_refusal(s)
    assert refuse(Route("http", OUTSIDE, 8080)) == (
        f"refused by the egress guard: {OUTSIDE} is outside MAGPIE_EGRESS_ONLY (127.0.0.0/8,::1)")
    assert refuse(Route("http", "127.0.0.5", 8080)) is None
    with pytest.raises(EgressRefused, match=f"{OUTSIDE} is outside MAGPIE_EGRESS_ONLY"):
        add_judge(db, f"http://{OUTSIDE}/", egress=EgressPolicy(True))
