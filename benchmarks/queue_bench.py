"""Route-schedule benchmark: import rate, claim+complete cycles/s, Redis memory per route, the
no-script ceiling for the same data movement, and the dequeue (payload decode) cost with queue credential
encryption (``PROXY_QUEUE_ENCRYPT_CREDENTIALS``) off and on, all measured in one run against the local Redis.

    .venv/bin/python benchmarks/queue_bench.py [--routes 1000000] [--seconds 5] [--batch 64] [--procs 2]
        [--encrypt]
    .venv/bin/python benchmarks/queue_bench.py --backend postgresql [--routes 100000] [--sustain 60]
    .venv/bin/python benchmarks/queue_bench.py --partitions 4 [--routes 200000] [--seconds 5]
    .venv/bin/python benchmarks/queue_bench.py --cluster [--routes 20000] [--seconds 2] [--rounds 2]

``--partitions N`` compares the partitioned schedule (``MAGPIE_SCHEDULE_PARTITIONS=N``) with one partition on
the same Redis in the same run: the same routes imported into each, then claim+complete cycles (routes/s, one
route and ``--batch`` routes per call, one process and ``--procs`` processes), each N-partition figure with its
ratio to the one-partition figure (best of ``--rounds`` alternating rounds of each, default 3).

``--cluster`` starts its own servers (one plain ``redis-server`` and a ``magpie.lab.cluster.LocalCluster``,
3 masters + 3 replicas, all on free loopback ports, stopped by PID at the end) and measures, in one run,
claim+complete routes/s (one route per call, ``--batch`` per call, and ``--batch`` per call from ``--procs``
processes) of: one partition on the plain server (the baseline), 1, 2 and 3 partitions on the cluster
(partition K's slot moved to master K mod 3 first; the placement is printed), and one partition on the
cluster with ``WAIT 1`` after every claim and completion (``MAGPIE_REDIS_WAIT_REPLICAS=1``). Each figure has
its ratio to the baseline and the Redis CPU per route (``INFO cpu`` used_cpu_sys + used_cpu_user deltas
summed over the servers, masters and replicas separately, divided by the routes cycled), the figure that
carries over to bigger machines. Lines start with ``queue_bench `` and are key=value pairs. A default run
takes about 70 s.

``--backend postgresql`` runs the same workload (import, claim+complete one route and ``--batch`` routes per
call, ``--procs`` processes) on Redis and on the PostgreSQL schedule in a private database created for the
run, and prints the Redis/PostgreSQL ratio per figure (routes/s). ``--sustain S`` then runs claim + start mark
+ heartbeat + complete for S seconds per table layout (fillfactor 100, fillfactor 70, and fillfactor 70 with
a transaction holding a snapshot open, the xmin-horizon hazard) and reports dead tuples, HOT updates and
table growth from ``pg_stat_user_tables``.

``--encrypt`` imports the payloads with their credentials sealed (as ``PROXY_QUEUE_ENCRYPT_CREDENTIALS``
does), so the memory per route and the cycle rates are those of encrypted payloads.

Uses ``MAGPIE_REDIS_URL`` with its own key prefix and deletes everything it wrote at the end. Prints each
figure, our batched rate as a ratio of the ceiling, and one summary line of key=value pairs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import uuid

import redis

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only
from magpie.base import redisconn  # noqa: E402
from magpie.base.crypto import get_keyring  # noqa: E402
from magpie.queue import Payload, QueueKeys, RouteQueue  # noqa: E402
from magpie.base.routes import Route  # noqa: E402

from workload import SHARDS, URL, payload_for  # noqa: E402


def decode_cost(n: int = 20_000, rounds: int = 5) -> tuple[float, float, int]:
    """Microseconds per :meth:`Payload.decode` of a plaintext (version 1) and of a sealed (version 2)
    payload of :func:`payload_for`'s shape (best of ``rounds`` over ``n`` payloads), and the sealed size."""
    cipher = get_keyring("bench-key-0123456789abcdef").queue
    plain = [payload_for(i)[1] for i in range(n)]
    sealed = [Payload.decode(p).encode(cipher) for p in plain]

    def best(texts, c):
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for t in texts:
                Payload.decode(t, c)
            times.append(time.perf_counter() - t0)
        return min(times) / len(texts) * 1e6

    return best(plain, None), best(sealed, cipher), len(sealed[12345 % n])


