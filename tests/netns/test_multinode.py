"""magpie across several hosts: network namespaces joined by veth links on this machine (magpie.lab.netns).

Redis, a Redis Cluster over three more hosts, PostgreSQL, the lab's judge and fault servers and three
worker nodes each run in a namespace of their own; the harness reaches them through its own link to the bridge. The slow tests run the
multi-node scenarios of magpie.lab.chaos.multinode; the quick one checks the topology itself (links,
cuts, teardown). Everything skips when this is not root or iproute2 is missing.

    sudo .venv/bin/pytest -m slow tests/netns        # or: make test-netns
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from magpie.lab import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _connect(topo, host: str, dst: str, port: int) -> int:
    """Exit status of a TCP connect from ``host``'s namespace to ``dst:port`` (0: answered 'hi')."""
    code = (f"import socket\ns = socket.create_connection(({dst!r}, {port}), timeout=1.5)\n"
            "assert s.recv(2) == b'hi'\n")
    return topo.exec(host, sys.executable, "-c", code, check=False).returncode


def _wait_connect(topo, host: str, dst: str, port: int, timeout: float = 10.0) -> bool:
    """Poll :func:`_connect` until it answers (a link just brought up may need a moment); True if it did."""
    deadline = time.monotonic() + timeout
    while _connect(topo, host, dst, port) != 0:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def test_topology_links_cuts_and_teardown(monkeypatch):
    topo = netns.Topology(["srv", "a", "b"], extra_addresses={"srv": 1})
    monkeypatch.setenv("MAGPIE_EGRESS_ONLY", f"127.0.0.0/8,::1,{topo.cidr}")
    topo.build()
    try:
        assert set(topo.leftovers()) >= {topo.ns("srv"), topo.ns("a"), topo.ns("b"), topo.root_link}
        srv_code = (f"import socket\ns = socket.create_server(({topo.addr('srv')!r}, 7000))\n"
                    "while True:\n    c, _ = s.accept(); c.send(b'hi'); c.close()\n")
        server = topo.popen("srv", [sys.executable, "-c", srv_code])
        assert _wait_connect(topo, "a", topo.addr("srv"), 7000), "the server in srv never answered"
        # the root namespace reaches the hosts over its own link; the server is not on this host's loopback
        with socket.create_connection((topo.addr("srv"), 7000), timeout=2) as s:
            assert s.recv(2) == b"hi"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", 7000), timeout=1)
        for mode in ("switch", "down"):
            topo.cut("a", mode)
            assert _connect(topo, "a", topo.addr("srv"), 7000) != 0, mode
            assert _connect(topo, "b", topo.addr("srv"), 7000) == 0, mode  # only a is cut off
            topo.restore("a")
            assert topo.link_up("a")
            assert _wait_connect(topo, "a", topo.addr("srv"), 7000), mode
        with pytest.raises(ValueError):
            topo.cut("a", "sideways")
    finally:
        topo.close()
    assert topo.leftovers() == []
    assert not _alive(server.pid)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"mgp{topo.run}" not in links


def test_teardown_after_a_failed_build(monkeypatch):
    topo = netns.Topology(["a"])
    # a host whose veth cannot be made: build fails half way and removes what it made
    monkeypatch.setattr(topo, "_add_host", lambda i, h: (_ for _ in ()).throw(netns.NetnsError("boom")))
    with pytest.raises(netns.NetnsError):
        topo.build()
    assert topo.leftovers() == []


def test_bad_host_names_are_refused():
    with pytest.raises(netns.NetnsError, match="host name"):
        netns.Topology(["Node-1"])
    with pytest.raises(netns.NetnsError, match="unique"):
        netns.Topology(["a", "a"])


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    """Three worker nodes, Redis, three Redis Cluster hosts, PostgreSQL and the lab, each in a namespace;
    removed afterwards (and checked to be gone)."""
    from magpie.lab.chaos.netstack import Net
    from magpie.lab.chaos.servers import ServerError

    n = Net(nodes=3, cluster_hosts=3)
    try:
        n.start()
    except ServerError as exc:
        pytest.skip(f"private servers unavailable: {exc}")
    yield n
    pids = list(n.topo.pids)
    n.close()
    assert n.topo.leftovers() == []
    assert [p for p in pids if _alive(p)] == []


