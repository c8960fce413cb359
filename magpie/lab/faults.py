"""Fault servers for the lab: the ways real published proxies fail, plus a cheap live stand-in, on loopback.

Real proxy lists are mostly dead, and a dead proxy usually costs the checker a whole timeout. These
servers reproduce that locally, cheaply enough that one process can stand in for tens of thousands of
routes (every server accepts any credentials, so :func:`population_lines` can make many distinct routes
through one address).

Layout for ``host_base`` ``127.0.0.H`` and ``base_port`` P (kind *i* listens on ``127.0.0.(H+i):P+i``)::

    i  kind     behaviour                                                   a checker should see
    0  tarpit   accepts, never sends a byte, holds the connection           timeout (read), dead
    1  trickle  reads the request, sends ``HTTP/1.1 200 OK``, then one      total deadline, dead (a
                header byte a second, never ends the headers                per-read timeout never fires)
    2  slow     the echo below, answering after ``slow_delay`` seconds      alive, elite (slow)
    3  echo     lab stand-in that does NOT forward: answers as proxy and    alive, elite
                judge in one hop (see EchoProtocol)
    4  refused  port bound but not listening: connections refused           connection refused, dead

All servers run on one asyncio event loop (uvloop when importable) with the bare ``asyncio.Protocol``
handlers of :mod:`magpie.lab.fault_protocols`: no task and no stream objects per connection.
:class:`FaultLab` runs them in a background thread; :mod:`magpie.lab.population` makes route lists
through them (its functions and the handlers are importable from here too).

The runner ``python -m magpie.lab.faults [--host-base 127.0.0.20] [--base-port P] [--slow-delay S]
[--judge-host H] [--judge-port N]`` (:func:`main`) runs them in a process of their own, prints one JSON
line ``{"tarpit": "127.0.0.20:P", "trickle": "127.0.0.21:P+1", ..., "refused": "...", "pid": N}`` and
serves until SIGINT/SIGTERM (exit status 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import random
import signal
import socket
import sys
import threading
from collections.abc import Callable

from magpie.checker.check import new_event_loop
from magpie.checker.limits import raise_nofile_limit
from magpie.lab.fault_protocols import (  # noqa: F401 (re-exported)
    TRICKLE_HEADER,
    TRICKLE_INTERVAL,
    EchoProtocol,
    TarpitProtocol,
    Trickler,
    TrickleProtocol,
)
from magpie.lab.net import LabError, bindable, wait_accepting
from magpie.lab.population import mix_counts, mix_lines, population_lines  # noqa: F401 (re-exported)

KINDS = ("tarpit", "trickle", "slow", "echo", "refused")
"""Fault server kinds, in layout order (kind ``KINDS[i]`` is at ``host_base + i``, ``base_port + i``)."""

EXPECT_ALIVE = {"tarpit": False, "trickle": False, "slow": True, "echo": True, "refused": False}
"""Whether a check through each kind must find the route alive (``slow``: only if the timeout exceeds
its delay)."""

DEFAULT_HOST_BASE = "127.0.0.20"
DEFAULT_SLOW_DELAY = 2.0  # seconds
BACKLOG = 65535  # the kernel caps it at net.core.somaxconn
START_TIMEOUT = 10.0  # seconds start() waits for every listener


# -- the lab ----------------------------------------------------------------------------------------


def _hosts(host_base: str) -> list[str]:
    """The five listen addresses starting at ``host_base``; raises ValueError unless all are 127/8."""
    try:
        base = ipaddress.IPv4Address(host_base)
    except ValueError:
        raise ValueError(f"host_base must be an IPv4 address: {host_base!r}") from None
    hosts = [base + i for i in range(len(KINDS))]
    if not all(h.is_loopback for h in hosts) or int(hosts[-1]) & 0xFF == 0xFF:
        raise ValueError(f"host_base {host_base} leaves 127.0.0.0/8 (or hits .255) within {len(KINDS)}")
    return [str(h) for h in hosts]


def find_free_fault_port(host_base: str = DEFAULT_HOST_BASE, lo: int = 20000, hi: int = 40000,
                         tries: int = 200) -> int:
    """A base port P in ``[lo, hi)`` such that every fault address ``host_base+i : P+i`` can be bound now.

    Racy by nature; :func:`start_free_fault_lab` retries. Raises ``RuntimeError`` when none is found.
    """
    hosts = _hosts(host_base)
    for _ in range(tries):
        base = random.randrange(lo, hi - len(KINDS))
        if all(bindable(h, base + i) for i, h in enumerate(hosts)):
            return base
    raise RuntimeError(f"no free block of {len(KINDS)} ports in [{lo}, {hi}) on {host_base}+")


class FaultLab:
    """The five fault servers (module doc) on one event loop in a background thread. A context manager.

    Args:
        host_base: first listen address; kind ``KINDS[i]`` listens on ``host_base + i`` (all in 127/8).
        base_port: kind ``KINDS[i]`` listens on port ``base_port + i``; None picks a free block at start().
        slow_delay: seconds the ``slow`` server waits before answering.
        judge_host / judge_port: the judge the echo servers impersonate; echoed as ``Host`` when a
            request has none (answers never depend on the requested URL otherwise).

    Attributes:
        addresses: kind -> ``"host:port"`` (``{}`` until a port is known).
        conns: kind -> set of its live accepted connections (transports); read it via
            :meth:`connections`.
    """

    def __init__(
        self,
        host_base: str = DEFAULT_HOST_BASE,
        base_port: int | None = None,
        slow_delay: float = DEFAULT_SLOW_DELAY,
        judge_host: str = "127.0.0.1",
        judge_port: int = 8899,
    ) -> None:
        self.hosts = _hosts(host_base)
        if base_port is not None and not 1 <= base_port <= 65535 - len(KINDS):
            raise ValueError(f"base_port out of range: {base_port}")
        if slow_delay < 0:
            raise ValueError(f"slow_delay must be >= 0: {slow_delay}")
        self.host_base = host_base
        self.base_port = base_port
        self.slow_delay = float(slow_delay)
        self.judge_host = judge_host
        self.judge_port = judge_port
        self.conns: dict[str, set] = {k: set() for k in KINDS[:-1]}
        self._trickling: dict = {}
        self._trickler: Trickler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._refused_sock: socket.socket | None = None

    @property
    def addresses(self) -> dict[str, str]:
        """Kind -> ``"host:port"`` for every kind in :data:`KINDS` (empty while no base port is known)."""
        if self.base_port is None:
            return {}
        return {k: f"{h}:{self.base_port + i}" for i, (k, h) in enumerate(zip(KINDS, self.hosts))}

    def hostport(self, kind: str) -> tuple[str, int]:
        """``(host, port)`` of ``kind``; raises KeyError for an unknown kind, RuntimeError before a port."""
        if self.base_port is None:
            raise RuntimeError("no base port yet: start() the lab first")
        if kind not in KINDS:
            raise KeyError(kind)
        i = KINDS.index(kind)
        return self.hosts[i], self.base_port + i

    def connections(self) -> dict[str, int]:
        """Kind -> number of accepted connections open now (safe from any thread)."""
        return {k: len(s) for k, s in self.conns.items()}

    def _factory(self, kind: str) -> Callable[[], asyncio.Protocol]:
        conns = self.conns[kind]
        if kind == "tarpit":
            return lambda: TarpitProtocol(conns)
        if kind == "trickle":
            return lambda: TrickleProtocol(conns, self._trickling)
        host, port = self.hostport(kind)
        delay = self.slow_delay if kind == "slow" else 0.0
        judge = f"{self.judge_host}:{self.judge_port}"
        return lambda: EchoProtocol(conns, host, (host, port), delay, judge)

    def start(self) -> None:
        """Raise the soft fd limit, bind ``refused``, start the other four; return once all accept.

        Raises :class:`magpie.lab.LabError` naming the address when a port is taken (everything already
        started is stopped again), ``RuntimeError`` when already started.
        """
        if self._loop is not None:
            raise RuntimeError("fault lab already started")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        raise_nofile_limit()
        if self.base_port is None:
            self.base_port = find_free_fault_port(self.host_base)
        host, port = self.hostport("refused")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))  # held, never listening: connections are refused
        except OSError as exc:
            sock.close()
            raise LabError(f"refused port {host}:{port} is in use: {exc}") from None
        self._refused_sock = sock

        self._loop = loop = new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="magpie-lab-faults", daemon=True)
        self._thread.start()
        for kind in KINDS[:-1]:
            host, port = self.hostport(kind)
            coro = loop.create_server(self._factory(kind), host, port, backlog=BACKLOG)
            try:
                self._servers.append(asyncio.run_coroutine_threadsafe(coro, loop).result(START_TIMEOUT))
            except OSError as exc:
                raise LabError(f"{kind} port {host}:{port} is not available: {exc}") from None
        self._trickler = Trickler(loop, self._trickling, TRICKLE_INTERVAL)
        loop.call_soon_threadsafe(self._trickler.start)
        wait_accepting([(k, *self.hostport(k)) for k in KINDS[:-1]], START_TIMEOUT)

    async def _shutdown(self) -> None:
        if self._trickler is not None:
            self._trickler.stop()
        for s in self._servers:
            s.close()
        for conns in self.conns.values():
            for t in list(conns):
                t.abort()
            conns.clear()
        self._trickling.clear()
        await asyncio.sleep(0)  # let connection_lost callbacks run

    def stop(self) -> None:
        """Close every server and connection, release every port. Idempotent; never raises."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            if thread.is_alive():
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(5.0)
                loop.call_soon_threadsafe(loop.stop)
                thread.join(5.0)
            if not thread.is_alive():
                loop.close()
        self._loop = self._thread = self._trickler = None
        self._servers = []
        if self._refused_sock is not None:
            self._refused_sock.close()
            self._refused_sock = None

    def __enter__(self) -> FaultLab:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_free_fault_lab(host_base: str = DEFAULT_HOST_BASE, slow_delay: float = DEFAULT_SLOW_DELAY,
                         tries: int = 5, **kwargs) -> FaultLab:
    """Start a :class:`FaultLab` on a free port block, retrying up to ``tries`` times when a port is taken
    in between; the caller stops it. ``kwargs`` go to FaultLab. Raises the last LabError."""
    last: LabError | None = None
    for _ in range(tries):
        lab = FaultLab(host_base, None, slow_delay, **kwargs)
        try:
            lab.start()
            return lab
        except LabError as exc:
            last = exc
    assert last is not None
    raise last