PARTITIONS = 1
"""Partitions of the schedule :func:`queue` builds (``--partitions``; set per run of :func:`cycles_ours`)."""


def queue(prefix: str, partitions: int | None = None, url: str | None = None, wait: int = 0):
    """The schedule under ``prefix`` on ``url`` (default ``MAGPIE_REDIS_URL``; a ``redis+cluster://`` URL
    gives a cluster client): a :class:`RouteQueue` for one partition, else a :class:`PartitionedSchedule`.
    Interval 1 ms (every completed route is due again at once, so the supply never runs out), lease 300 s;
    ``wait`` > 0 sends ``WAIT <wait> 1000`` after every claim and completion (``MAGPIE_REDIS_WAIT_REPLICAS``
    with a 1 s timeout)."""
    n = PARTITIONS if partitions is None else partitions
    client = redisconn.connect(url or URL)
    if n > 1:
        from magpie.queue.partitioned import PartitionedSchedule

        q = PartitionedSchedule(client, prefix, SHARDS, n, interval_ms=1, lease_ms=300_000,
                                tagged=redisconn.is_cluster(client) or None)
    else:
        q = RouteQueue(client, QueueKeys(prefix, SHARDS), interval_ms=1, lease_ms=300_000)
    for part in getattr(q, "parts", [q]):
        part.wait_replicas, part.wait_timeout_ms = wait, 1000
    return q


def cycle_run(prefix: str, batch: int, seconds: float, partitions: int | None = None, url: str | None = None,
              wait: int = 0) -> tuple[float, int]:
    """Claim+complete cycles through pop.lua + complete.lua, ``batch`` routes per call, for ``seconds`` s.
    Returns ``(routes/s, routes completed)``."""
    q = queue(prefix, partitions, url, wait)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        leases = q.pop(batch)
        codes = q.complete(leases)
        n += sum(1 for c in codes if c == 1)
    return n / (time.perf_counter() - t0), n


def cycles_ours(prefix: str, batch: int, seconds: float, out=None, partitions: int | None = None,
                url: str | None = None, wait: int = 0) -> float:
    """Claim+complete cycles (routes/s) through pop.lua + complete.lua, ``batch`` routes per call
    (:func:`cycle_run`); with ``out`` (a multiprocessing queue) also puts ``(routes/s, routes)`` there."""
    rate, n = cycle_run(prefix, batch, seconds, partitions, url, wait)
    if out is not None:
        out.put((rate, n))
    return rate


def cycles_ceiling(prefix: str, batch: int, seconds: float, out=None) -> float:
    """The same data movement with no script and no fencing: ZRANGE BYSCORE LIMIT, MGET + ZADD (lease),
    ZADD (next due), pipelined, from the same client setup. Routes/s."""
    r = redis.Redis.from_url(URL)
    k = QueueKeys(prefix, SHARDS)
    shards = k.all_shards()
    n, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        shard = shards[i % len(shards)]
        i += 1
        now = int(time.time() * 1000)
        rows = r.zrange(shard, "-inf", now, byscore=True, offset=0, num=batch, withscores=True)
        if not rows:
            continue
        members = [m for m, _ in rows]
        p = r.pipeline(transaction=False)
        p.mget([k.payload_prefix + m.decode() for m in members])
        p.zadd(shard, {m: now + 300_000.5 for m in members})
        p.execute()
        r.zadd(shard, {m: now + 1 for m in members})
        n += len(members)
    rate = n / (time.perf_counter() - t0)
    if out is not None:
        out.put((rate, n))
    return rate


