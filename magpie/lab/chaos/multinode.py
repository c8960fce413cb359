"""Scenarios across network namespaces: several worker nodes on real links (:mod:`magpie.lab.chaos.netstack`).

Each function takes a started :class:`magpie.lab.chaos.netstack.Net` (and a log directory) and returns an
:class:`magpie.lab.chaos.base.Outcome` whose ``failures`` list the guarantees that did not hold.

- :func:`spread`: with every engine busy, each node's share of the checks follows its share of the slots
  (checks per node counted by the lab's servers from the source address of each connection).
- :func:`link_cut`: one node's link is cut mid-run (its bridge port down: silence, as in a partition), then
  restored. While cut, its leases expire and are checked by the others (nothing lost, no cycle completed
  twice, every route keeps a cadence), its own count stands still; once restored it takes work again, and
  the completions it attempts for leases that moved on are refused by fencing (``stale`` counter,
  ``lease_lost`` counters).
- :func:`redis_failover`: the schedule on a Redis Cluster over three hosts (one master and one replica
  of another host's master each), split in three partitions; the host of the master serving some
  partitions is cut off; its replica on another host is promoted, checks of those partitions resume,
  the other partitions flow on; what the old master had not replicated when cut is counted (replication
  is asynchronous); the host is restored and its old master rejoins as a replica.
"""

from __future__ import annotations

import time
from pathlib import Path

from magpie.lab.chaos import measure as m
from magpie.lab.chaos.base import Outcome, wait_until
from magpie.lab.chaos.netstack import NetStack
from magpie.lab.population import population_lines

SPREAD_TOLERANCE = 0.25
"""Largest relative difference allowed between a node's share of checks and its share of slots."""



def _stack(name: str, net, log_dir: Path | None, env: dict[str, str]) -> NetStack:
    st = NetStack(name, net, env=env, log_dir=(log_dir / name) if log_dir else None)
    st.start_services()
    return st


def spread(net, log_dir: Path | None = None, workers: dict[str, int] | None = None,
           per_process: int = 8, window_s: float = 20.0) -> Outcome:
    """Load the nodes (slow routes, demand at 1.5x the slots) and compare each node's share of the checks
    made in ``window_s`` seconds with its share of the slots. ``workers``: node -> check workers it runs
    (two processes each, ``per_process`` slots a process; default node1 2, the others 1: shares 2:1:1..).
    Figures: ``checks_<node>``, ``share_<node>`` (of the checks), ``slot_share_<node>``,
    ``worst_share_error`` (max |share / slot share - 1|), which must stay within :data:`SPREAD_TOLERANCE`;
    ``checks_per_s``."""
    out = Outcome("spread", "multinode")
    nodes = net.node_names
    workers = workers or {n: (2 if i == 0 else 1) for i, n in enumerate(nodes)}
    slots = {n: 2 * per_process * workers.get(n, 0) for n in nodes}  # two check processes per worker
    total_slots = sum(slots.values())
    env = {"MAGPIE_CHECK_INTERVAL": "2", "MAGPIE_CHECK_TIMEOUT": "3", "MAGPIE_LEASE_SECONDS": "8",
           "MAGPIE_RENEW_BELOW_SECONDS": "3", "CHAOS_SLOW_DELAY": "1.0", "MAGPIE_PROFILE_MAX_TIMEOUT": "3",
           "MAGPIE_CHECKS_PER_PROCESS": str(per_process)}
    n_routes = int(total_slots * 2.0 / 1.0 * 1.5)  # demand (routes x 1 s / 2 s) at 1.5x the slots
    st = _stack(out.name, net, log_dir, env)
    try:
        st.import_lines(population_lines(st.address("slow"), n_routes))
        for n in nodes:
            st.spawn("jobs", node=n)
            st.spawn("promote", node=n)
            for _ in range(workers.get(n, 0)):
                st.spawn("checks", node=n)
        st.spawn("beat", node=nodes[0])
        st.wait_engines(sum(workers.values()), 90)
        time.sleep(8)  # warm-up: every engine announced and busy
        announced = sum(st.queue().capacity_registry().engines().values())
        c0 = st.checks_by_node("slow")
        time.sleep(window_s)
        c1 = st.checks_by_node("slow")
        made = {n: c1[n] - c0[n] for n in nodes}
        total = sum(made.values()) or 1
        out.figures = {"routes": n_routes, "slots": total_slots, "slots_announced": announced}
        worst = 0.0
        for n in nodes:
            share, slot_share = made[n] / total, slots[n] / total_slots
            worst = max(worst, abs(share / slot_share - 1.0)) if slot_share else worst
            out.figures.update({f"checks_{n}": made[n], f"share_{n}": round(share, 3),
                                f"slot_share_{n}": round(slot_share, 3)})
        out.figures["worst_share_error"] = round(worst, 3)
        out.figures["checks_per_s"] = round(total / window_s, 1)
        out.expect(announced == total_slots, f"engines announced {announced} slots, configured {total_slots}")
        out.expect(worst <= SPREAD_TOLERANCE, f"a node's share of checks is off its share of slots by "
                                              f"{worst:.0%} (> {SPREAD_TOLERANCE:.0%}): {made}")
        st.stop_processes()
    finally:
        st.close(keep_logs=log_dir is not None)
    return out


