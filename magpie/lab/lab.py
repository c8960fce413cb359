"""The lab: a judge and a set of real proxies with known behaviour, all on loopback.

Layout for ``base_port`` B (proxy *i* listens on ``127.0.0.(2+i):B+i`` and dials out from
``127.0.0.(102+i)``)::

    i  name               server                       listed as                         expect
    0  http-elite         pproxy http                  http://127.0.0.2:B                alive, elite
    1  socks4-elite       pproxy socks4                socks4://127.0.0.3:B+1            alive, elite
    2  socks5-elite       pproxy socks5                socks5://127.0.0.4:B+2            alive, elite
    3  socks5-auth        pproxy socks5, user/pass     socks5://magpie:p%40ss%3Aw0rd@…   alive, elite
    4  http-transparent   forward proxy, XFF + Via     http://127.0.0.6:B+4              alive, transparent
    5  http-anonymous     forward proxy, Via only      http://127.0.0.7:B+5              alive, anonymous
    6  http-slow          forward proxy, delay         http://127.0.0.8:B+6              alive, elite (slow)
    7  dead               nothing listens              http://127.0.0.9:B+7              dead

The judge listens on ``127.0.0.1:judge_port`` (default 8899, the default ``MAGPIE_JUDGE_URL``).

Why distinct outbound addresses: a judge sees every loopback client as 127.0.0.1 unless the proxy dials
out from another loopback address. The checker reaches the judge directly from 127.0.0.1, so if the
proxies also dialed from 127.0.0.1 every proxy would look transparent. pproxy gets a local bind after its
listen URI's path (``socks5://127.0.0.4:B/@127.0.0.104``); the forward proxy binds its outbound sockets.

The dead port is held bound (but not listening) by the lab, so nothing else can take it and connections
to it are refused. All servers run in this process on one event loop (uvloop) in a background thread:
pproxy, the forward proxies and the judge (:class:`magpie.checker.judge.JudgeProtocol`); nothing survives
the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from magpie.checker.check import new_event_loop
from magpie.checker.judge import server_url, start_judge
from magpie.lab.forward import ForwardProxy, is_loopback_host
from magpie.lab.net import LabError, bindable, wait_accepting
from magpie.base.routes import Route

DEFAULT_BASE_PORT = 18080
DEFAULT_JUDGE_PORT = 8899
JUDGE_HOST = "127.0.0.1"
LAB_USER = "magpie"
LAB_PASSWORD = "p@ss:w0rd"  # needs percent-encoding in a URL: proves encoding end to end
PROXY_COUNT = 8
START_TIMEOUT = 10.0  # seconds start() waits for every listener

# proxies served by the lab's own forward proxy (header policy); all others are pproxy
_FORWARD_POLICIES: dict[str, dict[str, bool]] = {
    "http-transparent": {"forwarded_for": True, "via": True},
    "http-anonymous": {"via": True},
    "http-slow": {},
}


@dataclass(frozen=True, slots=True)
class LabProxy:
    """One lab proxy and what a correct checker must report for it.

    Attributes:
        name: short label, e.g. ``"http-elite"``.
        route: the route as listed (credentials included).
        expect_alive: whether a check must find it alive.
        expect_anonymity: expected level, None for the dead one.
        egress: loopback address its outbound connections come from (None: no server).
        delay: seconds it waits before dialing out.
    """

    name: str
    route: Route
    expect_alive: bool
    expect_anonymity: str | None
    egress: str | None = None
    delay: float = 0.0


def listen_host(i: int) -> str:
    """Listening address of lab proxy ``i`` (0-based)."""
    return f"127.0.0.{2 + i}"


def egress_host(i: int) -> str:
    """Outbound (source) address of lab proxy ``i``."""
    return f"127.0.0.{102 + i}"


def find_free_base_port(lo: int = 20000, hi: int = 40000, tries: int = 200) -> int:
    """A base port B in ``[lo, hi)`` such that every lab address ``127.0.0.(2+i):B+i`` can be bound now.

    Racy by nature (someone may bind in between); callers retry :meth:`Lab.start` on :class:`LabError`.
    Raises ``RuntimeError`` when no block is found within ``tries``.
    """
    for _ in range(tries):
        base = random.randrange(lo, hi - PROXY_COUNT)
        if all(bindable(listen_host(i), base + i) for i in range(PROXY_COUNT)):
            return base
    raise RuntimeError(f"no free block of {PROXY_COUNT} ports in [{lo}, {hi})")


class Lab:
    """A judge plus eight proxies on loopback (see the module doc for the layout). A context manager.

    Args:
        base_port: proxy ``i`` listens on ``base_port + i`` (i = 0..7).
        judge_port: the judge's port on 127.0.0.1; None means 8899, 0 lets the OS pick (see
            :attr:`judge_url` after :meth:`start`).
        slow_delay: seconds the slow proxy waits before dialing out (keep it below the check timeout).
    """

    def __init__(
        self, base_port: int = DEFAULT_BASE_PORT, judge_port: int | None = None, slow_delay: float = 3.0
    ) -> None:
        if not 1 <= base_port <= 65535 - PROXY_COUNT:
            raise ValueError(f"base_port out of range: {base_port}")
        self.base_port = base_port
        self.judge_port = DEFAULT_JUDGE_PORT if judge_port is None else judge_port
        self.slow_delay = float(slow_delay)
        self.proxies: list[LabProxy] = self._plan()
        self._judge: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._dead_sock: socket.socket | None = None

    # -- layout -------------------------------------------------------------------------------------

    def _plan(self) -> list[LabProxy]:
        b = self.base_port
        r = lambda i, proto, **kw: Route(proto, listen_host(i), b + i, **kw)  # noqa: E731
        e = egress_host
        return [
            LabProxy("http-elite", r(0, "http"), True, "elite", e(0)),
            LabProxy("socks4-elite", r(1, "socks4"), True, "elite", e(1)),
            LabProxy("socks5-elite", r(2, "socks5"), True, "elite", e(2)),
            LabProxy(
                "socks5-auth", r(3, "socks5", username=LAB_USER, password=LAB_PASSWORD), True, "elite", e(3)
            ),
            LabProxy("http-transparent", r(4, "http"), True, "transparent", e(4)),
            LabProxy("http-anonymous", r(5, "http"), True, "anonymous", e(5)),
            LabProxy("http-slow", r(6, "http"), True, "elite", e(6), self.slow_delay),
            LabProxy("dead", r(7, "http"), False, None, None),
        ]

    def proxy(self, name: str) -> LabProxy:
        """The lab proxy called ``name``; raises ``KeyError``."""
        for p in self.proxies:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def judge_url(self) -> str:
        """``http://127.0.0.1:<port>/``; with ``judge_port=0`` the real port is known only after start()."""
        if self._judge is not None:
            return server_url(self._judge)
        return f"http://{JUDGE_HOST}:{self.judge_port}/"

    def proxy_list_text(self) -> str:
        """The proxy list: a ``# magpie lab`` comment, then one ``scheme://[user:pass@]host:port`` a line."""
        lines = [f"# magpie lab: {len(self.proxies)} proxies, judge {self.judge_url}"]
        lines += [p.route.url() for p in self.proxies]
        return "\n".join(lines) + "\n"

    def write_list(self, path: str | Path) -> None:
        """Write :meth:`proxy_list_text` to ``path`` (UTF-8)."""
        Path(path).write_text(self.proxy_list_text(), encoding="utf-8")

    # -- lifecycle ------------------------------------------------------------------------------------

    def _pproxy_uri(self, p: LabProxy) -> str:
        uri = f"{p.route.protocol}://{p.route.host}:{p.route.port}/@{p.egress}"
        if p.route.username is not None:
            uri += f"#{p.route.username}:{p.route.password}"
        return uri

    async def _start_one(self, p: LabProxy) -> asyncio.base_events.Server:
        policy = _FORWARD_POLICIES.get(p.name)
        if policy is None:
            import pproxy

            server = pproxy.Server(self._pproxy_uri(p))
            # authtime=-1: pproxy otherwise trusts an address for 30 days after one good login, so a
            # later check with wrong credentials from 127.0.0.1 would still pass.
            args = {"rserver": [], "authtime": -1, "block": lambda host: not is_loopback_host(host)}
            return await server.start_server(args)
        return await ForwardProxy(egress=p.egress, delay=p.delay, **policy).start(p.route.host, p.route.port)

    def start(self) -> None:
        """Start the judge and every proxy; return once all accept connections.

        Raises :class:`LabError` naming the address when a port is taken or a listener does not come up
        (everything already started is stopped again) or when pproxy (the ``lab`` extra) is not installed,
        ``RuntimeError`` when already started.
        """
        if self._loop is not None or self._judge is not None:
            raise RuntimeError("lab already started")
        try:
            import pproxy  # noqa: F401 - an optional extra: the lab is a development tool
        except ImportError:
            raise LabError("the lab needs pproxy: pip install 'magpie[lab]'") from None
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        dead = self.proxies[-1]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((dead.route.host, dead.route.port))  # held, never listening: connections are refused
        except OSError as exc:
            sock.close()
            raise LabError(f"dead port {dead.route.hostport} is in use: {exc}") from None
        self._dead_sock = sock

        self._loop = new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="magpie-lab-proxies", daemon=True
        )
        self._loop_thread.start()
        fut = asyncio.run_coroutine_threadsafe(start_judge(JUDGE_HOST, self.judge_port), self._loop)
        try:
            self._judge = fut.result(START_TIMEOUT)
        except OSError as exc:
            raise LabError(f"judge port {JUDGE_HOST}:{self.judge_port} is not available: {exc}") from None
        for p in self.proxies[:-1]:
            fut = asyncio.run_coroutine_threadsafe(self._start_one(p), self._loop)
            try:
                self._servers.append(fut.result(START_TIMEOUT))
            except OSError as exc:
                raise LabError(f"{p.name} port {p.route.hostport} is not available: {exc}") from None

        addrs = [("judge", JUDGE_HOST, self._judge.sockets[0].getsockname()[1])]
        addrs += [(p.name, p.route.host, p.route.port) for p in self.proxies if p.expect_alive]
        wait_accepting(addrs, START_TIMEOUT)

    async def _shutdown(self) -> None:
        if self._judge is not None:
            self._judge.close()
        for s in self._servers:
            s.close()
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    def stop(self) -> None:
        """Stop every server and release every port. Idempotent; never raises for a half-started lab."""
        loop, thread = self._loop, self._loop_thread
        if loop is not None and thread is not None:
            if thread.is_alive():
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(5.0)
                loop.call_soon_threadsafe(loop.stop)
                thread.join(5.0)
            if not thread.is_alive():
                loop.close()
        self._loop = self._loop_thread = None
        self._servers = []
        if self._judge is not None:
            with contextlib.suppress(Exception):
                self._judge.close()  # idempotent; the loop's shutdown already closed it
        self._judge = None
        if self._dead_sock is not None:
            self._dead_sock.close()
            self._dead_sock = None

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_free_lab(slow_delay: float = 1.0, tries: int = 5) -> Lab:
    """Start a lab on a free port block (:func:`find_free_base_port`) with an OS-chosen judge port.

    For tests: retries up to ``tries`` times when a port is taken in between; the caller stops the lab.
    Raises the last :class:`LabError` when every try fails.
    """
    last: LabError | None = None
    for _ in range(tries):
        lab = Lab(find_free_base_port(), judge_port=0, slow_delay=slow_delay)
        try:
            lab.start()
            return lab
        except LabError as exc:
            last = exc
    assert last is not None
    raise last