# -- runner -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m magpie.lab.faults``: start a FaultLab, print its addresses and pid as one JSON line,
    serve until SIGINT/SIGTERM.

    Returns the process exit status (0 after a clean stop, 1 when it cannot start).
    """
    ap = argparse.ArgumentParser(
        prog="python -m magpie.lab.faults", description="Run the lab's fault servers on loopback."
    )
    ap.add_argument("--host-base", default=DEFAULT_HOST_BASE, help="first listen address (5 used)")
    ap.add_argument("--base-port", type=int, default=None, help="first port (5 used); default: a free block")
    ap.add_argument(
        "--slow-delay", type=float, default=DEFAULT_SLOW_DELAY, help="seconds the slow server waits"
    )
    ap.add_argument("--judge-host", default="127.0.0.1", help="judge host the echo servers impersonate")
    ap.add_argument("--judge-port", type=int, default=8899, help="judge port the echo servers impersonate")
    args = ap.parse_args(argv)

    try:
        lab = FaultLab(args.host_base, args.base_port, args.slow_delay, args.judge_host, args.judge_port)
    except ValueError as exc:
        print(f"magpie lab faults: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            lab.start()
        except (LabError, RuntimeError) as exc:
            print(f"magpie lab faults: {exc}", file=sys.stderr)
            return 1
        print(json.dumps({**lab.addresses, "pid": os.getpid()}), flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        lab.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
