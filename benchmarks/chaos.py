"""Fault suite with figures: every scenario of ``magpie.lab.chaos`` against the Procfile's real processes.

Each scenario starts private Redis servers (schedule, and the broker where it matters) and a database of
its own on one private PostgreSQL cluster (``initdb`` on a free port, created for the run), the judge and
the lab's fault servers, then the Procfile's processes (worker-promote, worker-checks, worker-jobs, beat)
as children of this script, which plays their supervisor; it injects its fault, measures from the stores
(results stream, ``check_history``, the schedule) and stops everything it started by PID. The shared
Redis and PostgreSQL on the default ports are never touched.

Scenarios, each named after the public bug class it reproduces:

  kill-loop                      SIGKILL pool children and whole check workers (celery#1628, kombu#337)
  sigstop-past-lease             SIGSTOP a worker past its leases, SIGCONT (bullmq stalled-lock class)
  poison-route                   a route that kills the process checking it (celery#10462)
  trickle-proxy                  a proxy sending one byte a second
  redis-restarted-empty          the schedule's Redis restarted with no data (celery#1307)
  postgres-stopped-and-read-only PostgreSQL stopped, then read-only (answers pings, refuses writes)
  broker-restart                 the broker's Redis restarted empty
  two-beats                      two beat processes (redbeat#230)
  catch-up-after-downtime        every route an hour overdue (django-celery-beat#459)
  mass-crash                     the whole check worker killed twice with hundreds of routes in flight
  redis-full                     the schedule's Redis at maxmemory (noeviction) during checks and an import

With ``--nodes N`` (root, iproute2) the scenarios run over network namespaces (``magpie.lab.netns``): the
schedule's Redis, PostgreSQL and the lab (judge and fault servers) each on a host of its own, the
Procfile's workers on N node hosts (one beat on node1), all joined by veth links to one bridge; then the
multi-node scenarios ``link-cut`` (a node's link cut mid-run and restored) and ``redis-failover`` (the
schedule on a Redis Cluster over three more hosts, the host of a master cut off and restored) follow
unless ``--scenarios`` is given; ``--scenarios spread`` measures checks per node against slots per node (it fails today: see
docs/multinode.md). ``poison-route`` does not run there
(its server lives in this process, which the nodes cannot reach).

Output: a header (``#`` lines), one ``chaos-scenario name=... <figures> seconds=S ok=0|1`` line per
scenario, and the last line ``chaos scenarios=N lost=L duplicated=D healthy_dead_lettered=H
results_lost=R double_leader_runs=B`` (sums over the scenarios). Exit status 1 when a guarantee broke.

    .venv/bin/python benchmarks/chaos.py --quick        # small sizes, outages of seconds (~6 min)
    .venv/bin/python benchmarks/chaos.py                # full sizes, 60 s database outages (~25 min)
    .venv/bin/python benchmarks/chaos.py --full --scenarios kill-loop   # 30 kills over 120 s, 60 routes
    .venv/bin/python benchmarks/chaos.py --scenarios kill-loop,two-beats --keep-logs
    .venv/bin/python benchmarks/chaos.py --quick --broker amqp   # the broker on RabbitMQ (a vhost per scenario)
    sudo .venv/bin/python benchmarks/chaos.py --quick --nodes 3   # over 3 namespace nodes (~10 min)

``--broker amqp`` runs every scenario with RabbitMQ as the broker: each scenario gets a vhost of its own
(``magpie-test-<random>`` on 127.0.0.1:5672, user guest, deleted afterwards) holding magpie's quorum
queues; ``broker-restart`` then deletes the vhost and creates it again (its queues and messages gone,
every connection closed), since the shared RabbitMQ server itself is never restarted.
"""

from __future__ import annotations

import argparse
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from magpie.lab.chaos import SCENARIOS, run_scenario, summary
from magpie.lab.chaos.base import Outcome
from magpie.lab.chaos.servers import PrivatePostgres, ServerError

