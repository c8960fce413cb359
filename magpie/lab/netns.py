"""A small network of Linux network namespaces on this machine, for running magpie across real links.

:class:`Topology` builds, for one run, a "switch" namespace holding a bridge and one namespace per host
(``mgp-<run>-redis``, ``-pg``, ``-proxies``, ``-node1``...), each joined to the bridge by a veth pair whose
host end is called ``eth0`` inside the host's namespace and holds an address of a private /24
(``10.231.<n>.0/24``, ``n`` picked at random among the ones no route of this machine uses). The calling
(root) namespace gets a veth on the bridge too (``.1``), so a harness in it reaches every host directly.
Loopback is up everywhere. Everything it makes is removed by :meth:`Topology.close` (also from an
``atexit`` hook and when :meth:`Topology.build` fails half way): processes it started are killed by PID,
then every namespace (which deletes the veth ends inside it) and the root-side veth.

Links can be cut (the host's bridge port down: silence, as in a partition; or ``ip link set eth0 down``
in the host's namespace; or ``netem loss 100%``), restored, and slowed (``netem delay``; netem needs the
``sch_netem`` kernel module, which some kernels lack).

    topo = Topology(["redis", "pg", "proxies", "node1", "node2"]).build()
    try:
        topo.popen("redis", ["redis-server", "--bind", topo.addr("redis"), ...])
        topo.cut("node2"); topo.restore("node2")
    finally:
        topo.close()

Requires root and ``ip`` (iproute2); ``tc`` and ``sch_netem``
for :meth:`Topology.delay` and ``mode="loss"`` cuts.
Raises :class:`NetnsError` (one line naming the command that failed and its stderr).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence

from magpie.errors import MagpieError

NS_PREFIX = "mgp-"
"""Every namespace this module makes is named ``mgp-<run>-<host>``."""


class NetnsError(MagpieError, RuntimeError):
    """A namespace command failed, or the machine cannot build namespaces (not root, no ``ip``)."""


def available() -> str | None:
    """Why namespaces cannot be built here (a phrase), or None when they can (root and ``ip`` present)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {(p.stderr or p.stdout).strip()[:300]}")
    return p


def _used_subnets() -> set[int]:
    """Third octets of 10.231.x.0/24 networks any route of the root namespace touches now."""
    out = _run("ip", "-4", "route", "show", "table", "all", check=False).stdout
    used = set()
    for word in out.split():
        if word.startswith("10.231."):
            try:
                used.add(int(word.split(".")[2]))
            except (ValueError, IndexError):
                pass
    return used