def link_cut(net, log_dir: Path | None = None, victim: str = "node2", cut_s: float = 20.0,
             mode: str = "switch") -> Outcome:
    """Cut ``victim``'s link for ``cut_s`` seconds mid-run, restore it (module doc). Figures: ``routes``,
    ``checks_<node>`` before / during / after the cut, ``victim_inflight_at_cut`` (checks it had in flight
    to the lab when cut; must be > 0), ``victim_checks_during_cut`` (must be 0),
    ``rechecked_elsewhere_s`` (seconds from the cut until every route had a result from the others),
    ``max_gap_s`` (longest gap between two results of one route once the cut leases had expired; must
    stay within 2 intervals + the timeout), ``victim_resumed_s``, ``stale_refused`` (completions refused
    by fencing: the ``stale`` counter's increase), ``victim_lease_lost`` (from its check workers' logs),
    ``lost``, ``duplicated``, ``results_lost``, ``healthy_dead_lettered``."""
    from magpie.base.counters import read_counters

    out = Outcome("link-cut", "partition")
    interval, lease, timeout = 3.0, 6.0, 2.0
    env = {"MAGPIE_CHECK_INTERVAL": f"{interval:g}", "MAGPIE_CHECK_TIMEOUT": f"{timeout:g}",
           "MAGPIE_LEASE_SECONDS": f"{lease:g}", "MAGPIE_RENEW_BELOW_SECONDS": "2", "CHAOS_SLOW_DELAY": "0.8",
           "MAGPIE_PROFILE_MAX_TIMEOUT": f"{timeout:g}", "MAGPIE_CHECKS_PER_PROCESS": "8"}
    st = _stack(out.name, net, log_dir, env)
    topo = net.topo
    try:
        n = 90  # 90 x 0.8 s / 3 s = 24 checks at once: more than a node's 16 slots, less than two nodes'
        st.import_lines(population_lines(st.address("slow"), n))
        hashes = set(m.route_kinds(st))
        st.start_nodes()
        prefix = st.settings().redis_prefix
        every = wait_until(lambda: all(v > 0 for v in st.checks_by_node("slow").values()), 60)
        out.expect(every is not None, f"not every node took work before the cut: {st.checks_by_node('slow')}")
        from magpie.lab.chaos.workers import _inflight

        workers = [p for p in st.running("checks") if p.node == victim]

        def held_now() -> int:
            return sum(_inflight(w, st.address("slow")) for w in workers)
        wait_until(lambda: held_now() > 0, 30, 0.05)  # cut while it has checks in flight
        before = st.checks_by_node("slow")
        c0 = read_counters(st.r, prefix)
        t_cut = m.redis_ms(st.r)
        topo.cut(victim, mode)
        held = held_now()
        time.sleep(1.5)  # what was in flight to the lab when the cut came may still be counted
        frozen = st.checks_by_node("slow")[victim]

        def all_rechecked() -> bool:
            return hashes <= m.checked_since(m.stream_results(st.r, prefix), t_cut + int(lease * 1000))
        took = wait_until(all_rechecked, lease + 6 * interval + 20)
        rest = max(0.0, cut_s - (m.redis_ms(st.r) - t_cut) / 1000.0)
        time.sleep(rest)
        during = st.checks_by_node("slow")
        t_restore = m.redis_ms(st.r)
        topo.restore(victim)
        resumed = wait_until(lambda: st.checks_by_node("slow")[victim] > during[victim], 90)
        time.sleep(2 * interval)
        after = st.checks_by_node("slow")
        c1 = read_counters(st.r, prefix)
        stale = c1["stale"] - c0["stale"]
        lease_lost = c1["checks"].get("lease_lost", 0) - c0["checks"].get("lease_lost", 0)
        st.stop_processes(("promote", "checks"))  # beat and jobs go on: ingestion drains the stream
        acc = m.result_accounting(st, interval * 1000)
        routes = m.route_accounting(st)
        results = m.stream_results(st.r, prefix)
        steady_from = t_cut + int((lease + interval + timeout) * 1000)
        max_gap = _max_gap_ms(results, steady_from, t_restore)
        out.figures = {
            "routes": n, "cut_mode": mode, "cut_s": round((t_restore - t_cut) / 1000.0, 1),
            **{f"before_{k}": v for k, v in before.items()},
            "victim_inflight_at_cut": held, "victim_checks_during_cut": during[victim] - frozen,
            **{f"during_{k}": during[k] - before[k] for k in during if k != victim},
            "rechecked_elsewhere_s": round(took, 1) if took is not None else -1.0,
            "max_gap_s": round(max_gap / 1000.0, 1),
            "victim_resumed_s": round(resumed, 1) if resumed is not None else -1.0,
            "victim_checks_after": after[victim] - during[victim],
            "stale_refused": stale, "lease_lost": lease_lost,
            "lost": routes["lost"], "duplicated": acc["duplicated"], "results_lost": acc["results_lost"],
            "healthy_dead_lettered": routes["healthy_dead_lettered"], "results": acc["published"],
            "stats_drained": acc["drained"],
        }
        out.expect(held > 0, "the cut node had no check in flight when cut (scenario did not happen)")
        out.expect(during[victim] == frozen, "the cut node's checks reached the lab while cut")
        out.expect(took is not None, "some routes were never checked by the other nodes after the cut")
        limit = (2 * interval + timeout + 1) * 1000
        out.expect(max_gap <= limit, f"a route waited {max_gap / 1000:.1f}s between checks during the cut "
                                     f"(> {limit / 1000:.0f}s): the others did not keep up")
        out.expect(resumed is not None, "the node never took work again after its link came back")
        out.expect_zero("lost", "duplicated", "results_lost", "healthy_dead_lettered")
    finally:
        topo.restore(victim)
        st.close(keep_logs=log_dir is not None)
    return out