NOT_ON_NODES = ("poison-route",)
"""Scenarios that need a server in this process, out of the nodes' reach."""


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="small populations and short outages")
    ap.add_argument("--full", action="store_true",
                    help="the long forms: the kill loop runs until routes meet several crashes (overrides --quick)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of " + ",".join(SCENARIOS))
    ap.add_argument("--log-dir", help="where process logs go (default: a new /tmp/magpie-chaos-* directory)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the logs of every scenario (failed ones are "
                                                              "always kept)")
    ap.add_argument("--broker", choices=("redis", "amqp"), default="redis",
                    help="the Celery broker: private Redis servers (default) or a RabbitMQ vhost per scenario")
    ap.add_argument("--nodes", type=int, default=0,
                    help="run over network namespaces with this many worker nodes (needs root; 0: one host)")
    args = ap.parse_args(argv)
    from magpie.lab.chaos.multinode import MULTINODE

    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if args.nodes:
        if not 1 <= args.nodes <= 20:
            ap.error(f"--nodes must be 1..20: {args.nodes}")
        names = [n for n in names if n not in NOT_ON_NODES]
        if "--scenarios" not in " ".join(argv if argv is not None else sys.argv):
            names += ["link-cut", "redis-failover"]
    unknown = [n for n in names if n not in SCENARIOS and not (args.nodes and n in MULTINODE)]
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="magpie-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)

    print(f"# chaos {time.strftime('%Y-%m-%d %H:%M:%S')} host={platform.node()} python={platform.python_version()} "
          f"mode={'full' if args.full else 'quick' if args.quick else 'default'} broker={args.broker} logs={log_dir}"
          + (f" nodes={args.nodes}" if args.nodes else ""), flush=True)
    if args.broker == "amqp":
        from magpie.lab.rabbitmq import HOST, PORT, reachable

        if not reachable():
            print(f"chaos: RabbitMQ is not reachable on {HOST}:{PORT} (make services starts it)", file=sys.stderr)
            return 2
        if args.nodes:
            print("chaos: --nodes runs with the namespace Redis as the broker; drop --broker amqp", file=sys.stderr)
            return 2
    net = None
    try:
        if args.nodes:
            from magpie.lab.chaos.netstack import Net
            from magpie.lab.netns import NetnsError

            try:
                net = Net(nodes=args.nodes, cluster_hosts=3).start()  # rc1..3 for redis-failover
            except NetnsError as exc:
                print(f"chaos: {exc}", file=sys.stderr)
                return 2
            pg = net.pg
            print(f"# topology {net.topo.cidr} hosts={','.join(net.topo.hosts)}", flush=True)
        else:
            pg = PrivatePostgres()
            pg.start()
    except ServerError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        if net is not None:
            net.close()
        return 2
    outcomes = []
    try:
        for name in names:
            if name in MULTINODE and net is not None:
                t0 = time.monotonic()
                try:
                    out = MULTINODE[name](net, log_dir=log_dir)
                except Exception as exc:  # noqa: BLE001 - reported as a failed scenario
                    why = f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:300]}"
                    out = Outcome(name, "?", failures=[why])
                out.seconds = time.monotonic() - t0
            else:
                out = run_scenario(name, pg, quick=args.quick, log_dir=log_dir, keep_logs=True,
                                   full=args.full, broker=args.broker, net=net)
            outcomes.append(out)
            print(out.line(), flush=True)
            for f in out.failures:
                print(f"#   broken: {f}", flush=True)
            if not out.failures and not args.keep_logs:
                import shutil

                shutil.rmtree(log_dir / name, ignore_errors=True)
    except KeyboardInterrupt:
        print("# interrupted; everything started was stopped", flush=True)
        return 130
    finally:
        if net is not None:
            net.close()
        else:
            pg.destroy()
    print(summary(outcomes), flush=True)
    return 1 if any(o.failures for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
