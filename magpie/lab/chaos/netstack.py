"""A magpie deployment spread over network namespaces: Redis, PostgreSQL, the lab and N worker nodes
each on a host of its own, joined by real (veth) links (:mod:`magpie.lab.netns`).

:class:`Net` is the topology of one run and its long-lived server (PostgreSQL in the ``pg`` host,
migrated per stack); :class:`NetStack` is a :class:`magpie.lab.chaos.stack.Stack` whose Redis runs in the
``redis`` host, whose judge and fault lab run in a process of the ``proxies`` host (on addresses of its
own), and whose Celery processes run in the ``node1``..``nodeN`` hosts. The fault scenarios of
:mod:`magpie.lab.chaos` run on it unchanged (``benchmarks/chaos.py --nodes 3``), and ``tests/netns``
cut links under it.

The egress guard stays deny-by-default: every process (and the harness itself while a Net is open) gets
``MAGPIE_EGRESS_ONLY`` = loopback plus the topology's /24, and ``MAGPIE_CHECK_ALLOW_PRIVATE`` = that /24
(the documented setting that lets checks reach private proxies), nothing wider.

    net = Net(nodes=3).start()
    try:
        with NetStack("spread", net) as st:   # services up
            st.import_lines(...); st.start_nodes()
            net.topo.cut("node2"); ...
    finally:
        net.close()
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from magpie.lab.chaos.servers import PrivatePostgres, PrivateRedis, ServerError
from magpie.lab.chaos.stack import ROOT, Stack
from magpie.lab.net import stop_process
from magpie.lab.netns import Topology

EGRESS = "MAGPIE_EGRESS_ONLY"
LOOPBACK = "127.0.0.0/8,::1"


class Net:
    """One topology: hosts ``redis`` (and ``redis2``.. for ``redis_hosts`` > 1), ``rc1``..``rc<k>`` for a
    Redis Cluster (``cluster_hosts=k``), ``pg``, ``proxies`` (five extra addresses for the fault lab) and
    ``node1``..``node<nodes>``; PostgreSQL started in ``pg``.

    Args:
        nodes: worker hosts (1..20).
        redis_hosts: plain Redis hosts (1..6); a single-Redis deployment uses the first (and, with a
            cluster, as its Celery broker).
        cluster_hosts: hosts of a Redis Cluster (0, or 3..6): one master each and a replica of the
            previous host's master (:meth:`cluster`); 0 for none.
    Attributes: topo (:class:`Topology`), pg (:class:`PrivatePostgres` on ``pg``), node_names.
    Raises :class:`magpie.lab.netns.NetnsError` / :class:`ServerError` from :meth:`start` (everything made
    is removed again), ValueError for out-of-range arguments.
    """

    def __init__(self, nodes: int = 3, redis_hosts: int = 1, cluster_hosts: int = 0) -> None:
        if not 1 <= nodes <= 20:
            raise ValueError(f"nodes must be 1..20: {nodes}")
        if not 1 <= redis_hosts <= 6:
            raise ValueError(f"redis_hosts must be 1..6: {redis_hosts}")
        if cluster_hosts and not 3 <= cluster_hosts <= 6:
            raise ValueError(f"cluster_hosts must be 0 or 3..6: {cluster_hosts}")
        self.redis_names = ["redis"] + [f"redis{i}" for i in range(2, redis_hosts + 1)]
        self.cluster_names = [f"rc{i}" for i in range(1, cluster_hosts + 1)]
        self.node_names = [f"node{i}" for i in range(1, nodes + 1)]
        self.topo = Topology([*self.redis_names, *self.cluster_names, "pg", "proxies", *self.node_names],
                             extra_addresses={"proxies": 5})
        self.pg: PrivatePostgres | None = None
        self._egress_before: str | None = None
        self._redis_port = 6379

    @property
    def redis_addrs(self) -> list[str]:
        """Addresses of the Redis hosts, first the one a single-Redis deployment uses."""
        return [self.topo.addr(h) for h in self.redis_names]

    @property
    def egress(self) -> str:
        """The ``MAGPIE_EGRESS_ONLY`` value of everything on this topology: loopback and the /24."""
        return f"{LOOPBACK},{self.topo.cidr}"

    def start(self) -> Net:
        """Build the namespaces, start PostgreSQL in ``pg``, widen this process's egress allow-list to the
        topology's /24; returns self."""
        self.topo.build()
        try:
            self._egress_before = os.environ.get(EGRESS)
            os.environ[EGRESS] = self.egress if self._egress_before is None else \
                f"{self._egress_before},{self.topo.cidr}"
            self.pg = PrivatePostgres(host=self.topo.addr("pg"), port=5432,
                                      wrap=lambda a: self.topo.argv("pg", a), track=self.topo.track,
                                      trust_cidr=self.topo.cidr)
            self.pg.start()
            return self
        except BaseException:
            self.close()
            raise

    def redis(self, host: str = "redis") -> PrivateRedis:
        """A new (not started) Redis server on Redis host ``host``, on a port no other one here used."""
        self._redis_port += 1
        return PrivateRedis(host=self.topo.addr(host), port=self._redis_port,
                            wrap=lambda a: self.topo.argv(host, a), track=self.topo.track)

    def cluster(self, node_timeout_ms: int = 2000, base_port: int = 7000):
        """A new (not started) :class:`magpie.lab.cluster.LocalCluster` over the ``rc*`` hosts: one master
        per host on ``base_port``, the replica of host ``i``'s master on host ``i+1`` (``base_port + 1``),
        run inside the hosts' namespaces. Raises ValueError when this Net has no cluster hosts."""
        from magpie.lab.cluster import LocalCluster

        if not self.cluster_names:
            raise ValueError("this Net has no cluster hosts: Net(cluster_hosts=3)")
        by_addr = {self.topo.addr(h): h for h in self.cluster_names}
        return LocalCluster(node_timeout_ms=node_timeout_ms, hosts=list(by_addr), base_port=base_port,
                            wrap=lambda addr, argv: self.topo.argv(by_addr[addr], argv), track=self.topo.track)

    def host_of(self, addr: str) -> str:
        """The host name holding address ``addr`` (``ip`` or ``ip:port``); KeyError for none."""
        ip = addr.rsplit(":", 1)[0] if addr.count(".") == 3 and ":" in addr else addr
        for h in self.topo.hosts:
            if self.topo.addr(h) == ip or ip in self.topo.extra(h):
                return h
        raise KeyError(f"no host holds {addr}")

    def close(self) -> None:
        """Stop PostgreSQL, remove every namespace, restore this process's egress allow-list. Never raises."""
        if self.pg is not None:
            with contextlib.suppress(Exception):
                self.pg.destroy()
        self.topo.close()
        if self._egress_before is None:
            os.environ.pop(EGRESS, None)
        else:
            os.environ[EGRESS] = self._egress_before

    def __enter__(self) -> Net:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class LabProcess:
    """The judge and the fault lab of :mod:`magpie.lab.faults`, in one process of the ``proxies`` host.

    Attributes: addresses (kind -> ``host:port``), judge_url, proc. :meth:`peers` reads, from the lab's
    stats file (rewritten every second), kind -> client address -> connections accepted.
    Raises :class:`ServerError` when it does not report its addresses within 30 s.
    """

    def __init__(self, net: Net, workdir: Path, env: dict[str, str], slow_delay: float) -> None:
        topo = net.topo
        host, base = topo.addr("proxies"), topo.extra("proxies")[0]
        self.judge_url = f"http://{host}:8899/"
        self.stats = workdir / "lab-stats.json"
        self.log = workdir / "lab.log"
        code = ("import sys, threading\n"
                "from magpie.checker.judge import JudgeThread\n"
                "from magpie.lab.faults import main\n"
                f"j = JudgeThread({host!r}, 8899)\n"
                "sys.exit(main(sys.argv[1:]))\n")
        argv = [sys.executable, "-c", code, "--host-base", base, "--judge-host", host, "--judge-port", "8899",
                "--slow-delay", f"{slow_delay:g}", "--stats-file", str(self.stats)]
        with open(self.log, "ab") as err:
            self.proc = topo.popen("proxies", argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
        line = self._first_line(30.0)
        doc = json.loads(line)
        self.addresses = {k: v for k, v in doc.items() if k not in ("tarpits", "pid")}

    def _first_line(self, timeout: float) -> str:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(0.5):
                line = self.proc.stdout.readline().decode().strip()
                if line:
                    return line
            if self.proc.poll() is not None:
                break
        self.stop()
        raise ServerError(f"the lab in the proxies namespace did not start: {self.log.read_text()[-400:]}")

    def peers(self) -> dict[str, dict[str, int]]:
        """Kind -> client address -> connections accepted since start (as of the last stats rewrite)."""
        try:
            return json.loads(self.stats.read_text()).get("peers", {})
        except (OSError, ValueError):
            return {}

    def stop(self) -> None:
        stop_process(self.proc)
        with contextlib.suppress(Exception):
            self.proc.stdout.close()


class NetStack(Stack):
    """A :class:`Stack` over a :class:`Net` (module doc); the same constructor arguments after ``net``.

    ``cluster=True`` (a Net with ``cluster_hosts``): the schedule lives on a Redis Cluster over the
    ``rc*`` hosts (:meth:`Net.cluster`, :attr:`cluster`), split in ``partitions`` hash-tag partitions
    (``MAGPIE_SCHEDULE_PARTITIONS``); the plain Redis of the ``redis`` host is the Celery broker.

    Processes are placed on nodes: :meth:`spawn` with ``node=`` names one, otherwise the node running the
    fewest live processes of that role (first nodes first) gets it. :meth:`start_nodes` starts the
    Procfile's workers on every node and one beat on ``node1``.
    """

    def __init__(self, name: str, net: Net, env: dict[str, str] | None = None, cluster: bool = False,
                 partitions: int = 3, **kw) -> None:
        self.net = net
        self.nodes = list(net.node_names)
        super().__init__(name, net.pg, env=env, **kw)
        for srv in (self.redis_server, self.broker_server):  # the plain Stack's, never started
            if srv is not None:
                srv.stop()
        self.redis_server = net.redis("redis")
        self.broker_server = net.redis("redis") if self.broker_server is not None else None
        self.cluster = net.cluster() if cluster else None
        self.env.update({
            "MAGPIE_REDIS_URL": self.redis_server.url,
            "MAGPIE_BROKER_URL": (self.broker_server.url if self.broker_server
                                  else self.redis_server.url[:-1] + "1"),
            EGRESS: net.egress,
            "MAGPIE_CHECK_ALLOW_PRIVATE": net.topo.cidr,
        })
        if self.cluster is not None:  # the schedule on the cluster (its URL once started), Celery here
            self.env.update({"MAGPIE_BROKER_URL": self.redis_server.url,
                             "MAGPIE_SCHEDULE_PARTITIONS": str(partitions)})
        self.env.update(env or {})

    def start_services(self) -> None:
        """Start Redis (redis host; with ``cluster``, also the Redis Cluster on the ``rc*`` hosts, which then
        holds the schedule: ``MAGPIE_REDIS_URL`` is set to it, :attr:`r` is a cluster client), the judge
        and fault lab (proxies host), create and migrate the database (pg host)."""
        from magpie.db.migrate import upgrade

        self.r = self.redis_server.start()
        if self.cluster is not None:
            from magpie.base import redisconn

            self.cluster.start()
            self.env["MAGPIE_REDIS_URL"] = self.cluster.url
            self.r = redisconn.connect(self.cluster.url, socket_timeout=2, socket_connect_timeout=1)
        if self.broker_server:
            self.broker_server.start()
        lab_env = {**self.env, EGRESS: self.net.egress}
        self.lab = LabProcess(self.net, self.dir, lab_env, float(self.env.get("CHAOS_SLOW_DELAY", 1.5)))
        self.judge = None
        self.env["MAGPIE_JUDGE_URL"] = self.lab.judge_url
        self.pg.execute(f'CREATE DATABASE "{self.db}"')
        upgrade(self.pg.url(self.db), encryption_key=self.env["PROXY_ENCRYPTION_KEY"])
        import sqlalchemy as sa

        self.engine = sa.create_engine(self.pg.url(self.db), poolclass=sa.pool.NullPool)

    def place(self, role: str) -> str:
        """The node running the fewest live ``role`` processes (the first of those)."""
        live = {n: 0 for n in self.nodes}
        for p in self.procs:
            if p.role == role and p.alive() and p.node in live:
                live[p.node] += 1
        return min(self.nodes, key=lambda n: live[n])

    def wrap(self, node: str | None, argv: list[str]) -> list[str]:
        return self.net.topo.argv(node or self.nodes[0], argv)

    def start_nodes(self, beats: int = 1, engines_timeout: float = 90.0,
                    env_by_node: dict | None = None) -> None:
        """Start jobs, checks and promote on every node (``env_by_node``: node -> settings of its
        processes), ``beats`` beats (node1 first), and wait until every node's check engine announced."""
        for n in self.nodes:
            extra = (env_by_node or {}).get(n, {})
            for role in ("jobs", "checks", "promote"):
                self.spawn(role, node=n, **extra)
        for i in range(beats):
            self.spawn("beat", node=self.nodes[i % len(self.nodes)])
        self.wait_engines(len(self.nodes), engines_timeout)

    def node_addr(self, node: str) -> str:
        """``node``'s address (the source address of everything it sends)."""
        return self.net.topo.addr(node)

    def checks_by_node(self, kind: str = "echo") -> dict[str, int]:
        """Node -> connections the lab's ``kind`` server accepted from it (one per check attempt)."""
        peers = self.lab.peers().get(kind, {})
        return {n: int(peers.get(self.node_addr(n), 0)) for n in self.nodes}

    def close(self, keep_logs: bool = False) -> None:
        super().close(keep_logs=keep_logs)
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.stop()