def _old_master_state(net, host: str, addr: str, keys: list[str]) -> dict:
    """What the master on ``addr`` (in ``host``, cut off) holds, read from inside its namespace:
    ``{"ids": {stream key: [entry ids]}, "offset": master_repl_offset}``. Raises NetnsError when it
    cannot be read (e.g. the node already refuses commands: cluster down in its minority)."""
    import json
    import sys

    ip, port = addr.rsplit(":", 1)
    code = ("import json, sys, redis\n"
            f"r = redis.Redis(host={ip!r}, port={int(port)}, socket_timeout=2)\n"
            "off = int(r.info('replication')['master_repl_offset'])\n"
            "ids = {k: [i.decode() for i, _ in r.xrange(k)] for k in sys.argv[1:]}\n"
            "print(json.dumps({'ids': ids, 'offset': off}))\n")
    done = net.topo.exec(host, sys.executable, "-c", code, *keys)
    return json.loads(done.stdout)


def redis_failover(net, log_dir: Path | None = None, cut_s: float = 20.0, mode: str = "switch",
                   partitions: int = 3) -> Outcome:
    """Cut off the host of the cluster master serving partition ``p0`` (and whichever others it serves)
    for ``cut_s`` seconds, restore it (module doc). ``net`` needs ``cluster_hosts=3`` and 3 nodes.

    Figures: ``routes``, ``victim`` (the cut host), ``affected`` (its partitions, ``+``-joined),
    ``failover_s`` (cut -> a replica on another host serves every affected slot, as a surviving node
    sees it), ``resumed_first_s`` / ``resumed_s`` (cut -> the first / every route of the affected
    partitions has a new result), ``unaffected_max_gap_s`` (longest gap between two results of a route of
    the other partitions during the cut; must stay within ``resumed_s`` + 2 intervals + the timeout + 1 s:
    claim passes span every partition and wait on the cut master as well), ``unreplicated_bytes`` (the old master's replication offset at
    the cut minus what the promoted replica had received), ``failover_results_lost`` (results-stream
    entries the old master held that the promoted replica never got), ``lease_lost`` and
    ``stale_refused`` (completions refused by fencing), ``rejoined_s`` (restore -> the old master is a
    replica and every node agrees), ``lost``, ``duplicated``, ``results_lost``, ``healthy_dead_lettered``.
    """
    from magpie.base.counters import read_counters
    from magpie.lab.cluster import key_slot
    from magpie.queue.partitions import partition_names, partition_of, results_stream_key

    out = Outcome("redis-failover", "redis-master-host-cut")
    interval, lease, timeout = 3.0, 6.0, 2.0
    env = {"MAGPIE_CHECK_INTERVAL": f"{interval:g}", "MAGPIE_CHECK_TIMEOUT": f"{timeout:g}",
           "MAGPIE_LEASE_SECONDS": f"{lease:g}", "MAGPIE_RENEW_BELOW_SECONDS": "2", "CHAOS_SLOW_DELAY": "0.8",
           "MAGPIE_PROFILE_MAX_TIMEOUT": f"{timeout:g}", "MAGPIE_CHECKS_PER_PROCESS": "8"}
    st = NetStack(out.name, net, env=env, cluster=True, partitions=partitions,
                  log_dir=(log_dir / out.name) if log_dir else None)
    topo, victim = net.topo, None
    try:
        st.start_services()
        cl = st.cluster
        prefix = st.settings().redis_prefix
        n = 60  # 60 x 0.8 s / 3 s = 16 checks at once over 48 slots
        st.import_lines(population_lines(st.address("slow"), n))
        hashes = set(m.route_kinds(st))
        part_of = {h: partition_names(partitions)[partition_of(h, partitions)] for h in hashes}
        st.start_nodes()
        every = wait_until(lambda: all(v > 0 for v in st.checks_by_node("slow").values()), 60)
        out.expect(every is not None, f"not every node took work before the cut: {st.checks_by_node('slow')}")
        names = partition_names(partitions)
        slot = {p: key_slot("{" + p + "}") for p in names}
        owner = {p: cl.master_addr_of(slot[p]) for p in names}
        victim_addr = owner[names[0]]
        victim = net.host_of(victim_addr)
        affected = [p for p in names if owner[p] == victim_addr]
        hit = {h for h, p in part_of.items() if p in affected}
        keys = [results_stream_key(prefix, p, True) for p in affected]
        survivor = next(x for x in cl.nodes if net.host_of(x.host) != victim)
        wait_until(lambda: len(m.checked_since(m.stream_results(st.r, prefix), 0) & hit) == len(hit), 30)
        c0 = read_counters(st.r, prefix)
        t_cut = int(time.time() * 1000)
        topo.cut(victim, mode)
        t0 = time.monotonic()
        try:
            old = _old_master_state(net, victim, victim_addr, keys)  # nothing reaches it from here on
        except Exception as exc:  # noqa: BLE001 - reported, the rest of the scenario still runs
            old = None
            out.failures.append(f"could not read the cut master: {str(exc)[:200]}")

        def promoted() -> bool:
            try:
                return all(net.host_of(cl.master_addr_of(slot[p], asking=survivor)) != victim for p in affected)
            except Exception:  # noqa: BLE001 - the survivor busy failing over
                return False
        failover = wait_until(promoted, 60, 0.1)
        new_owner = {p: cl.master_addr_of(slot[p], asking=survivor) for p in affected} if failover else {}

        def results_safe():
            try:
                return m.stream_results(st.r, prefix)
            except Exception:  # noqa: BLE001 - the client meets the cut master, then learns the new map
                return []
        firsts: dict[str, float] = {}

        def resumed() -> bool:
            got = {r.route_hash for r in results_safe() if r.at_ms > t_cut} & hit
            if got and "first" not in firsts:
                firsts["first"] = time.monotonic() - t0
            return got == hit
        took = wait_until(resumed, lease + 6 * interval + 40)
        resumed_s = time.monotonic() - t0 if took is not None else -1.0
        unrepl = -1
        if failover and old is not None:
            info = cl.node_at(new_owner[affected[0]]).client().info("replication")
            had = int(info.get("second_repl_offset", 0)) - 1  # where the replica was when promoted
            unrepl = max(0, old["offset"] - had) if had >= 0 else -1
        rest = cut_s - (time.monotonic() - t0)
        if rest > 0:
            time.sleep(rest)
        t_restore = int(time.time() * 1000)
        topo.restore(victim)
        r0 = time.monotonic()
        old_node = cl.node_at(victim_addr)

        def rejoined() -> bool:
            try:
                return cl.role(old_node) == "slave" and cl.state_ok()
            except Exception:  # noqa: BLE001
                return False
        rejoin = wait_until(rejoined, 60, 0.25)
        rejoined_s = time.monotonic() - r0 if rejoin is not None else -1.0
        time.sleep(2 * interval)  # a couple of cycles with the old master back as a replica
        c1 = read_counters(st.r, prefix)
        st.stop_processes(("promote", "checks"))
        acc = m.result_accounting(st, interval * 1000)
        routes = m.route_accounting(st)
        results = m.stream_results(st.r, prefix)
        lost_entries = -1
        if old is not None:
            from magpie.queue.streams import ledger_id, stream_space

            held = {ledger_id(i, stream_space(k)) for k, ids in old["ids"].items() for i in ids}
            lost_entries = len(held - {r.stream_id for r in results})
        unaffected = [r for r in results if r.route_hash not in hit]
        gap = _max_gap_ms(unaffected, t_cut, t_restore)
        out.figures = {
            "routes": n, "partitions": partitions, "cut_mode": mode, "victim": victim,
            "affected": "+".join(affected), "affected_routes": len(hit),
            "promoted_on": "+".join(sorted({net.host_of(a) for a in new_owner.values()})) or "-",
            "failover_s": round(failover, 1) if failover is not None else -1.0,
            "resumed_first_s": round(firsts.get("first", -1.0), 1), "resumed_s": round(resumed_s, 1),
            "unaffected_max_gap_s": round(gap / 1000.0, 1),
            "cut_s": round((t_restore - t_cut) / 1000.0, 1), "rejoined_s": round(rejoined_s, 1),
            "unreplicated_bytes": unrepl, "failover_results_lost": lost_entries,
            "stale_refused": c1["stale"] - c0["stale"],
            "lease_lost": c1["checks"].get("lease_lost", 0) - c0["checks"].get("lease_lost", 0),
            "lost": routes["lost"], "duplicated": acc["duplicated"], "results_lost": acc["results_lost"],
            "healthy_dead_lettered": routes["healthy_dead_lettered"], "results": acc["published"],
            "stats_drained": acc["drained"],
        }
        out.expect(bool(affected), "no partition was served by the cut host")
        out.expect(failover is not None, "no replica on another host took over the cut master's slots")
        out.expect(took is not None, "the routes of the cut master's partitions never got checked again")
        # a claim pass touches every partition, so it waits on the cut master too (docs/multinode.md): the
        # other partitions must resume no later than the cut ones, within one normal gap
        limit = (max(resumed_s, 0.0) + 2 * interval + timeout + 1) * 1000
        out.expect(not unaffected or gap <= limit,
                   f"a route of another partition waited {gap / 1000:.1f}s between checks (> {limit / 1000:.0f}s)")
        out.expect(rejoin is not None, "the old master did not rejoin as a replica after the restore")
        out.expect_zero("lost", "duplicated", "results_lost", "healthy_dead_lettered")
    finally:
        if victim is not None:
            topo.restore(victim)
        st.close(keep_logs=log_dir is not None)
    return out


def _max_gap_ms(results, start_ms: int, end_ms: int) -> int:
    """Longest gap between consecutive results of one route in ``[start_ms, end_ms]`` (the first counts
    from ``start_ms``, the last to ``end_ms``)."""
    seen: dict[str, int] = {}
    worst = 0
    for res in results:
        if start_ms <= res.at_ms <= end_ms:
            worst = max(worst, res.at_ms - seen.get(res.route_hash, start_ms))
            seen[res.route_hash] = res.at_ms
    for last in seen.values():
        worst = max(worst, end_ms - last)
    return worst


MULTINODE = {"spread": spread, "link-cut": link_cut, "redis-failover": redis_failover}
"""Name -> scenario of this module (``benchmarks/chaos.py --nodes N`` runs them after the fault suite)."""
