"""A throwaway Redis Cluster on loopback for tests, benchmarks and the lab: 3 masters + 3 replicas of
``redis-server`` (``--cluster-enabled yes``, no persistence) on free ports, joined with
``redis-cli --cluster create``; every process is stopped by its PID.

Spread over hosts (``hosts=[a, b, c]``, ``wrap``): one master per host, bound to that host's address, and
its replicas on the following hosts (master of host ``i`` -> replica on host ``i+1``, round the list), so
losing one host loses one master, whose replica on another host is promoted; ``wrap(host, argv)`` turns a
command line into the one run on that host (e.g. :meth:`magpie.lab.netns.Topology.argv`), ``track`` is
called with every Popen. :meth:`LocalCluster.master_addr_of` names a slot's master as ``host:port``.

Fault helpers: :meth:`LocalCluster.kill_master_of` (SIGKILL the master of a slot and wait until its
replica is promoted and every live node agrees), :meth:`LocalCluster.migrate_slot` (the standard
``CLUSTER SETSLOT IMPORTING/MIGRATING`` + ``MIGRATE`` + ``SETSLOT NODE`` sequence).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from magpie.errors import MagpieError


class ClusterError(MagpieError, RuntimeError):
    """The local cluster could not be started or did not reach the state asked for in time."""


def free_port_pair(start: int = 21000, end: int = 45000) -> int:
    """A loopback port P such that P and its cluster bus port P+10000 are both free (best effort)."""
    import random

    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(500):
        p = rng.randrange(start, end)
        ok = True
        for q in (p, p + 10000):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise ClusterError("no free loopback port pair for a cluster node")


def wait_for(cond, timeout: float, what: str, interval: float = 0.05):
    """Poll ``cond()`` until truthy (its value is returned) or ``timeout`` s pass (:class:`ClusterError`).
    Exceptions of ``cond`` count as not yet."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            v = cond()
            if v:
                return v
        except Exception as exc:  # noqa: BLE001 - a node still starting or failing over
            last = exc
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:g} s waiting for {what}" + (f" ({last})" if last else ""))
        time.sleep(interval)


