"""Fault servers for the lab: the ways real published proxies fail, plus a cheap live stand-in, on loopback.

Real proxy lists are mostly dead, and a dead proxy usually costs the checker a whole timeout. These
servers reproduce that locally, cheaply enough that one process can stand in for tens of thousands of
routes (every server accepts any credentials, so :func:`population_lines` can make many distinct routes
through one address).

Layout for ``host_base`` ``127.0.0.H`` and ``base_port`` P (kind *i* listens on ``127.0.0.(H+i):P+i``)::

    i  kind     behaviour                                                   a checker should see
    0  tarpit   listens, never accepts: the kernel completes the handshake  timeout (read), dead
                and queues the connection (:mod:`magpie.lab.tarpit`)
    1  trickle  reads the request, sends ``HTTP/1.1 200 OK``, then one      total deadline, dead (a
                header byte a second, never ends the headers                per-read timeout never fires)
    2  slow     the echo below, answering after ``slow_delay`` seconds      alive, elite (slow)
    3  echo     lab stand-in that does NOT forward: answers as proxy and    alive, elite
                judge in one hop (see EchoProtocol)
    4  refused  port bound but not listening: connections refused           connection refused, dead

With ``tarpit_ports`` T > 1 the tarpit also listens on ``127.0.0.H:P+5`` ... ``P+5+T-2``
(:attr:`FaultLab.tarpit_addresses`): a never-accepting listener's queue holds at most
``net.core.somaxconn`` connections, so a lab standing in for many tarpit routes needs several ports
(:mod:`magpie.lab.tarpit` explains the sizing and the reaper that keeps each queue from filling).

All servers run on one event loop (uvloop) in a background thread: the tarpit listeners and their
reaper (:mod:`magpie.lab.tarpit`), the others with the bare ``asyncio.Protocol`` handlers of
:mod:`magpie.lab.fault_protocols` (no task and no stream objects per connection). :mod:`magpie.lab.population`
makes route lists through them (its functions and the handlers are importable from here too).

The runner ``python -m magpie.lab.faults [--host-base 127.0.0.20] [--base-port P] [--slow-delay S]
[--judge-host H] [--judge-port N] [--tarpit-ports T] [--stats-file PATH]`` (:func:`main`) runs them in a
process of their own, prints one JSON line ``{"tarpit": "127.0.0.20:P", "trickle": "127.0.0.21:P+1", ...,
"refused": "...", "tarpits": ["127.0.0.20:P", ...], "pid": N}`` and serves until SIGINT/SIGTERM (exit
status 0). With ``--stats-file`` it rewrites that file every second with ``{"tarpit": <tarpit stats>,
"connections": {kind: n}, "peers": {kind: {client address: n}}}`` (:meth:`FaultLab.tarpit_stats`).
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
import time
from collections.abc import Callable

from magpie.checker.check import new_event_loop
from magpie.checker.limits import raise_nofile_limit
from magpie.lab.fault_protocols import (  # noqa: F401 (re-exported)
    TRICKLE_HEADER,
    TRICKLE_INTERVAL,
    EchoProtocol,
    Trickler,
    TrickleProtocol,
)
from magpie.lab.net import LabError, bindable, wait_accepting
from magpie.lab.population import (  # noqa: F401 (re-exported)
    mix_counts,
    mix_lines,
    population_lines,
    spread_lines,
)
from magpie.lab.tarpit import BACKLOG, Reaper, TarpitListener, tarpit_stats

KINDS = ("tarpit", "trickle", "slow", "echo", "refused")
"""Fault server kinds, in layout order (kind ``KINDS[i]`` is at ``host_base + i``, ``base_port + i``)."""

EXPECT_ALIVE = {"tarpit": False, "trickle": False, "slow": True, "echo": True, "refused": False}
"""Whether a check through each kind must find the route alive (``slow``: only if the timeout exceeds
its delay)."""

DEFAULT_HOST_BASE = "127.0.0.20"
DEFAULT_SLOW_DELAY = 2.0  # seconds
DEFAULT_TARPIT_PORTS = 8  # of the runner: 8 x 4096 queued connections per lab process
START_TIMEOUT = 10.0  # seconds start() waits for every listener


# -- the lab ----------------------------------------------------------------------------------------


def _hosts(host_base: str) -> list[str]:
    """The five listen addresses starting at ``host_base``; raises ValueError unless all are loopback or
    in ``10.231.0.0/16`` (the network of the lab's namespaces, :mod:`magpie.lab.netns`)."""
    try:
        base = ipaddress.IPv4Address(host_base)
    except ValueError:
        raise ValueError(f"host_base must be an IPv4 address: {host_base!r}") from None
    hosts = [base + i for i in range(len(KINDS))]
    private = [ipaddress.IPv4Network(n) for n in ("127.0.0.0/8", "10.231.0.0/16")]
    if not all(any(h in n for n in private) for h in hosts) or int(hosts[-1]) & 0xFF == 0xFF:
        raise ValueError(f"host_base {host_base} leaves 127.0.0.0/8 and 10.231.0.0/16 (or hits .255) "
                         f"within {len(KINDS)}")
    return [str(h) for h in hosts]


class _PeerSet(set):
    """A server's live transports that also counts, per client address, every connection ever added."""

    def __init__(self) -> None:
        super().__init__()
        self.peers: dict[str, int] = {}

    def add(self, transport) -> None:
        peer = (transport.get_extra_info("peername") or ("?",))[0]
        self.peers[peer] = self.peers.get(peer, 0) + 1
        super().add(transport)


def _extra_tarpit_ports(base_port: int, tarpit_ports: int) -> list[int]:
    """Ports of the tarpit's listeners beyond the first: ``base_port + 5`` onwards."""
    return [base_port + len(KINDS) + j for j in range(tarpit_ports - 1)]


def find_free_fault_port(host_base: str = DEFAULT_HOST_BASE, lo: int = 20000, hi: int = 40000,
                         tries: int = 200, tarpit_ports: int = 1) -> int:
    """A base port P in ``[lo, hi)`` such that every fault address ``host_base+i : P+i`` (and the extra
    tarpit ports, module doc) can be bound now.

    Racy by nature; :func:`start_free_fault_lab` retries. Raises ``RuntimeError`` when none is found.
    """
    hosts = _hosts(host_base)
    span = len(KINDS) + max(0, tarpit_ports - 1)
    for _ in range(tries):
        base = random.randrange(lo, hi - span)
        if all(bindable(h, base + i) for i, h in enumerate(hosts)) and all(
                bindable(hosts[0], p) for p in _extra_tarpit_ports(base, tarpit_ports)):
            return base
    raise RuntimeError(f"no free block of {span} ports in [{lo}, {hi}) on {host_base}+")


class FaultLab:
    """The five fault servers (module doc) on one event loop in a background thread. A context manager.

    Args:
        host_base: first listen address; kind ``KINDS[i]`` listens on ``host_base + i`` (loopback or
            10.231/16).
        base_port: kind ``KINDS[i]`` listens on port ``base_port + i``; None picks a free block at start().
        slow_delay: seconds the ``slow`` server waits before answering.
        judge_host / judge_port: the judge the echo servers impersonate; echoed as ``Host`` when a
            request has none (answers never depend on the requested URL otherwise).
        tarpit_ports: listening ports of the tarpit (>= 1; module doc).
        tarpit_backlog: listen backlog of each tarpit port (capped by ``net.core.somaxconn``).

    Attributes:
        addresses: kind -> ``"host:port"`` (``{}`` until a port is known; the tarpit's first port).
        tarpit_addresses: every tarpit port's ``"host:port"``.
        conns: kind -> set of its live accepted connections (transports; not the tarpit, which accepts
            none); read it via :meth:`connections`.
    """

    def __init__(
        self,
        host_base: str = DEFAULT_HOST_BASE,
        base_port: int | None = None,
        slow_delay: float = DEFAULT_SLOW_DELAY,
        judge_host: str = "127.0.0.1",
        judge_port: int = 8899,
        tarpit_ports: int = 1,
        tarpit_backlog: int = BACKLOG,
    ) -> None:
        self.hosts = _hosts(host_base)
        if not 1 <= tarpit_ports <= 1000:
            raise ValueError(f"tarpit_ports must be 1..1000: {tarpit_ports}")
        if tarpit_backlog < 1:
            raise ValueError(f"tarpit_backlog must be >= 1: {tarpit_backlog}")
        span = len(KINDS) + tarpit_ports - 1
        if base_port is not None and not 1 <= base_port <= 65535 - span:
            raise ValueError(f"base_port out of range: {base_port}")
        if slow_delay < 0:
            raise ValueError(f"slow_delay must be >= 0: {slow_delay}")
        self.tarpit_ports = tarpit_ports
        self.tarpit_backlog = tarpit_backlog
        self.host_base = host_base
        self.base_port = base_port
        self.slow_delay = float(slow_delay)
        self.judge_host = judge_host
        self.judge_port = judge_port
        self.conns: dict[str, set] = {k: _PeerSet() for k in KINDS[1:-1]}
        self._trickling: dict = {}
        self._trickler: Trickler | None = None
        self._tarpits: list[TarpitListener] = []
        self._reaper: Reaper | None = None
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

    @property
    def tarpit_addresses(self) -> list[str]:
        """``"host:port"`` of every tarpit port, the first being ``addresses["tarpit"]`` (``[]`` while no
        base port is known)."""
        if self.base_port is None:
            return []
        return [f"{self.hosts[0]}:{p}" for p in (self.base_port, *_extra_tarpit_ports(self.base_port,
                                                                                     self.tarpit_ports))]

    def hostport(self, kind: str) -> tuple[str, int]:
        """``(host, port)`` of ``kind``; raises KeyError for an unknown kind, RuntimeError before a port."""
        if self.base_port is None:
            raise RuntimeError("no base port yet: start() the lab first")
        if kind not in KINDS:
            raise KeyError(kind)
        i = KINDS.index(kind)
        return self.hosts[i], self.base_port + i

    def connections(self) -> dict[str, int]:
        """Kind -> connections held now: for the tarpit, those queued at its listeners (the kernel holds
        them; closed ones stay until reaped); for the others, accepted connections open now (safe from
        any thread)."""
        return {"tarpit": sum(t.queue()[0] for t in self._tarpits),
                **{k: len(s) for k, s in self.conns.items()}}

    def peers(self) -> dict[str, dict[str, int]]:
        """Kind -> client address -> connections accepted from it since start (not the tarpit): across
        network namespaces, what each host sent (:mod:`magpie.lab.netns`)."""
        return {k: dict(s.peers) for k, s in self.conns.items()}

    def tarpit_stats(self) -> dict[str, int]:
        """The tarpit's totals (:func:`magpie.lab.tarpit.tarpit_stats`): ``listeners``, ``queued``,
        ``capacity``, ``peak_queued_share_pct``, ``reaped``, ``reaped_waiting`` (safe from any thread)."""
        return tarpit_stats(list(self._tarpits))

    def _factory(self, kind: str) -> Callable[[], asyncio.Protocol]:
        conns = self.conns[kind]
        if kind == "trickle":
            return lambda: TrickleProtocol(conns, self._trickling)
        host, port = self.hostport(kind)
        delay = self.slow_delay if kind == "slow" else 0.0
        judge = f"{self.judge_host}:{self.judge_port}"
        return lambda: EchoProtocol(conns, host, (host, port), delay, judge)

    def start(self) -> None:
        """Raise the soft fd limit, bind ``refused``, start the other four (the tarpit on every one of its
        ports, with its reaper); return once all accept.

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
            self.base_port = find_free_fault_port(self.host_base, tarpit_ports=self.tarpit_ports)
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
        for address in self.tarpit_addresses:
            host, _, port = address.rpartition(":")
            self._tarpits.append(TarpitListener(host, int(port), self.tarpit_backlog))
        self._reaper = Reaper(loop, self._tarpits)
        loop.call_soon_threadsafe(self._reaper.start)
        for kind in KINDS[1:-1]:
            host, port = self.hostport(kind)
            coro = loop.create_server(self._factory(kind), host, port, backlog=BACKLOG)
            try:
                self._servers.append(asyncio.run_coroutine_threadsafe(coro, loop).result(START_TIMEOUT))
            except OSError as exc:
                raise LabError(f"{kind} port {host}:{port} is not available: {exc}") from None
        self._trickler = Trickler(loop, self._trickling, TRICKLE_INTERVAL)
        loop.call_soon_threadsafe(self._trickler.start)
        wait_accepting([(k, *self.hostport(k)) for k in KINDS[1:-1]], START_TIMEOUT)  # tarpit: listening

    async def _shutdown(self) -> None:
        if self._trickler is not None:
            self._trickler.stop()
        if self._reaper is not None:
            self._reaper.stop()
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
        self._loop = self._thread = self._trickler = self._reaper = None
        self._servers = []
        for t in self._tarpits:
            t.close()
        self._tarpits = []
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


def _write_stats(path: str, lab: FaultLab) -> None:
    """Replace ``path`` (atomically) with ``{"tarpit": lab.tarpit_stats(), "connections": ..., "peers": ...,
    "at": s}``."""
    doc = {"tarpit": lab.tarpit_stats(), "connections": lab.connections(), "peers": lab.peers(),
           "at": time.time()}
    tmp = f"{path}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, path)


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
    ap.add_argument("--tarpit-ports", type=int, default=DEFAULT_TARPIT_PORTS,
                    help=f"listening ports of the tarpit (default {DEFAULT_TARPIT_PORTS})")
    ap.add_argument("--stats-file", default=None,
                    help="rewrite this file every second with the tarpit's stats as JSON")
    args = ap.parse_args(argv)

    try:
        lab = FaultLab(args.host_base, args.base_port, args.slow_delay, args.judge_host, args.judge_port,
                       tarpit_ports=args.tarpit_ports)
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
        print(json.dumps({**lab.addresses, "tarpits": lab.tarpit_addresses, "pid": os.getpid()}), flush=True)
        next_stats = 0.0
        while True:
            if args.stats_file and time.monotonic() >= next_stats:
                _write_stats(args.stats_file, lab)
                next_stats = time.monotonic() + 1.0
            if stop.wait(0.25):
                break
        if args.stats_file:
            _write_stats(args.stats_file, lab)
        return 0
    finally:
        lab.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
