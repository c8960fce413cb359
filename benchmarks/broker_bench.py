"""Broker benchmark: magpie-sized check messages dispatched and consumed through a real worker, on Redis and on
RabbitMQ (quorum queues) in the same run.

Each message is what promote sends: one ``magpie.check_routes`` task whose argument is a sealed list of
``--leases`` lease dicts (default 250, ``routes_per_task``), published with the same options as
:func:`magpie.wiring.tasks._dispatch_checks`, under magpie's own Celery configuration for that broker
(:func:`magpie.wiring.celery_config.build`: quorum queues, publisher confirms, heartbeats on RabbitMQ; plain
lists under a key prefix on Redis). A real ``celery worker -Q checks --concurrency=2`` (this file is its
app) consumes them; its task only counts the message in Redis, so the figures are the broker's and
Celery's, not the checks'. Per broker and round: dispatch rate (publishes/s, confirms included) and
end-to-end rate (first publish to last message consumed, tasks/s).

Brokers: ``redis`` (the test Redis, database 15, own key prefix), ``amqp`` (a vhost of its own on
127.0.0.1:5672, deleted afterwards) and ``amqp-noconfirm`` (the same without publisher confirms: what the
confirms cost). Rounds alternate the brokers; the last lines give the median of each and the ratio to
Redis, the baseline.

    .venv/bin/python benchmarks/broker_bench.py [--tasks 2000] [--leases 250] [--rounds 3]
        [--brokers redis,amqp,amqp-noconfirm]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celery import Celery  # noqa: E402

REDIS_URL = os.environ.get("MAGPIE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
KEY = "broker-bench-key-0123456789abcdef"


def _settings(broker_url: str, key_prefix: str):
    from magpie.config import load_settings

    return load_settings(broker_url=broker_url, broker_key_prefix=key_prefix, redis_url=REDIS_URL,
                         encryption_key=KEY)


def make_app(broker_url: str, key_prefix: str, confirm: bool = True) -> Celery:
    """A Celery app with magpie's configuration for ``broker_url`` and a counting ``magpie.check_routes``."""
    from magpie.wiring.celery_config import build

    app = Celery("broker-bench", set_as_current=False)
    conf = build(_settings(broker_url, key_prefix))
    conf["task_queues"] = [q for q in conf["task_queues"] if q.name == "checks"]  # the one queue used here
    if not confirm:
        conf["broker_transport_options"] = {}
    app.conf.update(conf)
    return app


# -- the worker's side: `celery -A broker_bench worker` with BROKER_BENCH_* in the environment ------------------

if os.environ.get("BROKER_BENCH_URL"):
    app = make_app(os.environ["BROKER_BENCH_URL"], os.environ.get("BROKER_BENCH_PREFIX", ""))
    _counter = os.environ["BROKER_BENCH_COUNTER"]
    _redis = None

    @app.task(name="magpie.check_routes", ignore_result=True)
    def check_routes(sealed: str) -> int:
        global _redis
        if _redis is None:
            import redis

            _redis = redis.Redis.from_url(REDIS_URL)
        _redis.incr(_counter)
        return len(sealed)


# -- the benchmark's side --------------------------------------------------------------------------------------

def _message(leases: int) -> str:
    """A sealed list of ``leases`` lease dicts shaped like promote's (payload JSON with credentials)."""
    import json

    from magpie.queue.seal import get_seal

    now = int(time.time() * 1000)
    rows = [{"member": f"{i:016x}", "payload": json.dumps({"p": "http", "h": f"10.{i >> 16 & 255}.{i >> 8 & 255}."
                                                           f"{i & 255}", "o": 8080 + i % 1000, "u": "user",
                                                           "s": "secret-pass", "w": "bench"}),
             "previous_score": float(now), "lease_score": now + 300_000.5, "shard": i % 16, "stalled": 0,
             "retry_attempts": 0, "server_offset_ms": 0, "alone": False, "claimed_ms": now, "dispatched_ms": now}
            for i in range(leases)]
    return get_seal(KEY).seal(rows)