@pytest.mark.slow
def test_link_cut_and_rejoin(net, tmp_path):
    """One node's link cut mid-run (silence, as in a partition) and restored: its leases come back after
    expiry and are checked by the other nodes, which keep every route's cadence; nothing is lost, no cycle
    completed twice, no result lost; once restored the node takes work again, and nothing it held when
    cut takes effect late (its completions fail while cut, or are refused by fencing after)."""
    from magpie.lab.chaos.multinode import link_cut

    out = link_cut(net, log_dir=tmp_path)
    print(out.line())
    assert out.failures == []
    f = out.figures
    assert f["victim_checks_during_cut"] == 0
    assert f["during_node1"] > 0 and f["during_node3"] > 0
    assert f["victim_checks_after"] > 0
    assert f["victim_inflight_at_cut"] > 0, "the cut node had no check in flight (scenario did not happen)"
    assert f["duplicated"] == 0 and f["lost"] == 0 and f["results_lost"] == 0


@pytest.mark.slow
def test_checks_spread_by_slots(net, tmp_path):
    """Every engine busy: each node's share of the checks is its share of the slots (2:1:1), within
    SPREAD_TOLERANCE."""
    from magpie.lab.chaos.multinode import SPREAD_TOLERANCE, spread

    out = spread(net, log_dir=tmp_path)
    print(out.line())
    assert out.failures == []
    assert out.figures["worst_share_error"] <= SPREAD_TOLERANCE


@pytest.mark.slow
def test_cluster_spreads_masters_and_replicas_over_the_hosts(net):
    """The cluster of Net.cluster: one master per rc host, each master's replica on another host, served
    through the cluster URL from the harness; its processes are gone once stopped."""
    from magpie.base import redisconn

    cl = net.cluster()
    cl.start()
    pids = [n.proc.pid for n in cl.nodes]
    try:
        masters = {net.host_of(addr) for _, _, addr in cl.slot_map(cl.nodes[0])}
        assert masters == set(net.cluster_names)
        for n in cl.nodes:
            if cl.role(n) == "slave":
                master = n.client().info("replication")["master_host"]
                assert net.host_of(master) != net.host_of(n.host), f"{n.addr} replicates a master of its host"
        c = redisconn.connect(cl.url, socket_timeout=2)
        for i in range(30):
            c.set(f"netns-check-{{p{i}}}", i)
        assert [int(c.get(f"netns-check-{{p{i}}}")) for i in range(30)] == list(range(30))
        c.close()
    finally:
        cl.stop()
    assert [p for p in pids if _alive(p)] == []


@pytest.mark.slow
def test_redis_master_host_cut_fails_over(net, tmp_path):
    """The schedule on a Redis Cluster over three hosts, three partitions, routes flowing over three
    nodes; the host of the master serving p0 is cut off: its replica on another host is promoted, every
    route of the affected partitions is checked again, nothing lost or doubled, no result lost; the host
    restored, its old master rejoins as a replica."""
    from magpie.lab.chaos.multinode import redis_failover

    out = redis_failover(net, log_dir=tmp_path)
    print(out.line())
    assert out.failures == []
    f = out.figures
    assert f["promoted_on"] not in ("-", f["victim"])
    assert 0 < f["failover_s"] < 30 and f["resumed_s"] > 0
    assert f["lost"] == 0 and f["duplicated"] == 0 and f["results_lost"] == 0
    assert f["failover_results_lost"] >= 0 and f["unreplicated_bytes"] >= 0  # measured (async replication)