def our_namespaces() -> list[str]:
    """Names of every namespace on this machine made by this module (any run), from ``ip netns list``."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NS_PREFIX)]


class Topology:
    """Host namespaces joined by one bridge; see the module doc.

    Args:
        hosts: host names (``[a-z0-9]``, at most 8 characters, unique), in address order: the first gets
            ``.2``, the next ``.3``... (``.1`` is the root namespace's end).
        extra_addresses: host name -> additional addresses it holds on ``eth0`` (e.g. the lab's five fault
            servers, one address each), given from ``.100`` upwards in host order.
        subnet: third octet of ``10.231.<subnet>.0/24`` (default: a random one no route here uses).
    Attributes:
        run: the run's random id (6 hex digits); network: the ``IPv4Network``; pids: processes started.
    Raises :class:`NetnsError` for a bad host name or when namespaces cannot be built here.
    """

    def __init__(self, hosts: Sequence[str], extra_addresses: dict[str, int] | None = None,
                 subnet: int | None = None) -> None:
        why = available()
        if why:
            raise NetnsError(why)
        hosts = list(hosts)
        for h in hosts:
            if not (h.isascii() and h.isalnum() and h.islower() or h.isdigit()) or not 1 <= len(h) <= 8:
                raise NetnsError(f"host name must be 1-8 lowercase letters or digits: {h!r}")
        if len(set(hosts)) != len(hosts) or len(hosts) > 90:
            raise NetnsError(f"host names must be unique and at most 90: {hosts}")
        self.hosts = hosts
        self.run = uuid.uuid4().hex[:6]
        if subnet is None:
            free = sorted(set(range(1, 255)) - _used_subnets())
            if not free:
                raise NetnsError("no free 10.231.x.0/24 subnet")
            subnet = random.choice(free)
        self.network = ipaddress.IPv4Network(f"10.231.{subnet}.0/24")
        base = int(self.network.network_address)
        self._addr = {h: str(ipaddress.IPv4Address(base + 2 + i)) for i, h in enumerate(hosts)}
        self._extra: dict[str, list[str]] = {}
        nxt = 100
        for h in hosts:
            k = (extra_addresses or {}).get(h, 0)
            self._extra[h] = [str(ipaddress.IPv4Address(base + nxt + j)) for j in range(k)]
            nxt += k
        if nxt > 254:
            raise NetnsError("too many extra addresses for one /24")
        self.root_addr = str(ipaddress.IPv4Address(base + 1))
        self.switch = f"{NS_PREFIX}{self.run}-sw"
        self.root_link = f"mgp{self.run}h"
        self.pids: list[int] = []
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces created, in order
        self._root_link_made = False
        self._closed = False

    # -- names ----------------------------------------------------------------------------------------

    def ns(self, host: str) -> str:
        """The namespace name of ``host`` (``mgp-<run>-<host>``); KeyError for an unknown host."""
        if host not in self._addr:
            raise KeyError(f"unknown host {host!r}; hosts: {', '.join(self.hosts)}")
        return f"{NS_PREFIX}{self.run}-{host}"

    def addr(self, host: str) -> str:
        """``host``'s address on the bridge (its ``eth0``)."""
        self.ns(host)
        return self._addr[host]

    def extra(self, host: str) -> list[str]:
        """``host``'s additional addresses (see ``extra_addresses``)."""
        self.ns(host)
        return list(self._extra[host])

    @property
    def cidr(self) -> str:
        """The topology's network, e.g. ``10.231.17.0/24``."""
        return str(self.network)

    # -- building -------------------------------------------------------------------------------------

    def build(self) -> Topology:
        """Create the switch namespace and bridge, the root-side link and every host; returns self.
        On failure everything made so far is removed and :class:`NetnsError` raised."""
        atexit.register(self.close)
        try:
            self._add_ns(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            # root namespace end: <root_link> here, its peer on the bridge
            _run("ip", "link", "add", self.root_link, "type", "veth", "peer", "name", "hostp",
                 "netns", self.switch)
            self._root_link_made = True
            _run("ip", "-n", self.switch, "link", "set", "hostp", "master", "br0", "up")
            _run("ip", "addr", "add", f"{self.root_addr}/{self.network.prefixlen}", "dev", self.root_link)
            _run("ip", "link", "set", self.root_link, "up")
            for i, h in enumerate(self.hosts):
                self._add_host(i, h)
            return self
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _add_host(self, i: int, host: str) -> None:
        ns = self.ns(host)
        self._add_ns(ns)
        tmp = f"mgp{self.run}{i:02d}"  # made in the host namespace directly, renamed there
        _run("ip", "-n", ns, "link", "add", tmp, "type", "veth", "peer", "name", f"p{i:02d}",
             "netns", self.switch)
        _run("ip", "-n", ns, "link", "set", tmp, "name", "eth0")
        _run("ip", "-n", self.switch, "link", "set", f"p{i:02d}", "master", "br0", "up")
        for a in [self._addr[host], *self._extra[host]]:
            _run("ip", "-n", ns, "addr", "add", f"{a}/{self.network.prefixlen}", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")

    # -- processes ------------------------------------------------------------------------------------

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside ``host``'s namespace (``ip netns exec <ns>``: the process keeps
        the PID of the ``ip`` command, which execs it)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def popen(self, host: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in ``host``'s namespace in a session of its own (``subprocess.Popen`` keywords
        pass through); killed by PID on :meth:`close`."""
        kw.setdefault("start_new_session", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(self.argv(host, argv), **kw)
        self.track(p)
        return p

    def track(self, p: subprocess.Popen) -> None:
        """Have :meth:`close` kill process ``p`` (and its session's group) if it is still running then."""
        self._procs.append(p)
        self.pids.append(p.pid)

    def exec(self, host: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a short command in ``host``'s namespace and wait for it; raises NetnsError when it fails."""
        return _run(*self.argv(host, argv), check=check)

    # -- faults ---------------------------------------------------------------------------------------

    def cut(self, host: str, mode: str = "switch") -> None:
        """Cut ``host`` off the network. ``switch`` sets its port on the bridge down: ``eth0`` stays up,
        what it sends vanishes and nothing reaches it, so its peers and its own sockets see silence, as
        across a real partition (TCP waits for its timeouts). ``down`` sets its ``eth0`` down (its sockets
        see the network unreachable at once). ``loss`` drops every packet it sends with ``netem loss
        100%`` (needs the sch_netem kernel module). ValueError for another mode; NetnsError when the
        command fails."""
        ns = self.ns(host)
        if mode == "switch":
            _run("ip", "-n", self.switch, "link", "set", self._port(host), "down")
        elif mode == "down":
            _run("ip", "-n", ns, "link", "set", "eth0", "down")
        elif mode == "loss":
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "netem",
                 "loss", "100%")
        else:
            raise ValueError(f"cut mode must be 'switch', 'down' or 'loss': {mode!r}")

    def restore(self, host: str) -> None:
        """Undo :meth:`cut` and :meth:`delay` on ``host``: its bridge port and ``eth0`` up, no netem qdisc."""
        ns = self.ns(host)
        if shutil.which("tc"):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        _run("ip", "-n", self.switch, "link", "set", self._port(host), "up")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def delay(self, host: str, ms: float, jitter_ms: float = 0.0) -> None:
        """Delay every packet ``host`` sends by ``ms`` milliseconds (``netem delay``, ± ``jitter_ms``).
        Raises NetnsError when tc or the sch_netem kernel module is missing."""
        if ms < 0 or jitter_ms < 0:
            raise ValueError(f"delay and jitter must be >= 0 ms: {ms}, {jitter_ms}")
        args = ["delay", f"{ms:g}ms"] + ([f"{jitter_ms:g}ms"] if jitter_ms else [])
        _run("ip", "netns", "exec", self.ns(host), "tc", "qdisc", "replace", "dev", "eth0", "root",
             "netem", *args)

    def _port(self, host: str) -> str:
        return f"p{self.hosts.index(host):02d}"

    def link_up(self, host: str) -> bool:
        """Whether ``host``'s ``eth0`` is administratively up."""
        out = _run("ip", "-n", self.ns(host), "-o", "link", "show", "eth0").stdout
        flags = out.split("<", 1)[1].split(">", 1)[0].split(",") if "<" in out else []
        return "UP" in flags

    # -- teardown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process started here (its group, SIGKILL after 5 s of SIGTERM), delete every
        namespace and the root-side link. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    try:
                        os.killpg(p.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
        for p in self._procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        for pid in self._ns_pids():  # anything else still inside one of our namespaces
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for name in reversed(self._made):
            _run("ip", "netns", "del", name, check=False)
        if self._root_link_made:
            _run("ip", "link", "del", self.root_link, check=False)  # already gone with its peer, normally
        self._made.clear()
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass

    def _ns_pids(self) -> list[int]:
        """PIDs of processes living in one of this run's namespaces (``ip netns pids``)."""
        out = []
        for name in self._made:
            for word in _run("ip", "netns", "pids", name, check=False).stdout.split():
                if word.isdigit():
                    out.append(int(word))
        return out

    def leftovers(self) -> list[str]:
        """What of this run is still on the machine: namespace names and the root link (empty when clean)."""
        left = [n for n in our_namespaces() if n.startswith(f"{NS_PREFIX}{self.run}-")]
        if _run("ip", "link", "show", self.root_link, check=False).returncode == 0:
            left.append(self.root_link)
        return left

    def __enter__(self) -> Topology:
        return self.build()

    def __exit__(self, *exc) -> None:
        self.close()