def run_once(kind: str, tasks: int, leases: int, log_dir: Path) -> dict:
    """Start a worker on broker ``kind``, send ``tasks`` messages, wait for all; figures of the run."""
    import redis

    from magpie.queue.seal import describe

    r = redis.Redis.from_url(REDIS_URL)
    tag = uuid.uuid4().hex[:8]
    counter = f"magpie-bench:{tag}:consumed"
    vhost = None
    if kind == "redis":
        url, prefix = REDIS_URL, f"magpie-bench:{tag}:broker:"
    else:
        from magpie.lab.rabbitmq import Vhost

        vhost = Vhost(prefix="magpie-test-bench-").create()
        url, prefix = vhost.url, ""
    env = {**os.environ, "BROKER_BENCH_URL": url, "BROKER_BENCH_PREFIX": prefix, "BROKER_BENCH_COUNTER": counter,
           "PYTHONPATH": str(ROOT)}
    for k in [k for k in env if k.startswith("MAGPIE_") and k != "MAGPIE_BENCH_REDIS_URL"]:
        env.pop(k)
    log = open(log_dir / f"worker-{kind}-{tag}.log", "w")
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "broker_bench", "worker", "-Q", "checks",
                               "--concurrency=2", "-n", f"bench-{tag}@%h", "--without-mingle", "--without-gossip",
                               "--loglevel=warning"], cwd=ROOT / "benchmarks", env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    app = make_app(url, prefix, confirm=kind != "amqp-noconfirm")
    body = _message(leases)
    try:
        def wait_count(n: int, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while int(r.get(counter) or 0) < n:
                if worker.poll() is not None:
                    raise RuntimeError(f"{kind} worker exited; see {log.name}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{kind}: {r.get(counter)} of {n} consumed after {timeout:g}s; see {log.name}")
                time.sleep(0.01)

        with app.producer_or_acquire() as producer:
            app.send_task("magpie.check_routes", args=[body], queue="checks", producer=producer)  # warm-up
            wait_count(1, 120)
            t0 = time.perf_counter()
            for _ in range(tasks):
                app.send_task("magpie.check_routes", args=[body], queue="checks", producer=producer,
                              argsrepr=describe(leases), kwargsrepr="{}")
            t_sent = time.perf_counter()
        wait_count(tasks + 1, 600)
        t_done = time.perf_counter()
    finally:
        import signal

        try:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        log.close()
        app.close()
        r.delete(counter)
        keys = list(r.scan_iter(match=f"*magpie-bench:{tag}:*", count=10_000))
        if keys:
            r.delete(*keys)
        r.close()
        if vhost:
            vhost.delete()
    return {"dispatch_per_s": tasks / (t_sent - t0), "e2e_per_s": tasks / (t_done - t0), "bytes": len(body)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=2000, help="check messages per round and broker")
    ap.add_argument("--leases", type=int, default=250, help="leases per message (promote's routes_per_task)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--brokers", default="redis,amqp,amqp-noconfirm")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.brokers.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("redis", "amqp", "amqp-noconfirm")]
    if bad or not kinds:
        ap.error(f"--brokers: unknown {', '.join(bad) or '(none)'}; known: redis, amqp, amqp-noconfirm")
    if args.tasks < 1 or args.leases < 1 or args.rounds < 1:
        ap.error("--tasks, --leases and --rounds must be at least 1")
    if any(k.startswith("amqp") for k in kinds):
        from magpie.lab.rabbitmq import HOST, PORT, reachable

        if not reachable():
            print(f"broker_bench: RabbitMQ is not reachable on {HOST}:{PORT}", file=sys.stderr)
            return 2
    log_dir = Path(tempfile.mkdtemp(prefix="magpie-broker-bench-"))
    print(f"# broker_bench {time.strftime('%Y-%m-%d %H:%M:%S')} tasks={args.tasks} leases={args.leases} "
          f"rounds={args.rounds} worker=--concurrency=2 logs={log_dir}", flush=True)
    got: dict[str, list[dict]] = {k: [] for k in kinds}
    for rnd in range(args.rounds):
        for kind in kinds:
            f = run_once(kind, args.tasks, args.leases, log_dir)
            got[kind].append(f)
            print(f"round={rnd + 1} broker={kind} message_bytes={f['bytes']} dispatch_per_s={f['dispatch_per_s']:.0f} "
                  f"tasks_per_s={f['e2e_per_s']:.0f}", flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("dispatch_per_s", "e2e_per_s")} for k, v in got.items()}
    base = med.get("redis")
    for kind, m in med.items():
        ratio = (f" ratio_to_redis={m['e2e_per_s'] / base['e2e_per_s']:.2f} "
                 f"dispatch_ratio_to_redis={m['dispatch_per_s'] / base['dispatch_per_s']:.2f}") if base else ""
        print(f"broker={kind} median tasks_per_s={m['e2e_per_s']:.0f} dispatch_per_s={m['dispatch_per_s']:.0f}{ratio}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