@dataclass
class Node:
    """One ``redis-server`` of the cluster."""

    port: int
    proc: subprocess.Popen | None = None
    killed: bool = False
    host: str = "127.0.0.1"

    @property
    def addr(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    def client(self, **kw) -> redis.Redis:
        """A plain (non-cluster) client of this node alone."""
        return redis.Redis(host=self.host, port=self.port, socket_timeout=kw.pop("socket_timeout", 2),
                           socket_connect_timeout=1, **kw)


@dataclass
class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each; :meth:`start`, :meth:`stop`; :attr:`url` is
    the ``redis+cluster://`` URL listing every node.

    ``hosts`` (default None: everything on 127.0.0.1, free ports): bind addresses, one master per host
    (``masters`` is then ``len(hosts)``), replica ``j`` of host ``i``'s master on host ``i+1+j``; every
    node of a host listens on ``base_port``, ``base_port+1``.. (bus: +10000). ``wrap(host, argv) -> argv``
    runs a node elsewhere (a namespace holding ``host``), ``track(popen)`` is told of every process."""

    masters: int = 3
    replicas: int = 1
    node_timeout_ms: int = 2000
    nodes: list[Node] = field(default_factory=list)
    dir: str = ""
    hosts: list[str] | None = None
    wrap: Callable[[str, list[str]], list[str]] | None = None
    track: Callable[[subprocess.Popen], None] | None = None
    base_port: int = 7000

    def __post_init__(self):
        self.exe = shutil.which("redis-server")
        self.cli = shutil.which("redis-cli")

    @property
    def available(self) -> bool:
        """True when ``redis-server`` and ``redis-cli`` are on PATH."""
        return bool(self.exe and self.cli)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.addr for n in self.nodes) + "/"

    def _spawn(self, node: Node) -> None:
        tag = f"{node.host}-{node.port}" if self.hosts else str(node.port)
        argv = [self.exe, "--port", str(node.port), "--bind", node.host, "--cluster-enabled", "yes",
                "--cluster-config-file", os.path.join(self.dir, f"nodes-{tag}.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms), "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--protected-mode", "no", "--repl-diskless-sync-delay", "0",  # replicas sync at once
                "--logfile", os.path.join(self.dir, f"log-{tag}.txt")]
        if self.hosts:  # outgoing bus and replication links from the node's own address (Redis >= 7)
            argv += ["--bind-source-addr", node.host]
        if self.wrap is not None:
            argv = self.wrap(node.host, argv)
        node.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=self.wrap is not None)
        if self.track is not None:
            self.track(node.proc)
        node.killed = False

    def start(self, timeout: float = 60.0) -> "LocalCluster":
        """Start every node, create the cluster, wait for ``cluster_state:ok`` on every node and for
        every node to see every slot covered. Raises :class:`ClusterError`; stops what it started then."""
        if not self.available:
            raise ClusterError("redis-server / redis-cli not installed")
        self.dir = tempfile.mkdtemp(prefix="magpie-cluster-")
        if self.hosts:
            return self._start_on_hosts(timeout)
        try:
            ports: set[int] = set()
            while len(ports) < self.masters * (1 + self.replicas):
                ports.add(free_port_pair())
            self.nodes = [Node(p) for p in sorted(ports)]
            for n in self.nodes:
                self._spawn(n)
            for n in self.nodes:
                wait_for(lambda n=n: n.client().ping(), 10, f"node {n.port} to answer")
            out = subprocess.run(
                [self.cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                capture_output=True, text=True, timeout=timeout)
            if out.returncode != 0:
                raise ClusterError("redis-cli --cluster create failed: " + (out.stdout + out.stderr)[-500:])
            self.wait_ok(timeout)
            return self
        except BaseException:
            self.stop()
            raise

    def _start_on_hosts(self, timeout: float) -> "LocalCluster":
        hosts = list(self.hosts)
        if not 1 <= self.replicas < len(hosts):
            self.stop()
            raise ClusterError(f"{self.replicas} replica(s) per master need more than {self.replicas} hosts")
        self.masters = len(hosts)
        masters = [Node(self.base_port, host=h) for h in hosts]
        reps = [(Node(self.base_port + 1 + j, host=hosts[(i + 1 + j) % len(hosts)]), i)
                for j in range(self.replicas) for i in range(len(hosts))]
        self.nodes = masters + [n for n, _ in reps]
        try:
            for n in self.nodes:
                self._spawn(n)
            for n in self.nodes:
                wait_for(lambda n=n: n.client().ping(), 10, f"node {n.addr} to answer")
            out = subprocess.run([self.cli, "--cluster", "create", *[n.addr for n in masters], "--cluster-yes"],
                                 capture_output=True, text=True, timeout=timeout)
            if out.returncode != 0:
                raise ClusterError("redis-cli --cluster create failed: " + (out.stdout + out.stderr)[-500:])
            for n, i in reps:  # join, then follow the master of the host before
                n.client().execute_command("CLUSTER MEET", masters[i].host, masters[i].port)
            ids = [self._id(m) for m in masters]
            for n, i in reps:
                wait_for(lambda n=n, i=i: self._knows(n, ids[i]), timeout, f"{n.addr} to learn of its master")
                n.client().execute_command("CLUSTER REPLICATE", ids[i])
            self.wait_ok(timeout)
            return self
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _id(node: Node) -> str:
        nid = node.client().execute_command("CLUSTER MYID")
        return nid.decode() if isinstance(nid, bytes) else nid

    @staticmethod
    def _knows(node: Node, node_id: str) -> bool:
        return any(row.get("node_id") == node_id
                   for row in node.client().execute_command("CLUSTER NODES").values())

    def live(self) -> list[Node]:
        """Nodes whose process is running."""
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def state_ok(self) -> bool:
        """True when every live node reports ``cluster_state:ok``, every live replica's link to its master is
        up, and all agree on one owner per slot range."""
        maps = []
        for n in self.live():
            info = n.client().execute_command("CLUSTER INFO")  # redis-py parses it into a dict
            if info.get("cluster_state") != "ok":
                return False
            repl = n.client().info("replication")
            if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                return False  # a replica that never synced cannot be promoted
            maps.append(self._slot_owners(n))
        return bool(maps) and all(m == maps[0] for m in maps)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until :meth:`state_ok` (raises :class:`ClusterError`)."""
        wait_for(self.state_ok, timeout, "cluster_state:ok on every node")

    @staticmethod
    def _slot_owners(node: Node) -> list[tuple[int, int, int]]:
        rows = node.client().execute_command("CLUSTER SLOTS")
        return sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in rows)

    @staticmethod
    def slot_map(node: Node) -> list[tuple[int, int, str]]:
        """``[(first slot, last slot, master host:port)]`` as ``node`` sees it (raises redis errors)."""
        rows = node.client().execute_command("CLUSTER SLOTS")
        return sorted((int(r[0]), int(r[1]), f"{_s(r[2][0])}:{int(r[2][1])}") for r in rows)

    def master_addr_of(self, slot: int, asking: Node | None = None) -> str:
        """``host:port`` of the master serving ``slot``, as ``asking`` (default: the first live node)
        sees it. Raises :class:`ClusterError` when no node serves it, redis errors when unreachable."""
        for start, end, addr in self.slot_map(asking or self.live()[0]):
            if start <= slot <= end:
                return addr
        raise ClusterError(f"no node serves slot {slot}")

    def node_at(self, addr: str) -> Node:
        """The node listening on ``host:port`` (StopIteration for none)."""
        return next(n for n in self.nodes if n.addr == addr)

    def role(self, node: Node) -> str:
        """``master`` or ``slave``, from the node's ``INFO replication`` (raises redis errors)."""
        return _s(node.client().info("replication")["role"])

    def master_port_of(self, slot: int) -> int:
        """Port of the master serving ``slot`` (asked of a live node)."""
        for start, end, port in self._slot_owners(self.live()[0]):
            if start <= slot <= end:
                return port
        raise ClusterError(f"no node serves slot {slot}")

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def node_id(self, port: int) -> str:
        nid = self.node(port).client().execute_command("CLUSTER MYID")
        return nid.decode() if isinstance(nid, bytes) else nid

    def replicas_of(self, port: int) -> list[int]:
        """Ports of the live replicas of the master on ``port``."""
        nid = self.node_id(port)
        out = []
        for n in self.live():
            if n.port == port:
                continue
            for row in n.client().execute_command("CLUSTER NODES").values():  # parsed: addr -> fields
                flags = row["flags"].split(",")
                if "myself" in flags and "slave" in flags and row["master_id"] == nid:
                    out.append(n.port)
        return out

    def kill_master_of(self, slot: int, timeout: float = 30.0) -> tuple[int, int, float]:
        """SIGKILL the master serving ``slot`` and wait until a replica serves it and the live nodes agree.

        Returns ``(old_port, new_port, seconds from kill to agreement)``. Raises :class:`ClusterError`.
        """
        old = self.master_port_of(slot)
        reps = self.replicas_of(old)
        if not reps:
            raise ClusterError(f"master {old} has no replica to promote")
        n = self.node(old)
        t0 = time.monotonic()
        n.proc.kill()
        n.proc.wait()
        n.killed = True

        def promoted():
            return self.state_ok() and self.master_port_of(slot) in reps

        wait_for(promoted, timeout, f"a replica of {old} to serve slot {slot}", interval=0.02)
        return old, self.master_port_of(slot), time.monotonic() - t0

    def freeze(self, port: int) -> None:
        """SIGSTOP the node on ``port`` (a replica frozen so stops receiving its master's writes)."""
        os.kill(self.node(port).proc.pid, signal.SIGSTOP)

    def thaw(self, port: int) -> None:
        """SIGCONT the node on ``port``."""
        os.kill(self.node(port).proc.pid, signal.SIGCONT)

    def cut_replication(self, master_port: int, timeout: float = 10.0) -> None:
        """Close the master's links to its replicas (``CLIENT KILL TYPE replica``) and wait until it counts
        none: with its replicas frozen first (:meth:`freeze`), what the master acknowledges from here on
        exists on the master alone, a failover loses it for certain."""
        m = self.node(master_port).client()
        m.execute_command("CLIENT KILL TYPE replica")
        wait_for(lambda: int(m.info("replication")["connected_slaves"]) == 0, timeout,
                 f"master {master_port} to drop its replicas")

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` and reap it."""
        n = self.node(port)
        n.proc.kill()
        n.proc.wait()
        n.killed = True

    def wait_served_by(self, slot: int, ports: list[int], timeout: float = 30.0) -> int:
        """Wait until one of ``ports`` serves ``slot`` and the live nodes agree; returns that port."""
        wait_for(lambda: self.state_ok() and self.master_port_of(slot) in ports, timeout,
                 f"one of {ports} to serve slot {slot}", interval=0.02)
        return self.master_port_of(slot)

    def replication_caught_up(self, master_port: int) -> bool:
        """True when every live replica of ``master_port`` has its master's replication offset."""
        want = int(self.node(master_port).client().info("replication")["master_repl_offset"])
        return all(int(self.node(p).client().info("replication").get("slave_repl_offset", -1)) >= want
                   for p in self.replicas_of(master_port))

    def restart(self, port: int, timeout: float = 30.0) -> None:
        """Start a killed node again (it rejoins from its nodes.conf as a replica) and wait for ok."""
        n = self.node(port)
        self._spawn(n)
        wait_for(lambda: n.client().ping(), 10, f"node {port} to answer")
        self.wait_ok(timeout)

    def masters_ports(self) -> list[int]:
        """Ports of the live masters that own slots."""
        return sorted({p for _, _, p in self._slot_owners(self.live()[0])})

    def migrate_slot(self, slot: int, target_port: int, batch: int = 100, timeout_ms: int = 5000,
                     pause_s: float = 0.0) -> int:
        """Move ``slot`` with its keys to the master on ``target_port`` (no-op when it already serves it).

        The standard sequence: ``SETSLOT IMPORTING`` on the target, ``SETSLOT MIGRATING`` on the source,
        ``MIGRATE`` of every key (``GETKEYSINSLOT`` batches of ``batch``), then ``SETSLOT NODE`` on the
        target, the source and every other master; ``pause_s`` seconds between two batches keep the
        slot half moved for a while (clients meet ASK and TRYAGAIN). Returns how many keys moved.
        """
        source_port = self.master_port_of(slot)
        if source_port == target_port:
            return 0
        src, dst = self.node(source_port).client(), self.node(target_port).client()
        src_id, dst_id = self.node_id(source_port), self.node_id(target_port)
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        while True:
            keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            src.execute_command("MIGRATE", "127.0.0.1", target_port, "", 0, timeout_ms, "REPLACE", "KEYS", *keys)
            moved += len(keys)
            if pause_s:
                time.sleep(pause_s)  # a half-moved slot on purpose (tests), not a wait for a condition
        dst.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        src.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        for p in self.masters_ports():
            if p not in (source_port, target_port):
                try:
                    self.node(p).client().execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
                except redis.ResponseError:
                    pass  # it may already know through the bus
        return moved

    def stop(self) -> None:
        """Stop every node by PID (SIGTERM, then SIGKILL after 5 s) and remove the data folder."""
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                try:
                    os.kill(n.proc.pid, signal.SIGCONT)
                    n.proc.terminate()
                except ProcessLookupError:
                    pass
        for n in self.nodes:
            if n.proc is not None:
                try:
                    n.proc.wait(5)
                except subprocess.TimeoutExpired:
                    n.proc.kill()
                    n.proc.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def key_slot(key: str | bytes) -> int:
    """The cluster hash slot (0..16383) of ``key`` (hash tag rules included)."""
    from redis.crc import key_slot as _slot

    return _slot(key.encode() if isinstance(key, str) else key)