def parallel_run(fn, prefix: str, batch: int, seconds: float, procs: int, *extra) -> tuple[float, int]:
    """``fn`` (:func:`cycles_ours` or :func:`cycles_ceiling`) in ``procs`` processes at once. Returns
    ``(summed routes/s, summed routes)``."""
    out = mp.Queue()
    ps = [mp.Process(target=fn, args=(prefix, batch, seconds, out, *extra)) for _ in range(procs)]
    for p in ps:
        p.start()
    got = [out.get() for _ in ps]
    for p in ps:
        p.join()
    return sum(r for r, _ in got), sum(n for _, n in got)


def parallel(fn, prefix: str, batch: int, seconds: float, procs: int, *extra) -> float:
    """Summed routes/s of :func:`parallel_run`."""
    return parallel_run(fn, prefix, batch, seconds, procs, *extra)[0]


def main() -> int:
    if "--backend" in sys.argv and "postgresql" in sys.argv:
        from pg_bench import main as pg_main

        return pg_main(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["redis", "postgresql"], default="redis")
    ap.add_argument("--routes", type=int, default=None,
                    help="routes imported (default 1,000,000; with --cluster 20,000 per configuration)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="seconds per figure (default 5; with --cluster 2)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--encrypt", action="store_true", help="import payloads with sealed credentials")
    ap.add_argument("--partitions", type=int, default=1,
                    help="compare N partitions with one partition (claim+complete routes/s, same run)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="with --partitions / --cluster: alternating rounds per figure, the best of each kept "
                         "(default 3; with --cluster 2)")
    ap.add_argument("--cluster", action="store_true",
                    help="1, 2 and 3 partitions on a private local Redis Cluster (3 masters + 3 replicas) "
                         "against one private redis-server, with Redis CPU per route")
    a = ap.parse_args()
    for name, plain, clustered in (("routes", 1_000_000, 20_000), ("seconds", 5.0, 2.0), ("rounds", 3, 2)):
        if getattr(a, name) is None:
            setattr(a, name, clustered if a.cluster else plain)
    if a.routes < 1 or a.seconds <= 0 or a.rounds < 1 or a.batch < 1 or a.procs < 1:
        ap.error("--routes, --seconds, --rounds, --batch and --procs must be positive")
    if a.cluster:
        return compare_cluster(a)
    if a.partitions > 1:
        return compare_partitions(a)
    cipher = get_keyring("bench-key-0123456789abcdef").queue if a.encrypt else None

    def item(i: int) -> tuple[str, str]:
        h, p = payload_for(i)
        return (h, Payload.decode(p).encode(cipher)) if cipher else (h, p)

    prefix = f"magpie-bench:{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(URL)
    q = queue(prefix)
    try:
        sample = item(12345)[1]
        print(f"routes={a.routes} shards={SHARDS} payload_bytes={len(sample)} encrypted={a.encrypt} "
              f"batch={a.batch} "
              f"seconds_per_figure={a.seconds} procs={a.procs}")
        r.execute_command("MEMORY", "PURGE") if hasattr(r, "execute_command") else None
        mem0 = int(r.info("memory")["used_memory"])
        t0 = time.perf_counter()
        chunk = 10_000
        for off in range(0, a.routes, chunk):
            q.schedule((item(i) for i in range(off, min(off + chunk, a.routes))), total=a.routes,
                       start_index=off, batch=500)
        import_s = time.perf_counter() - t0
        mem1 = int(r.info("memory")["used_memory"])
        per_route = (mem1 - mem0) / a.routes
        import_rate = a.routes / import_s
        print(f"import: {import_rate:,.0f} routes/s ({import_s:.1f} s)")
        print(f"redis memory: {per_route:.0f} bytes/route (used_memory delta {(mem1 - mem0) / 2**20:.1f} MiB)")
        time.sleep(0.01)

        single = cycles_ours(prefix, 1, a.seconds)
        print(f"ours, one process, 1 route per script call: {single:,.0f} routes/s")
        batched = cycles_ours(prefix, a.batch, a.seconds)
        print(f"ours, one process, {a.batch} routes per script call: {batched:,.0f} routes/s")
        ceil_single = cycles_ceiling(prefix, 1, a.seconds)
        print(f"ceiling (no script, no fencing), one process, 1 route per round: {ceil_single:,.0f} routes/s")
        ceiling = cycles_ceiling(prefix, a.batch, a.seconds)
        print(f"ceiling (no script, no fencing), one process, {a.batch} routes per round: {ceiling:,.0f} routes/s")
        multi = parallel(cycles_ours, prefix, a.batch, a.seconds, a.procs)
        print(f"ours, {a.procs} processes, {a.batch} per call: {multi:,.0f} routes/s")
        multi_ceiling = parallel(cycles_ceiling, prefix, a.batch, a.seconds, a.procs)
        print(f"ceiling, {a.procs} processes, {a.batch} per round: {multi_ceiling:,.0f} routes/s")
        ratio = batched / ceiling
        print(f"ratio ours/ceiling, batched one process: {ratio:.2f}; unbatched: {single / ceil_single:.2f}; "
              f"{a.procs} processes: {multi / multi_ceiling:.2f}")
        us_plain, us_sealed, sealed_bytes = decode_cost()
        print(f"dequeue decode: {us_plain:.2f} us/payload plaintext, {us_sealed:.2f} us/payload with "
              f"PROXY_QUEUE_ENCRYPT_CREDENTIALS (AES-SIV, {sealed_bytes}-byte payload): "
              f"ratio {us_sealed / us_plain:.2f}")
        print(f"summary routes={a.routes} import_routes_per_s={import_rate:.0f} routes_per_s={batched:.0f} "
              f"routes_per_s_single={single:.0f} routes_per_s_multi={multi:.0f} ceiling_routes_per_s={ceiling:.0f} "
              f"ceiling_ratio={ratio:.2f} bytes_per_route={per_route:.0f} decode_us={us_plain:.2f} "
              f"decode_us_encrypted={us_sealed:.2f}")
    finally:
        keys = list(r.scan_iter(match=f"*{prefix}*", count=10_000))
        for i in range(0, len(keys), 10_000):
            r.delete(*keys[i: i + 10_000])
    return 0


def compare_partitions(a) -> int:
    """``--partitions N``: the same routes in a one-partition and an N-partition schedule, claim+complete
    routes/s of each, and the N/1 ratio of each figure."""
    from magpie.queue.partitions import partition_names

    partition_names(a.partitions)  # range check: 1..1024
    prefixes = {1: f"magpie-bench:{uuid.uuid4().hex[:8]}:", a.partitions: f"magpie-bench:{uuid.uuid4().hex[:8]}:"}
    r = redis.Redis.from_url(URL)
    print(f"routes={a.routes} shards={SHARDS} partitions=1 vs {a.partitions} batch={a.batch} "
          f"seconds_per_figure={a.seconds} procs={a.procs} (one Redis)")
    try:
        for n, prefix in prefixes.items():
            q = queue(prefix, n)
            t0 = time.perf_counter()
            for off in range(0, a.routes, 10_000):
                q.schedule((payload_for(i) for i in range(off, min(off + 10_000, a.routes))), total=a.routes,
                           start_index=off, batch=500)
            print(f"import, {n} partition(s): {a.routes / (time.perf_counter() - t0):,.0f} routes/s")
        time.sleep(0.01)
        rows = []
        for label, fn in (("1 route per call, one process", lambda p, n: cycles_ours(p, 1, a.seconds, None, n)),
                          (f"{a.batch} routes per call, one process",
                           lambda p, n: cycles_ours(p, a.batch, a.seconds, None, n)),
                          (f"{a.batch} routes per call, {a.procs} processes",
                           lambda p, n: parallel(cycles_ours, p, a.batch, a.seconds, a.procs, n))):
            ones, manys = [], []
            for _ in range(a.rounds):  # alternate, best of each: a shared machine's load swings a lot
                ones.append(fn(prefixes[1], 1))
                manys.append(fn(prefixes[a.partitions], a.partitions))
            one, many = max(ones), max(manys)
            rows.append((label, one, many))
            print(f"claim+complete, {label}: 1 partition {one:,.0f} routes/s, {a.partitions} partitions "
                  f"{many:,.0f} routes/s, ratio {many / one:.2f} (best of {a.rounds} alternating rounds)")
        print("summary " + " ".join(f"ratio_{i}={many / one:.2f}" for i, (_, one, many) in enumerate(rows))
              + f" partitions={a.partitions} routes_per_s_1={rows[1][1]:.0f} routes_per_s_n={rows[1][2]:.0f}")
    finally:
        for prefix in prefixes.values():
            keys = list(r.scan_iter(match=f"*{prefix}*", count=10_000))
            for i in range(0, len(keys), 10_000):
                r.delete(*keys[i: i + 10_000])
    return 0


def server_cpu_s(client: redis.Redis) -> float:
    """CPU seconds a redis-server has used so far (``INFO cpu`` ``used_cpu_sys + used_cpu_user``)."""
    i = client.info("cpu")
    return float(i["used_cpu_sys"]) + float(i["used_cpu_user"])


def server_command_us(client: redis.Redis) -> int:
    """Microseconds a redis-server has spent executing commands so far (``INFO commandstats`` usec summed,
    ``INFO`` itself left out): the scripts' own work, without the event loop, network and replication."""
    return sum(int(v["usec"]) for k, v in client.info("commandstats").items() if k != "cmdstat_info")


def compare_cluster(a) -> int:
    """``--cluster``: claim+complete routes/s and Redis CPU per route of one partition on one private
    redis-server (the baseline), and of 1, 2 and 3 partitions (also ``--partitions`` when more) and of one
    partition with ``WAIT 1`` on a private local Redis Cluster (3 masters + 3 replicas), each partition's
    slot placed on its own master (partition K on master K mod 3). Every server is started here and stopped
    by PID at the end; the shared Redis is not touched. Prints ``queue_bench ...`` key=value lines."""
    from magpie.lab.cluster import LocalCluster, key_slot
    from magpie.queue.partitions import partition_names

    from workload import PrivateRedis

    counts = sorted({1, 2, 3, max(a.partitions, 1)})
    partition_names(counts[-1])  # range check: 1..1024
    figures = list(dict.fromkeys([(1, 1), (a.batch, 1), (a.batch, a.procs)]))  # (routes per call, processes)
    print(f"queue_bench setup routes={a.routes} shards={SHARDS} batch={a.batch} procs={a.procs} "
          f"seconds_per_figure={a.seconds} rounds={a.rounds} cluster_partitions={','.join(map(str, counts))}")
    plain = PrivateRedis()
    cluster = LocalCluster()
    try:
        t0 = time.perf_counter()
        cluster.start()
        print(f"local cluster (3 masters + 3 replicas) up in {time.perf_counter() - t0:.1f} s")
        masters = cluster.masters_ports()
        for k, name in enumerate(partition_names(counts[-1])):  # p0 -> master 0, p1 -> master 1, ...
            cluster.migrate_slot(key_slot("{" + name + "}"), masters[k % len(masters)])
        cluster.wait_ok()
        nodes = {n.port: n.client() for n in cluster.nodes}
        roles = {p: ("master" if c.info("replication")["role"] == "master" else "replica")
                 for p, c in nodes.items()}

        # (config, partitions, url, wait, prefix, {port: role})
        configs = [("single", 1, plain.url, 0, "magpie-bench:single:", {plain.port: "master"})]
        for n in counts:
            configs.append(("cluster", n, cluster.url, 0, f"magpie-bench:p{n}:", roles))
        configs.append(("cluster-wait1", 1, cluster.url, 1, "magpie-bench:p1:", roles))
        clients = {plain.port: plain.client, **nodes}
        for config, n, url, wait, prefix, _ in configs:
            if wait:
                continue  # the same routes as the one-partition cluster figure
            if config == "cluster":
                for name in partition_names(n):
                    slot = key_slot("{" + name + "}")
                    print(f"queue_bench placement partitions={n} partition={name} slot={slot} "
                          f"master=127.0.0.1:{cluster.master_port_of(slot)}")
            q = queue(prefix, n, url)
            t0 = time.perf_counter()
            for off in range(0, a.routes, 10_000):
                q.schedule((payload_for(i) for i in range(off, min(off + 10_000, a.routes))), total=a.routes,
                           start_index=off, batch=500)
            rate = a.routes / (time.perf_counter() - t0)
            print(f"import, {config} {n} partition(s): {rate:,.0f} routes/s")

        # per (config index, figure): best routes/s of the rounds; routes and CPU s per port summed over them
        best: dict = {}
        routes: dict = {}
        cpu: dict = {}
        commands: dict = {}
        for _ in range(a.rounds):  # alternate: a shared machine's load swings a lot
            for fig in figures:
                for ci, (config, n, url, wait, prefix, ports) in enumerate(configs):
                    before = {p: server_cpu_s(clients[p]) for p in ports}
                    cmd0 = sum(server_command_us(clients[p]) for p, role in ports.items() if role == "master")
                    batch, procs = fig
                    if procs == 1:
                        rate, done = cycle_run(prefix, batch, a.seconds, n, url, wait)
                    else:
                        rate, done = parallel_run(cycles_ours, prefix, batch, a.seconds, procs, n, url, wait)
                    cmd1 = sum(server_command_us(clients[p]) for p, role in ports.items() if role == "master")
                    after = {p: server_cpu_s(clients[p]) for p in ports}
                    key = (ci, fig)
                    best[key] = max(best.get(key, 0.0), rate)
                    routes[key] = routes.get(key, 0) + done
                    commands[key] = commands.get(key, 0) + cmd1 - cmd0
                    per_port = cpu.setdefault(key, {})
                    for p in ports:
                        per_port[p] = per_port.get(p, 0.0) + after[p] - before[p]

        print("Redis CPU per route (sum over the servers of INFO cpu used_cpu_sys + used_cpu_user deltas "
              "/ routes cycled) is the figure that carries over to bigger machines; on this machine's "
              "shared cores the servers, the benchmark's processes and other load compete, so routes/s "
              "totals do not scale here. master_bound_routes_per_s = 1e6 / the busiest master's CPU us per "
              "route: the rate that saturates that master's core if it has one of its own (clients not the "
              "limit). master_command_us_per_route: the masters' INFO commandstats usec per route (the "
              "commands' own execution; the rest of the CPU is the event loop, network and replication).")
        for fig in figures:
            batch, procs = fig
            base = best[(0, fig)]
            for ci, (config, n, _url, wait, _prefix, ports) in enumerate(configs):
                key = (ci, fig)
                done = max(routes[key], 1)
                m = sum(v for p, v in cpu[key].items() if ports[p] == "master")
                r = sum(v for p, v in cpu[key].items() if ports[p] != "master")
                busiest = max(v for p, v in cpu[key].items() if ports[p] == "master") / done * 1e6
                extra = ""
                if wait:  # configs[1]: one partition on the cluster without WAIT
                    extra = f" ratio_to_cluster_no_wait={best[key] / best[(1, fig)]:.2f}"
                print(f"queue_bench config={config} partitions={n} batch={batch} procs={procs} "
                      f"routes_per_s={best[key]:.0f} ratio_to_single={best[key] / base:.2f} "
                      f"redis_cpu_us_per_route={(m + r) / done * 1e6:.1f} "
                      f"master_cpu_us_per_route={m / done * 1e6:.1f} "
                      f"replica_cpu_us_per_route={r / done * 1e6:.1f} "
                      f"busiest_master_cpu_us_per_route={busiest:.1f} "
                      f"master_command_us_per_route={commands[key] / done:.1f} "
                      f"master_bound_routes_per_s={1e6 / max(busiest, 1e-9):.0f}{extra}")
    finally:
        cluster.stop()
        plain.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
