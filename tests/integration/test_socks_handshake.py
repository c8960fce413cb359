"""The engine's own SOCKS4/SOCKS5 handshake (an http judge) against scripted proxies on loopback.

Each scripted proxy reads the handshake bytes the engine sends, checks them and answers with the bytes the
case gives, fragmented or not; a granted connection is then answered with the judge's HTTP response by the
proxy itself. Real SOCKS servers (pproxy, the lab's echo stand-in) are covered in test_engine.py.
"""

from __future__ import annotations

import asyncio

import pytest

from magpie.checker import CheckEngine
from magpie.base.routes import Route

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


async def _serve(script, got: list[bytes]):
    """A proxy on 127.0.0.1 that follows ``script``: a list of ``(expect_len, reply)``; each step reads
    exactly ``expect_len`` bytes (kept in ``got``), then writes ``reply`` one byte at a time when it
    starts with b"~" (fragmented), else whole; b"!" hangs up."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for expect, reply in script:
                if expect:
                    got.append(await reader.readexactly(expect))
                if reply == b"!":  # hang up
                    return
                if reply.startswith(b"~"):
                    for b in reply[1:]:
                        writer.write(bytes([b]))
                        await writer.drain()
                        await asyncio.sleep(0)
                elif reply:
                    writer.write(reply)
            await writer.drain()
            while await reader.read(4096):  # hold until the client closes
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _check(protocol: str, script, user=None, password=None, judge="http://judge.example:8080/"):
    got: list[bytes] = []

    async def go():
        server = await _serve(script, got)
        port = server.sockets[0].getsockname()[1]
        eng = CheckEngine(judge, timeout=2.0, attempts=1, rule="status", own_addresses={"127.0.0.1"})
        eng._judge_ip = "127.0.0.9"  # SOCKS4 carries an address: no resolution of the example name
        eng._judge_ip_at = 1e18
        try:
            return await eng.check(Route(protocol, "127.0.0.1", port, user, password))
        finally:
            server.close()

    return asyncio.run(go()), got


SOCKS5_GRANT = b"\x05\x00\x00\x01\x7f\x00\x00\x01\x1f\x90"
CONNECT_NAME = b"\x05\x01\x00\x03\x0djudge.example\x1f\x90"


def test_socks5_without_credentials_names_the_judge_and_is_alive():
    res, got = _check("socks5", [(3, b"\x05\x00"), (len(CONNECT_NAME), SOCKS5_GRANT + OK)])
    assert got == [b"\x05\x01\x00", CONNECT_NAME]
    assert (res.alive, res.status, res.error) == (True, 200, None)
    assert res.handshake_ms is not None and res.connect_ms is not None


def test_socks5_with_credentials_authenticates_then_connects_through_fragmented_replies():
    auth = b"\x01\x04user\x06secret"
    res, got = _check("socks5", [(4, b"~\x05\x02"), (len(auth), b"~\x01\x00"),
                                 (len(CONNECT_NAME), b"~" + SOCKS5_GRANT), (0, OK)], "user", "secret")
    assert got == [b"\x05\x02\x00\x02", auth, CONNECT_NAME]
    assert res.alive, res


def test_socks5_grant_with_a_domain_bound_address_is_read_whole():
    grant = b"\x05\x00\x00\x03\x04host\x00\x50"
    res, _ = _check("socks5", [(3, b"\x05\x00"), (len(CONNECT_NAME), grant + OK)])
    assert res.alive, res


@pytest.mark.parametrize("script", [
    [(3, b"\x05\xff")],  # no acceptable method
    [(4, b"\x05\x02"), (13, b"\x01\x01")],  # password refused
    [(3, b"\x05\x00"), (len(CONNECT_NAME), b"\x05\x05\x00\x01\x00\x00\x00\x00\x00\x00")],  # refused
    [(3, b"\x04\x5a")],  # a SOCKS4 answer to a SOCKS5 greeting
    [(3, b"\x05\x00"), (len(CONNECT_NAME), b"\x05\x00\x00\x09")],  # unknown address type
    [(3, b"!")],  # hangs up during the handshake
], ids=["no-method", "bad-password", "connect-refused", "wrong-version", "bad-atyp", "hang-up"])
def test_socks5_refusals_are_socks_errors_and_not_final(script):
    user = ("user", "secret") if len(script) > 1 and script[1][0] == 13 else (None, None)
    res, _ = _check("socks5", script, *user)
    assert (res.alive, res.error, res.attempts) == (False, "SOCKSError", 1), res


def test_socks5_server_asking_for_a_password_the_route_lacks_is_refused():
    res, _ = _check("socks5", [(3, b"\x05\x02")])
    assert (res.alive, res.error) == (False, "SOCKSError")


def test_socks4_sends_the_judge_address_and_user_id():
    request = b"\x04\x01\x1f\x90\x7f\x00\x00\x09user\x00"
    res, got = _check("socks4", [(len(request), b"\x00\x5a\x00\x00\x00\x00\x00\x00" + OK)], "user")
    assert got == [request]
    assert res.alive, res


def test_socks4_rejection_is_a_socks_error():
    request = b"\x04\x01\x1f\x90\x7f\x00\x00\x09\x00"
    res, _ = _check("socks4", [(len(request), b"\x00\x5b\x00\x00\x00\x00\x00\x00")])
    assert (res.alive, res.error) == (False, "SOCKSError")


def test_a_hang_up_mid_answer_through_socks5_is_a_connection_error():
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"
    res, _ = _check("socks5", [(3, b"\x05\x00"), (len(CONNECT_NAME), SOCKS5_GRANT + cut), (0, b"!")])
    assert (res.alive, res.error) == (False, "ConnectionError"), res


def test_connect_deadline_is_a_connect_timeout_and_an_outside_cancel_still_cancels():
    """The bare attempt's one timer: before the connection stands it cancels the attempt (ConnectTimeout,
    here while a host name resolves forever); a cancellation from outside (a lost lease) propagates."""

    async def never(host, port):
        await asyncio.sleep(3600)

    async def go():
        eng = CheckEngine("http://127.0.0.1:9/", timeout=2.0, attempts=2, connect_timeout=0.2,
                          own_addresses={"127.0.0.1"}, resolver=never)
        t0 = asyncio.get_running_loop().time()
        res = await eng.check(Route("socks5", "proxy.example", 1080))
        took = asyncio.get_running_loop().time() - t0
        task = asyncio.ensure_future(eng.check(Route("http", "proxy.example", 8080)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return res, took

    res, took = asyncio.run(go())
    assert (res.alive, res.error, res.attempts) == (False, "ConnectTimeout", 2)
    assert 0.35 <= took < 1.5, took


def test_a_proxy_that_never_answers_expires_at_the_deadline_and_a_cancel_stops_it():
    async def go():
        got: list[bytes] = []
        server = await _serve([(3, b"\x05\x00")], got)  # grants the method, never answers the CONNECT
        port = server.sockets[0].getsockname()[1]
        eng = CheckEngine("http://127.0.0.9:8080/", timeout=0.3, attempts=1, own_addresses={"127.0.0.1"})
        try:
            res = await eng.check(Route("socks5", "127.0.0.1", port))
            task = asyncio.ensure_future(eng.check(Route("socks5", "127.0.0.1", port)))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return res
        finally:
            server.close()

    res = asyncio.run(go())
    assert (res.alive, res.error) == (False, "ReadTimeout")
    assert res.connect_ms is not None and res.handshake_ms is None
