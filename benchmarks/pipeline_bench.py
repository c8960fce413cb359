"""End-to-end pipeline benchmark: the Procfile's real processes on fault-lab route populations.

For every population and path it starts a judge and the lab's fault servers (``magpie.lab.faults``, each
with enough never-accepting tarpit ports for the population: ``magpie.lab.tarpit``), creates a fresh
PostgreSQL database (migrated by the path's own ``magpie db upgrade``), imports the population with the
path's own ``magpie import`` into a fresh Redis key prefix (broker on its own Redis database with its own
key prefix), starts the path's Procfile processes through honcho (beat -> promote -> check -> complete ->
stream -> PostgreSQL ingestion), waits for the first claims plus ``--warmup`` seconds, measures for
``--seconds``, stops everything and drops/deletes what it created. It prints a header, one ``pipeline``
line per population and path and one ``pipeline-ratio`` line per population (new/baseline for the key
figures, both measured in the same run).

Paths:
  engine    the work tree (its Procfile), run from a snapshot taken at start
  baseline  ``--baseline-ref`` (default daf0a42, the thread-based checker; any ref with the current
            Procfile layout, e.g. 7adb9e4), extracted with ``git archive`` to a temporary directory and
            run from there (its own Procfile, celeryconfig.py, lua/ and magpie package; the same virtualenv)

Populations: live (echo), refused, tarpit (http and socks5 alternating, spread over the tarpit ports),
mix (70 % tarpit, 10 % refused, 15 % echo, 5 % slow: echo after 2 s), trickle (one trickle route among
echo routes). The mix measures one interval after one interval of warm-up unless ``--seconds`` /
``--warmup`` say otherwise.

The one-node goal (1,000,000 routes of the mix on a 300 s interval; ~15 min per path, the import included)
and its quick form (200,000 routes on 60 s; ~4 min per path)::

    .venv/bin/python benchmarks/pipeline_bench.py --population mix --routes 1000000 --interval 300 \
        --baseline-ref 7adb9e4
    .venv/bin/python benchmarks/pipeline_bench.py --quick-mix --baseline-ref 7adb9e4
    .venv/bin/python benchmarks/pipeline_bench.py --population mix --routes 20000 --interval 30 \
        --seconds 30 --skip-baseline                              # a short check of the harness

Figures per line (window = ``--seconds`` after warm-up):
  checks_per_s / pg_rows_per_s  check_history rows added in the window / window (end to end)
  ideal_per_s             deadline_routes / (interval + attempts * timeout) + others / interval
                          (deadline routes: tarpit, trickle; next due = max(due, now) + interval)
  achieved_ratio          checks_per_s / ideal_per_s
  completed_per_s         results published to the stream (metrics counters alive+dead) / window
  demand_per_s            routes / interval
  p50/p99_lateness_s      from the check-lateness histogram delta (bucket interpolation)
  oldest_lateness_s       max over 1 s samples of now minus the oldest claimable route's due time
  c2s_p50_s / c2s_p99_s   claim-to-start histogram delta (``read_counters()["claim_to_start"]``);
                          c2s_<stage>_p99_s per stage; nan for a tree without these counters
  leases_out_min/med/max  live leases of the schedule, sampled once a second
  in_flight_min/med/max   checks running, summed over the check processes' instance-registry reports
                          (in_flight_source=registry; MAGPIE_INSTANCE_HEARTBEAT=2 s), else the check
                          processes' open sockets (in_flight_source=sockets)
  peak_inflight_per_process  max over 0.5 s samples and worker-checks processes of open TCP sockets
  peak_fds_<proc>         max over samples of the open fds of one process of that Procfile process (or
                          lab process: judge, faults<i>)
  lab_conns_peak          max over samples of the fault servers' open sockets (the tarpit holds none)
  cpu_us_per_check        all in: (magpie processes + Redis + PostgreSQL) CPU in the window / checks
  cpu_us_per_check_<proc> per Procfile process (all its processes: shell, Celery main, pool children)
  redis_cpu_us_per_check  Redis ``INFO cpu`` (used_cpu_user + used_cpu_sys) delta / checks
  pg_cpu_us_per_check     every ``postgres`` process (the postmaster incl. reaped backends) / checks
  lab_cpu_us_per_check    fault servers + judge (not part of cpu_us_per_check); lab_cpu_util in cores,
                          lab_cpu_share of the machine's busy time
  pg_bytes_per_hour       check_history's size (pg_total_relation_size over its partitions) delta,
                          extrapolated to an hour; pg_bytes_per_row, pg_table_mb at the end
  import_s / import_routes_per_s  the path's ``magpie import`` of the population
  tarpit_ports            tarpit listening ports over all labs
  tarpit_reaped / tarpit_reaped_waiting  connections the labs' reapers closed in the window / of them
                          still open at the client (a live check cut short: too few ports)
  tarpit_peak_queue_pct   fullest tarpit accept queue seen (% of its maximum)
  listen_overflows / listen_drops  ``/proc/net/netstat`` ListenOverflows / ListenDrops delta (the whole
                          host: handshakes dropped at a full accept queue)
  limited_by              none (achieved_ratio >= 0.97), lab:queues (reaped_waiting + overflows >= 0.1 %
                          of the tarpit checks),
                          lab:cpu (machine >= 90 % busy and the lab >= 25 % of it), other-load (machine
                          >= 90 % busy, >= 25 % of it not this run's: unaccounted_cpu_util), else magpie
  sched_lag_s / due_end   at the window's end: now minus the oldest claimable score, claimable routes
  rss_mb_<proc>           largest RSS of one process of that Procfile process at the window's end

    .venv/bin/python benchmarks/pipeline_bench.py                 # all populations, both paths (~20 min)
    .venv/bin/python benchmarks/pipeline_bench.py --quick         # smoke run (small, short)
    .venv/bin/python benchmarks/pipeline_bench.py --populations tarpit --skip-baseline --seconds 60

Needs psutil (``pip install psutil``), the local Redis and PostgreSQL; traffic stays on 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil
import redis
import sqlalchemy as sa

os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only
ROOT = Path(__file__).resolve().parents[1]
LAB_ROOT = ROOT  # code of the judge, the fault servers and the harness's own magpie imports (the snapshot)
PY = sys.executable
# the servers come from the product's settings (each run keeps its own key prefixes and database on them)
_REDIS = redis.connection.parse_url(os.environ.get("MAGPIE_REDIS_URL", "redis://127.0.0.1:6379/0"))
REDIS_HOST, REDIS_PORT = _REDIS.get("host", "127.0.0.1"), int(_REDIS.get("port", 6379))
PG_BASE = os.environ.get("MAGPIE_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/x").rsplit("/", 1)[0] + "/"
BENCH_KEY = "pipeline-bench-key-0123456789abcdef"
WORKSPACE = "bench"
SAMPLE_S = 0.5
INSTANCE_HEARTBEAT_S = 2.0
INSTANCE_TTL_S = 30.0  # MAGPIE_INSTANCE_TTL's default: check-process reports older than this are stale
START_DEADLINE_S = 90.0
MIX_SHARES = {"tarpit": 0.70, "refused": 0.10, "echo": 0.15, "slow": 0.05}
TARPIT_PROTOCOLS = ("http", "socks5")  # tarpit routes alternate between them
POPULATIONS = ("live", "refused", "tarpit", "mix", "trickle")
LAB_HOST_BASES = ("127.0.0.20", "127.0.0.40", "127.0.0.60", "127.0.0.80")
MIN_TARPIT_PORTS = 8  # per fault lab
TARPIT_HEADROOM = 4  # tarpit connections the labs hold, as a multiple of those open at the ideal rate
KEEPS_UP = 0.97  # achieved/ideal at or above which the node keeps up


@dataclass
class Spec:
    """One population's settings. ``routes`` for trickle counts the echo routes (plus one trickle);
    ``warmup``/``seconds`` None: one interval."""

    name: str
    routes: int
    interval: float
    warmup: float | None
    seconds: float | None
    timeout: float = 10.0
    attempts: int = 2


DEFAULT_SPECS = {
    "live": Spec("live", 20_000, 5.0, 10, 30),
    "refused": Spec("refused", 20_000, 5.0, 10, 30),
    "tarpit": Spec("tarpit", 30_000, 5.0, 30, 30),
    "mix": Spec("mix", 30_000, 120.0, None, None),
    "trickle": Spec("trickle", 1_000, 5.0, 10, 50),
}
QUICK_MIX = Spec("mix", 200_000, 60.0, None, None)  # --quick-mix
QUICK_SPECS = {
    "live": Spec("live", 2_000, 0.5, 4, 8),
    "refused": Spec("refused", 2_000, 0.5, 4, 8),
    "tarpit": Spec("tarpit", 3_000, 1.0, 5, 8, timeout=2.0),
    "mix": Spec("mix", 3_000, 12.0, 5, 8, timeout=2.0),
    "trickle": Spec("trickle", 200, 2.0, 3, 12, timeout=2.0),
}


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def out(line: str) -> None:
    print(line, flush=True)


# -- signals and process handling ---------------------------------------------------------------------


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def shielded():
    """Ignore SIGINT/SIGTERM while cleaning up (a second Ctrl-C must not leave processes behind)."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _raise_nofile() -> None:  # preexec for the fault servers: they hold one socket per tarpit connection
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (262_144, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(want, soft), max(want, hard)))
            return
        except (ValueError, OSError):
            continue


class Child:
    """A subprocess in its own session; stop() = SIGTERM to its group, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], *, cwd, env, log, stdout_pipe=False, preexec=None):
        self.name = name
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE if stdout_pipe else log, stderr=log,
                                     start_new_session=True, preexec_fn=preexec)
        self.ps = psutil.Process(self.proc.pid)

    def first_line(self, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        buf = b""
        try:
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not sel.select(0):
                    raise RuntimeError(f"{self.name} did not start (rc={self.proc.poll()})")
                if sel.select(min(left, 0.5)):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)
                    if not chunk:
                        raise RuntimeError(f"{self.name} closed its output (rc={self.proc.poll()})")
                    buf += chunk
        finally:
            sel.close()
        return buf.split(b"\n", 1)[0].decode()

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()


# -- measurement helpers ------------------------------------------------------------------------------


def _cpu(p: psutil.Process, with_children: bool = False) -> float:
    t = p.cpu_times()
    v = t.user + t.system
    if with_children:
        v += t.children_user + t.children_system
    return v


class CpuTracker:
    """CPU seconds per group over a window, per pid (processes that start inside the window count from
    zero; a process that exits keeps its last sample)."""

    def __init__(self, t0_wall: float):
        self.t0 = t0_wall
        self.base: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.group: dict[int, str] = {}

    def sample(self, procs: list[tuple[psutil.Process, str, bool]]) -> None:
        for p, g, with_children in procs:
            try:
                v = _cpu(p, with_children)
                created = p.create_time()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if p.pid not in self.base:
                self.base[p.pid] = 0.0 if created > self.t0 else v
            self.last[p.pid] = v
            self.group[p.pid] = g

    def by_group(self) -> dict[str, float]:
        res: dict[str, float] = {}
        for pid, v in self.last.items():
            g = self.group[pid]
            res[g] = res.get(g, 0.0) + max(0.0, v - self.base[pid])
        return res


def _scan_fds(pid: int) -> tuple[int, int]:
    """(open fds, sockets among them) by reading every /proc/PID/fd link (slow: ~5 us per fd)."""
    d = f"/proc/{pid}/fd"
    try:
        names = os.listdir(d)
    except OSError:
        return 0, 0
    n = 0
    for fd in names:
        try:
            if os.readlink(f"{d}/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return len(names), n


class SocketCounter:
    """Open sockets of a process, cheaply: ``stat(/proc/PID/fd).st_size`` is the open-fd count on Linux >= 6.2
    (~30 us); the process's non-socket fds are counted by a full link scan while it holds few fds (and
    re-counted whenever it does). Falls back to the full scan when st_size is 0 (older kernels)."""

    RESCAN_BELOW = 2000

    def __init__(self):
        self.non_sockets: dict[int, int] = {}

    def count(self, pid: int) -> int:
        try:
            n = os.stat(f"/proc/{pid}/fd").st_size
        except OSError:
            return 0
        if n == 0 or n < self.RESCAN_BELOW or pid not in self.non_sockets:
            total, socks = _scan_fds(pid)
            self.non_sockets[pid] = total - socks
            return socks
        return max(0, n - self.non_sockets[pid])


def fd_count(pid: int) -> int:
    """Open fds of ``pid``: ``stat(/proc/PID/fd).st_size`` (Linux >= 6.2), else the directory's length."""
    try:
        n = os.stat(f"/proc/{pid}/fd").st_size
        return n if n > 0 else len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def listen_counters() -> dict[str, int]:
    """``ListenOverflows`` and ``ListenDrops`` of ``/proc/net/netstat`` (the whole network namespace:
    handshakes dropped because an accept queue was full)."""
    try:
        lines = [ln.split() for ln in Path("/proc/net/netstat").read_text().splitlines() if ln.startswith("TcpExt:")]
        row = dict(zip(lines[0][1:], map(int, lines[1][1:])))
    except (OSError, IndexError, ValueError):
        return {}
    return {k: row.get(k, 0) for k in ("ListenOverflows", "ListenDrops")}


def pg_table_bytes(conn, table: str = "check_history") -> int:
    """``pg_total_relation_size`` of ``table`` summed over its partitions (0 when it does not exist)."""
    return int(conn.execute(sa.text(
        "SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree(to_regclass(:t))"),
        {"t": table}).scalar_one() or 0)


def checks_in_flight(reg, ttl_s: float) -> int | None:
    """Checks running now, summed over the live workers consuming ``checks`` (their check processes'
    reports in the instance registry); None when no worker reports any (e.g. an older tree)."""
    total, found = 0, False
    for rec in reg.list_live("worker"):
        if "checks" not in (rec.get("queues") or ()):
            continue
        running, _slots, procs = reg.checks_of(rec["id"], ttl_s)
        if procs:
            found = True
            total += running
    return total if found else None


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def spread(values: list[float]) -> tuple[float, float, float]:
    """(min, median, max) of ``values`` (nan when empty)."""
    if not values:
        return (float("nan"),) * 3
    v = sorted(values)
    return v[0], v[len(v) // 2], v[-1]


def ideal_rate(spec: Spec, slow_kinds: int, others: int) -> float:
    """Checks/s a node that keeps up achieves: ``slow_kinds / (interval + attempts * timeout) + others /
    interval`` (a route whose check takes the whole deadline comes due again only ``interval`` after it
    ended: next due = max(due, now) + interval)."""
    return slow_kinds / (spec.interval + spec.attempts * spec.timeout) + others / spec.interval


LAB_QUEUE_SHARE = 0.001
"""Tarpit checks the lab's queues cut short (reaped while waiting, or dropped) that make it the limit."""


def limited_by(f: dict) -> str:
    """What the achieved/ideal ratio looks limited by: ``none`` (it keeps up), ``lab:queues`` (a tarpit
    reaper cut live clients short or the kernel dropped handshakes, for at least :data:`LAB_QUEUE_SHARE`
    of the tarpit checks), ``lab:cpu`` (the machine is busy and
    the lab has a large share of it), ``other-load`` (the machine is busy with work that is not this
    run's), else ``magpie``."""
    kinds = dict(part.split(":", 1) for part in str(f.get("by_kind") or "").split("/") if ":" in part)
    tarpits = int(kinds.get("tarpit", 0) or 0)
    cut = f.get("tarpit_reaped_waiting", 0) + f.get("listen_overflows", 0)
    if cut > 0 and cut >= LAB_QUEUE_SHARE * max(tarpits, 1):
        return "lab:queues"  # first: tarpits cut short come back sooner, so even a ratio >= 1 proves nothing
    if f.get("achieved_ratio", 0) >= KEEPS_UP:
        return "none"
    if f.get("machine_cpu_util", 0) >= 0.90:
        if f.get("lab_cpu_share", 0) >= 0.25:
            return "lab:cpu"
        if f.get("unaccounted_cpu_util", 0) >= 0.25:
            return "other-load"
    return "magpie"


def tarpit_ports_per_lab(spec: Spec, tarpits: int, n_labs: int) -> int:
    """Listening ports per fault lab for ``tarpits`` tarpit routes: :data:`TARPIT_HEADROOM` times the
    connections open at the ideal rate (``tarpits * attempts * timeout / (interval + attempts * timeout)``;
    the catch-up after the start keeps every check slot busy) must fit in 70 % of the accept queues (the
    reaper's low mark), so a reaped connection's client gave up long ago. A port costs one listening
    socket."""
    from magpie.lab.tarpit import REAP_LOW, somaxconn

    deadline = spec.attempts * spec.timeout
    open_conns = TARPIT_HEADROOM * tarpits * deadline / (spec.interval + deadline)
    return max(MIN_TARPIT_PORTS, math.ceil(open_conns / (REAP_LOW * somaxconn()) / max(1, n_labs)))


_PG_PROCS: dict[int, psutil.Process] = {}


def postgres_procs(db: str) -> list[tuple[psutil.Process, str, bool]]:
    """PostgreSQL processes doing this run's work: the backends connected to ``db``, the server's
    background processes (WAL writer, checkpointer, ...) and the postmaster (without its reaped children,
    which would bring in other databases' backends). Backends of other databases are not counted."""
    eng = sa.create_engine(PG_BASE + "postgres", poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as c:
            pids = [r[0] for r in c.execute(sa.text(
                "SELECT pid FROM pg_stat_activity WHERE datname = :d OR (datname IS NULL AND pid <> pg_backend_pid())"),
                {"d": db})]
    finally:
        eng.dispose()
    res = []
    parents = set()
    for pid in pids:
        try:
            p = _PG_PROCS.get(pid) or psutil.Process(pid)
            _PG_PROCS[pid] = p
            parents.add(p.ppid())
            res.append((p, "postgres", False))
        except psutil.Error:
            continue
    for pid in parents:
        try:
            p = _PG_PROCS.get(pid) or psutil.Process(pid)
            if p.name() in ("postgres", "postmaster"):
                _PG_PROCS[pid] = p
                res.append((p, "postgres", False))
        except psutil.Error:
            continue
    return res


def redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def machine_busy() -> tuple[float, float, float]:
    """(busy, total, irq+softirq) CPU seconds summed over all cores since boot."""
    t = psutil.cpu_times()
    total = sum(t)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total, getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def wait_idle(max_wait: float, threshold: float = 0.25) -> float:
    """Wait (at most ``max_wait`` s) until the machine is below ``threshold`` busy over 2 s; returns the
    seconds waited (other work on the machine, e.g. a test suite, would share the 2 cores)."""
    t0 = time.monotonic()
    while True:
        b0, t_0, _ = machine_busy()
        time.sleep(2.0)
        b1, t_1, _ = machine_busy()
        util = (b1 - b0) / max(1e-9, t_1 - t_0)
        waited = time.monotonic() - t0
        if util < threshold or waited >= max_wait:
            if util >= threshold:
                say(f"  machine still {util:.0%} busy after {waited:.0f}s; measuring anyway")
            return waited
        say(f"  machine {util:.0%} busy (not this benchmark); waiting")


def quantile(buckets0, buckets1, q: float) -> float:
    """Quantile ``q`` of the histogram delta (cumulative ``[(upper bound, count)]`` lists), interpolated
    inside the bucket; the lower bound of the +Inf bucket when it falls there; nan when empty."""
    cum = [c1 - c0 for (_, c0), (_, c1) in zip(buckets0, buckets1)]
    total = cum[-1] if cum else 0
    if total <= 0:
        return float("nan")
    target = q * total
    prev_ub, prev_c = 0.0, 0
    for (ub, _), c in zip(buckets1, cum):
        if c >= target:
            if math.isinf(ub):
                return prev_ub
            span = c - prev_c
            return prev_ub + (ub - prev_ub) * ((target - prev_c) / span if span else 1.0)
        prev_ub, prev_c = ub, c
    return prev_ub


def fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return "nan"
        a = abs(v)
        return f"{v:.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}"
    return str(v)


# -- populations ----------------------------------------------------------------------------------------


def build_lines(spec: Spec, labs: list[dict]) -> tuple[list[str], dict]:
    """The proxy-list lines of ``spec`` spread round-robin over the fault labs, and extras (trickle route)."""
    from magpie.lab.faults import mix_lines, population_lines, spread_lines

    n_labs = len(labs)

    def split(n: int) -> list[int]:
        return [n // n_labs + (1 if i < n % n_labs else 0) for i in range(n_labs)]

    def interleave(lists: list[list[str]]) -> list[str]:
        res = []
        for i in range(max((len(x) for x in lists), default=0)):
            res.extend(x[i] for x in lists if i < len(x))
        return res

    extras: dict = {}
    if spec.name in ("live", "refused"):
        kind = {"live": "echo"}.get(spec.name, spec.name)
        lines = interleave([population_lines(lab[kind], n) for lab, n in zip(labs, split(spec.routes))])
    elif spec.name == "tarpit":
        lines = interleave([spread_lines(lab.get("tarpits") or [lab["tarpit"]], n, TARPIT_PROTOCOLS)
                            for lab, n in zip(labs, split(spec.routes))])
    elif spec.name == "mix":
        lines = interleave([[line for _, line in mix_lines({**lab, "tarpit": lab.get("tarpits") or lab["tarpit"]}, n,
                                                           MIX_SHARES, protocols={"tarpit": TARPIT_PROTOCOLS})]
                            for lab, n in zip(labs, split(spec.routes))])
    elif spec.name == "trickle":
        lines = interleave([population_lines(lab["echo"], n) for lab, n in zip(labs, split(spec.routes))])
        trickle = population_lines(labs[0]["trickle"], 1, start=10**6)[0]
        lines.insert(len(lines) // 2, trickle)
        host, port = labs[0]["trickle"].rsplit(":", 1)
        extras["trickle"] = (host, int(port))
    else:
        raise ValueError(spec.name)
    return lines, extras


def host_kinds(labs: list[dict]) -> dict[str, str]:
    return {addr.rsplit(":", 1)[0]: kind for lab in labs for kind, addr in lab.items()
            if kind not in ("pid", "tarpits")}


def count_deadline_routes(lines: list[str], kinds: dict[str, str]) -> int:
    """Routes whose check takes the whole deadline (tarpit and trickle hosts)."""
    return sum(1 for ln in lines if kinds.get(ln.rsplit("@", 1)[-1].rsplit(":", 1)[0]) in ("tarpit", "trickle"))


# -- one run ----------------------------------------------------------------------------------------------


@dataclass
class Tree:
    path_name: str  # engine | baseline
    root: Path
    ref: str

    def procfile_names(self) -> list[str]:
        names = []
        for line in (self.root / "Procfile").read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_-]+):", line)
            if m and m.group(1) != "flower":
                names.append(m.group(1))
        return names


def snapshot_tree(dest: Path) -> str:
    """Copy the work tree (tracked and untracked, non-ignored files) to ``dest``; ``lua/`` also as the
    package ``magpie/lua`` so the editable install's ``magpie.lua`` mapping (to /work/main/lua) is not used.
    Returns a SHA-1 over the copied files (names and contents)."""
    import hashlib

    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                           capture_output=True, check=True).stdout.split(b"\0")
    h = hashlib.sha1()
    for raw in sorted(n for n in names if n):
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the work tree
        data = src.read_bytes()
        h.update(raw + b"\0" + data)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
    self_contained(dest)
    return h.hexdigest()[:12]


def self_contained(dest: Path) -> None:
    """Give a copied tree its own ``magpie/lua`` package (a copy of ``lua/``): the editable install maps
    ``magpie.lua`` to /work/main/lua, which a copy must not read."""
    if (dest / "lua").is_dir() and not (dest / "magpie" / "lua").exists():
        shutil.copytree(dest / "lua", dest / "magpie" / "lua")
        (dest / "magpie" / "lua" / "__init__.py").write_text("")


def extract_ref(ref: str, prefix: str) -> tuple[Path, str]:
    """``git archive`` of ``ref`` into a new temporary directory; returns it and the full commit id."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                         capture_output=True, text=True)
    if sha.returncode != 0:
        raise SystemExit(f"{ref!r} is not a commit: {sha.stderr.strip()}")
    commit = sha.stdout.strip()
    dest = Path(tempfile.mkdtemp(prefix=prefix))
    arch = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=arch.stdout, check=True)
    arch.stdout.close()
    if arch.wait() != 0:
        raise SystemExit("git archive failed")
    self_contained(dest)
    return dest, commit


def tree_imports(root: Path) -> str | None:
    """None when the tree's magpie imports cleanly (tasks, check pool, importer, CLI), else the error."""
    code = ("import importlib\n"
            "def first(*names):\n"  # the tree's layout: older flat modules or packages (pipeline/, wiring/)
            "    for n in names:\n"
            "        try:\n            return importlib.import_module(n)\n"
            "        except ModuleNotFoundError as e:\n"
            "            if not n.startswith(e.name or '?'):\n                raise\n"
            "    return None\n"
            "assert first('magpie.tasks', 'magpie.wiring.tasks')\n"
            "first('magpie.checkpool', 'magpie.pipeline.checkpool')\n"
            "import magpie.cli, magpie.importer.service, magpie.queue.scripts as s, sys\n"
            "d = str(s.LUA_DIR)\n"
            "sys.exit(0 if d.startswith(sys.argv[1]) else 'scripts from ' + d)")
    p = subprocess.run([PY, "-c", code, str(root)], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                       capture_output=True, text=True)
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["?"])[-1]


@dataclass
class Result:
    fields: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def checks_per_s(self) -> float:
        return self.fields.get("checks_per_s", float("nan"))

    @property
    def cpu_us(self) -> float:
        return self.fields.get("cpu_us_per_check", float("nan"))


class Run:
    def __init__(self, spec: Spec, tree: Tree, args, log_dir: Path):
        self.spec, self.tree, self.args = spec, tree, args
        self.id = uuid.uuid4().hex[:8]
        self.prefix = f"pbench-{self.id}:"
        self.broker_prefix = f"pbench-{self.id}-broker:"
        self.db = f"magpie_pbench_{self.id}"
        self.dir = log_dir / f"{spec.name}-{tree.path_name}-{self.id}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.r = redis.Redis(REDIS_HOST, REDIS_PORT, db=args.redis_db)
        self.children: list[Child] = []
        self.honcho: Child | None = None
        self.seen: dict[int, psutil.Process] = {}  # every Celery-side process ever seen (for the final kill)
        self.roots: dict[int, str] = {}  # honcho's direct children: pid -> Procfile name
        self.pg_engine = None
        self.labs: list[dict] = []
        self.log_stop_offset: int | None = None
        self.after_stop: dict = {}
        self.files: list = []

    # environment of the path's processes
    def env(self, judge_url: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MAGPIE_", "PROXY_", "CELERY"))}
        env.pop("PYTHONPATH", None)
        s = self.spec
        lease = max(300.0, s.attempts * s.timeout + 60)
        env.update({
            "PATH": str(Path(PY).parent) + os.pathsep + env.get("PATH", ""),
            "PYTHONPATH": str(self.tree.root),
            "MAGPIE_REDIS_URL": f"redis://{REDIS_HOST}:{REDIS_PORT}/{self.args.redis_db}",
            "MAGPIE_REDIS_PREFIX": self.prefix,
            "MAGPIE_BROKER_URL": f"redis://{REDIS_HOST}:{REDIS_PORT}/{self.args.redis_db}",
            "MAGPIE_BROKER_KEY_PREFIX": self.broker_prefix,
            "MAGPIE_DATABASE_URL": PG_BASE + self.db,
            "PROXY_ENCRYPTION_KEY": BENCH_KEY,
            "MAGPIE_JUDGE_URL": judge_url,
            "MAGPIE_CHECK_ALLOW_PRIVATE": "127.0.0.0/8",  # egress guard (engine): the lab is on loopback
            "MAGPIE_EGRESS_ONLY": "127.0.0.0/8,::1",  # nothing else is ever dialled
            "MAGPIE_CHECK_INTERVAL": f"{s.interval:g}",
            "MAGPIE_CHECK_TIMEOUT": f"{s.timeout:g}",
            "MAGPIE_CHECK_ATTEMPTS": str(s.attempts),
            "MAGPIE_LEASE_SECONDS": f"{lease:g}",
            "MAGPIE_RENEW_BELOW_SECONDS": f"{min(120.0, lease / 2):g}",
            "MAGPIE_BEAT_SCHEDULE_FILE": str(self.dir / "celerybeat-schedule"),
            "MAGPIE_LOG_LEVEL": self.args.log_level,
            "MAGPIE_INSTANCE_HEARTBEAT": f"{INSTANCE_HEARTBEAT_S:g}",  # check figures every 2 s
            "PYTHONUNBUFFERED": "1",
        })
        if self.args.checks_per_process:
            env["MAGPIE_CHECKS_PER_PROCESS"] = str(self.args.checks_per_process)
        if self.args.check_concurrency:
            env["MAGPIE_CHECK_CONCURRENCY"] = str(self.args.check_concurrency)
        for item in self.args.env:
            key, _, value = item.partition("=")
            env[key] = value
        return env

    def magpie_cli(self, env, *argv: str, timeout: float = 300) -> str:
        p = subprocess.run([PY, "-m", "magpie", *argv], cwd=self.tree.root, env=env, capture_output=True,
                           text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"magpie {' '.join(argv)} failed (rc={p.returncode}): "
                               f"{(p.stderr or p.stdout).strip()[-800:]}")
        return p.stdout

    # process groups ---------------------------------------------------------------------------------
    def celery_groups(self) -> dict[int, tuple[psutil.Process, str]]:
        """pid -> (process, Procfile name) for every process under honcho (name from honcho's log)."""
        if len(set(self.roots.values())) < len(self.tree.procfile_names()):  # until honcho named them all
            try:
                text = (self.dir / "celery.log").read_text(errors="replace")
            except OSError:
                text = ""
            for m in re.finditer(r"\b([A-Za-z0-9_-]+)\.\d+ started \(pid=(\d+)\)", text):
                self.roots[int(m.group(2))] = m.group(1)
        res: dict[int, tuple[psutil.Process, str]] = {}
        for pid, name in self.roots.items():
            try:
                root = self.seen.get(pid) or psutil.Process(pid)
                self.seen[pid] = root
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                p = self.seen.setdefault(p.pid, p)
                res[p.pid] = (p, name)
        return res

    def lab_procs(self) -> list[psutil.Process]:
        return [c.ps for c in self.children]

    # main -------------------------------------------------------------------------------------------
    def execute(self) -> Result:
        try:
            res = self._execute()
        finally:
            with shielded():
                self.cleanup()
        res.fields.update(self.after_stop)
        return res

    def _execute(self) -> Result:
        s, args = self.spec, self.args
        self.waited_idle = wait_idle(args.wait_idle) if args.wait_idle > 0 else 0.0
        lab_log = open(self.dir / "lab.log", "w")
        self.files.append(lab_log)
        # judge + fault servers (work-tree code: the baseline has no fault lab)
        judge = Child("judge", [PY, "-c", "from magpie.checker.judge import run_judge; run_judge('127.0.0.1', 0)"],
                      cwd=LAB_ROOT, env={**os.environ, "PYTHONPATH": str(LAB_ROOT)}, log=lab_log, stdout_pipe=True)
        self.children.append(judge)
        m = re.search(r"(http://[^/\s]+/)", judge.first_line(15))
        if not m:
            raise RuntimeError("judge printed no URL")
        judge_url = m.group(1)
        judge_port = int(judge_url.rstrip("/").rsplit(":", 1)[1])
        from magpie.lab.faults import mix_counts

        tarpits = {"tarpit": s.routes, "mix": mix_counts(s.routes, MIX_SHARES)["tarpit"]}.get(s.name, 0)
        ports = args.tarpit_ports or tarpit_ports_per_lab(s, tarpits, args.fault_labs)
        self.stats_files = [self.dir / f"faults{i}-stats.json" for i in range(args.fault_labs)]
        for i in range(args.fault_labs):
            c = Child(f"faults{i}", [PY, "-m", "magpie.lab.faults", "--host-base", LAB_HOST_BASES[i],
                                     "--judge-host", "127.0.0.1", "--judge-port", str(judge_port),
                                     "--tarpit-ports", str(ports), "--stats-file", str(self.stats_files[i])],
                      cwd=LAB_ROOT, env={**os.environ, "PYTHONPATH": str(LAB_ROOT)}, log=lab_log,
                      stdout_pipe=True, preexec=_raise_nofile)
            self.children.append(c)
            self.labs.append(json.loads(c.first_line(20)))
        self.tarpit_ports = ports
        lines, extras = build_lines(s, self.labs)
        kinds = host_kinds(self.labs)
        deadline_routes = count_deadline_routes(lines, kinds)
        list_file = self.dir / "routes.txt"
        list_file.write_text("\n".join(lines) + "\n")
        env = self.env(judge_url)
        self.magpie_cli(env, "db", "upgrade")
        t = time.monotonic()
        rep = json.loads(self.magpie_cli(env, "import", str(list_file), "--workspace", WORKSPACE, "--json",
                                         timeout=3600))
        import_s = time.monotonic() - t
        if rep.get("invalid") or rep.get("imported") != len(lines):
            raise RuntimeError(f"import stored {rep.get('imported')} of {len(lines)} routes: {rep.get('invalid')[:3]}")
        say(f"  db {self.db} migrated, {len(lines)} routes imported in {import_s:.1f}s "
            f"({len(lines) / max(import_s, 1e-9):.0f} routes/s); {ports} tarpit ports per fault lab")
        if args.profiles and self.tree.path_name == "engine":  # a two-judge pool and a workspace profile
            for url in (judge_url, judge_url + "?pool=2"):
                self.magpie_cli(env, "judges", "add", url)
            self.magpie_cli(env, "profiles", "set", WORKSPACE, "--timeout", f"{s.timeout:g}",
                            "--attempts", str(s.attempts))
        self.pg_engine = sa.create_engine(PG_BASE + self.db, poolclass=sa.pool.NullPool)

        names = self.tree.procfile_names()
        celery_log = open(self.dir / "celery.log", "w")
        self.files.append(celery_log)
        self.honcho = Child("honcho", [PY, "-m", "honcho", "-f", str(self.tree.root / "Procfile"), "start", *names],
                            cwd=self.tree.root, env=env, log=celery_log)
        say(f"  started {', '.join(names)} via honcho (log {self.dir / 'celery.log'})")

        from magpie.observability.metrics import read_counters
        from magpie.queue.keys import QueueKeys

        keys = QueueKeys(self.prefix, 16)
        t_start = time.monotonic()
        while True:  # first claims
            if self.honcho.proc.poll() is not None:
                raise RuntimeError(f"honcho exited (rc={self.honcho.proc.returncode}) before any claim")
            if self.r.zcard(keys.leased) > 0 or read_counters(self.r, self.prefix)["lateness"]["count"] > 0:
                break
            if time.monotonic() - t_start > START_DEADLINE_S:
                raise RuntimeError(f"no route claimed within {START_DEADLINE_S:.0f}s of start")
            time.sleep(0.25)
        say(f"  first claims {time.monotonic() - t_start:.1f}s after start; warm-up {s.warmup:g}s")
        self._sleep(s.warmup)

        # window start
        t0_wall = time.time()
        cpu = CpuTracker(t0_wall)
        me = psutil.Process()
        me_cpu0 = _cpu(me)
        groups = self.celery_groups()
        pg = postgres_procs(self.db)
        socks = SocketCounter()
        cpu.sample([(p, g, False) for p, g in groups.values()] + pg
                   + [(p, "lab", False) for p in self.lab_procs()])
        redis0 = redis_cpu(self.r)
        busy0, total0, irq0 = machine_busy()
        c0 = read_counters(self.r, self.prefix)
        listen0 = listen_counters()
        lab0 = [read_json(f) or {} for f in self.stats_files]
        with self.pg_engine.connect() as conn:
            max_id0 = conn.execute(sa.text("SELECT coalesce(max(id), 0) FROM check_history")).scalar_one()
            pg_bytes0 = pg_table_bytes(conn)
        from magpie.coordination.instances import InstanceRegistry

        reg = InstanceRegistry(self.r, self.prefix)
        t0 = time.monotonic()
        peak_sock, peak_lab = 0, 0
        sum_sock = sum_leased = n_samples = 0
        leases_s: list[int] = []
        flight_s: list[int] = []  # registry figures (None samples left out)
        sock_flight_s: list[int] = []  # open sockets of the check processes
        oldest_lateness = 0.0
        peak_queue_pct = 0
        peak_fds: dict[str, int] = {}
        trace = open(self.dir / "samples.csv", "w")
        self.files.append(trace)
        trace.write("t_s,check_process_sockets,live_leases,in_flight,oldest_due_s,lab_sockets\n")
        next_t = t0
        n_pg_refresh = 0
        while True:
            now = time.monotonic()
            if now - t0 >= s.seconds:
                break
            if self.honcho.proc.poll() is not None:
                raise RuntimeError(f"honcho exited (rc={self.honcho.proc.returncode}) during the window")
            groups = self.celery_groups()
            n_pg_refresh += 1
            if n_pg_refresh % 4 == 0:
                pg = postgres_procs(self.db)
            cpu.sample([(p, g, False) for p, g in groups.values()] + pg
                       + [(p, "lab", False) for p in self.lab_procs()])
            top = 0
            per_proc = []
            for pid, (_p, g) in groups.items():
                if g == "worker-checks":
                    n = socks.count(pid)
                    top = max(top, n)
                    if n > 8:
                        per_proc.append(n)
            for pid, (_p, g) in groups.items():
                peak_fds[g] = max(peak_fds.get(g, 0), fd_count(pid))
            for c in self.children:
                peak_fds[c.name] = max(peak_fds.get(c.name, 0), fd_count(c.ps.pid))
            peak_sock = max(peak_sock, top)
            sum_sock += top
            leased = self.r.zcount(keys.leased, f"({int(time.time() * 1000)}", "+inf")
            sum_leased += leased
            n_samples += 1
            lab_n = sum(socks.count(c.ps.pid) for c in self.children if c.name != "judge")
            peak_lab = max(peak_lab, lab_n)
            in_flight, oldest = "", ""
            if n_samples % 2 == 1:  # once a second: registry, oldest due route, lab queues
                leases_s.append(leased)
                sock_flight_s.append(sum(per_proc))
                fl = checks_in_flight(reg, INSTANCE_TTL_S)
                if fl is not None:
                    flight_s.append(fl)
                    in_flight = str(fl)
                lag = self._oldest_due_s(keys)
                oldest_lateness = max(oldest_lateness, lag)
                oldest = f"{lag:.1f}"
                for f in self.stats_files:
                    peak_queue_pct = max(peak_queue_pct, ((read_json(f) or {}).get("tarpit") or {})
                                         .get("peak_queued_share_pct", 0))
            trace.write(f"{now - t0:.2f},{'/'.join(map(str, sorted(per_proc)))},{leased},{in_flight},{oldest},"
                        f"{lab_n}\n")
            next_t += SAMPLE_S
            time.sleep(max(0.0, min(next_t, t0 + s.seconds) - time.monotonic()))
        # window end
        groups = self.celery_groups()
        cpu.sample([(p, g, False) for p, g in groups.values()] + postgres_procs(self.db)
                   + [(p, "lab", False) for p in self.lab_procs()])
        redis1 = redis_cpu(self.r)
        busy1, total1, irq1 = machine_busy()
        c1 = read_counters(self.r, self.prefix)
        window = time.monotonic() - t0
        me_cpu1 = _cpu(me)
        listen1 = listen_counters()
        time.sleep(1.1)  # the labs rewrite their stats every second
        lab1 = [read_json(f) or {} for f in self.stats_files]
        with self.pg_engine.connect() as conn:
            pg_bytes1 = pg_table_bytes(conn)
            rows = conn.execute(sa.text(
                "SELECT r.host, count(*), count(*) FILTER (WHERE h.alive) FROM check_history h "
                "JOIN routes r ON r.id = h.route_id WHERE h.id > :m GROUP BY r.host"), {"m": max_id0}).all()
            pg_total = conn.execute(sa.text("SELECT count(*) FROM check_history")).scalar_one()
            never = conn.execute(sa.text(
                "SELECT count(*) FROM routes r WHERE NOT EXISTS "
                "(SELECT 1 FROM check_history h WHERE h.route_id = r.id)")).scalar_one()
            trickle_rows = []
            if "trickle" in extras:
                th, tp = extras["trickle"]
                trickle_rows = conn.execute(sa.text(
                    "SELECT h.id, h.checked_at, h.error, h.attempts FROM check_history h JOIN routes r "
                    "ON r.id = h.route_id WHERE r.host = :h AND r.port = :p ORDER BY h.checked_at"),
                    {"h": th, "p": tp}).all()
        now_s, now_us = self.r.time()
        now_ms = now_s * 1000 + now_us / 1000
        pipe = self.r.pipeline(transaction=False)
        for sh in keys.all_shards():
            pipe.zrangebyscore(sh, "-inf", now_ms, start=0, num=1, withscores=True)
            pipe.zcount(sh, "-inf", now_ms)
        res = pipe.execute()
        oldest = [x[0][1] for x in res[0::2] if x]
        sched_lag = (now_ms - min(oldest)) / 1000 if oldest else 0.0
        due_end = sum(res[1::2])
        rss: dict[str, float] = {}
        for pid, (p, g) in groups.items():
            try:
                rss[g] = max(rss.get(g, 0.0), p.memory_info().rss / 2**20)
            except psutil.NoSuchProcess:
                pass

        checks = sum(n for _, n, _ in rows)
        f_ideal = ideal_rate(s, deadline_routes, len(lines) - deadline_routes)
        alive = sum(a for _, _, a in rows)
        by_kind: dict[str, int] = {}
        for host, n, _ in rows:
            k = kinds.get(host, host)
            by_kind[k] = by_kind.get(k, 0) + n
        done0 = c0["checks"].get("alive", 0) + c0["checks"].get("dead", 0)
        done1 = c1["checks"].get("alive", 0) + c1["checks"].get("dead", 0)
        per_check = (lambda sec: sec * 1e6 / checks) if checks else (lambda sec: float("nan"))
        cpu_g = cpu.by_group()
        f: dict = {
            "routes": len(lines), "interval_s": s.interval, "checks_per_s": checks / window,
            "demand_per_s": len(lines) / s.interval, "ideal_per_s": f_ideal,
            "achieved_ratio": checks / window / f_ideal if f_ideal else float("nan"),
            "completed_per_s": (done1 - done0) / window,
            "alive_per_s": alive / window, "peak_inflight_per_process": peak_sock,
            "mean_inflight_per_process": sum_sock / max(1, n_samples), "mean_live_leases": sum_leased / max(1, n_samples),
            "lab_conns_peak": peak_lab,
        }
        magpie_cpu = 0.0
        per_proc = {}
        for name in self.tree.procfile_names():
            sec = cpu_g.get(name, 0.0)
            magpie_cpu += sec
            per_proc[f"cpu_us_per_check_{name.replace('-', '_')}"] = per_check(sec)
        redis_sec = max(0.0, redis1 - redis0)
        pg_sec = cpu_g.get("postgres", 0.0)
        f["cpu_us_per_check"] = per_check(magpie_cpu + redis_sec + pg_sec)
        f.update(per_proc)
        f["redis_cpu_us_per_check"] = per_check(redis_sec)
        f["pg_cpu_us_per_check"] = per_check(pg_sec)
        f["lab_cpu_us_per_check"] = per_check(cpu_g.get("lab", 0.0))
        f["machine_cpu_util"] = (busy1 - busy0) / max(1e-9, total1 - total0)
        f["bench_cpu_util"] = (me_cpu1 - me_cpu0) / window
        accounted = magpie_cpu + redis_sec + pg_sec + cpu_g.get("lab", 0.0) + (me_cpu1 - me_cpu0)
        f["softirq_cpu_util"] = (irq1 - irq0) / max(1e-9, total1 - total0)
        f["unaccounted_cpu_util"] = max(0.0, (busy1 - busy0) - (irq1 - irq0) - accounted) / max(1e-9, total1 - total0)
        f["waited_idle_s"] = self.waited_idle
        f["p50_lateness_s"] = quantile(c0["lateness"]["buckets"], c1["lateness"]["buckets"], 0.50)
        f["p99_lateness_s"] = quantile(c0["lateness"]["buckets"], c1["lateness"]["buckets"], 0.99)
        f["oldest_lateness_s"] = max(oldest_lateness, sched_lag)
        c2s0, c2s1 = c0.get("claim_to_start"), c1.get("claim_to_start")
        for q in (0.50, 0.99):
            f[f"c2s_p{int(q * 100)}_s"] = quantile(c2s0["buckets"], c2s1["buckets"], q) if c2s1 else float("nan")
        for stage, h1 in (c1.get("start_stages") or {}).items():
            f[f"c2s_{stage}_p99_s"] = quantile(c0["start_stages"][stage]["buckets"], h1["buckets"], 0.99)
        for name, vals in (("leases_out", leases_s), ("in_flight", flight_s or sock_flight_s)):
            lo, med, hi = spread(vals)
            f[f"{name}_min"], f[f"{name}_med"], f[f"{name}_max"] = lo, med, hi
        f["in_flight_source"] = "registry" if flight_s else "sockets"
        f["in_flight_samples"] = len(flight_s or sock_flight_s)
        for name in [*self.tree.procfile_names(), *(c.name for c in self.children)]:
            f[f"peak_fds_{name.replace('-', '_')}"] = peak_fds.get(name, 0)
        f["pg_rows_per_s"] = checks / window
        f["pg_bytes_per_hour"] = (pg_bytes1 - pg_bytes0) / window * 3600
        f["pg_bytes_per_row"] = (pg_bytes1 - pg_bytes0) / checks if checks else float("nan")
        f["pg_table_mb"] = pg_bytes1 / 2**20
        f["import_s"] = import_s
        f["import_routes_per_s"] = len(lines) / max(import_s, 1e-9)
        f["tarpit_ports"] = self.tarpit_ports * len(self.labs)
        for k in ("reaped", "reaped_waiting"):
            f[f"tarpit_{k}"] = sum((b.get("tarpit") or {}).get(k, 0) - (a.get("tarpit") or {}).get(k, 0)
                                   for a, b in zip(lab0, lab1))
        f["tarpit_peak_queue_pct"] = peak_queue_pct
        for k in ("ListenOverflows", "ListenDrops"):
            f[f"listen_{k[6:].lower()}"] = listen1.get(k, 0) - listen0.get(k, 0)
        f["lab_cpu_util"] = cpu_g.get("lab", 0.0) / window  # cores
        busy = busy1 - busy0
        f["lab_cpu_share"] = cpu_g.get("lab", 0.0) / busy if busy > 0 else float("nan")
        f["sched_lag_s"] = sched_lag
        f["due_end"] = due_end
        f["backlog_end"] = done1 - pg_total
        f["never_checked"] = never
        for outcome in ("retried", "lease_lost", "aborted", "malformed"):
            f[outcome] = c1["checks"].get(outcome, 0) - c0["checks"].get(outcome, 0)
        f["stale"] = c1["stale"] - c0["stale"]
        for name in self.tree.procfile_names():
            f[f"rss_mb_{name.replace('-', '_')}"] = rss.get(name, float("nan"))
        f["window_s"] = window
        f["by_kind"] = "/".join(f"{k}:{by_kind[k]}" for k in sorted(by_kind)) or "-"
        f["limited_by"] = limited_by(f)  # reads by_kind
        if "trickle" in extras:
            healthy = sum(n for host, n, _ in rows if kinds.get(host) == "echo")
            f["healthy_checks_per_s"] = healthy / window
            f["trickle_checks_window"] = sum(1 for row in trickle_rows if row[0] > max_id0)
            f["trickle_checks_total"] = len(trickle_rows)
            f["trickle_run_s"] = time.monotonic() - t_start
            f["trickle_errors"] = ",".join(sorted({str(row[2]) for row in trickle_rows})) or "-"
            f["trickle_attempts"] = ",".join(sorted({str(row[3]) for row in trickle_rows})) or "-"
            gaps = [(b[1] - a[1]).total_seconds() for a, b in zip(trickle_rows, trickle_rows[1:])]
            f["trickle_mean_gap_s"] = sum(gaps) / len(gaps) if gaps else float("nan")
            f["trickle_check_s_est"] = f["trickle_mean_gap_s"] - s.interval if gaps else float("nan")
            f["deadline_s"] = s.attempts * s.timeout
        return Result(f)

    def _oldest_due_s(self, keys) -> float:
        """Seconds the oldest claimable route is overdue now (0 when none is due)."""
        now_s, now_us = self.r.time()
        now_ms = now_s * 1000 + now_us / 1000
        pipe = self.r.pipeline(transaction=False)
        for sh in keys.all_shards():
            pipe.zrangebyscore(sh, "-inf", now_ms, start=0, num=1, withscores=True)
        oldest = [x[0][1] for x in pipe.execute() if x]
        return (now_ms - min(oldest)) / 1000 if oldest else 0.0

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.honcho and self.honcho.proc.poll() is not None:
                raise RuntimeError(f"honcho exited (rc={self.honcho.proc.returncode}) during warm-up")
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    def log_summary(self) -> dict[str, tuple[int, int, list[str]]]:
        """ERROR/WARNING lines of the Celery log, split at the moment the processes were told to stop:
        ``{"running": (errors, warnings, first distinct lines), "shutdown": (...)}``."""
        try:
            raw = (self.dir / "celery.log").read_bytes()
        except OSError:
            return {}
        cut = self.log_stop_offset if self.log_stop_offset is not None else len(raw)
        res = {}
        for part, text in (("running", raw[:cut]), ("shutdown", raw[cut:])):
            lines = text.decode(errors="replace").splitlines()
            errs = [ln for ln in lines if re.search(r"\b(ERROR|CRITICAL)\b|Traceback", ln)]
            warns = [ln for ln in lines if re.search(r"\bWARNING\b", ln) and "logfile ->" not in ln]
            firsts, seen = [], set()
            for ln in errs + warns:
                key = re.sub(r"^\S+\s+\S+\s+\|\s*", "", ln)
                key = re.sub(r"\[[^\]]*\]|pid:\d+|Job: \d+", "", key)[:100]
                if key not in seen:
                    seen.add(key)
                    firsts.append(ln.strip()[:400])
                if len(firsts) >= (8 if part == "running" else 3):
                    break
            res[part] = (len(errs), len(warns), firsts)
        return res

    def cleanup(self) -> None:
        if self.honcho is not None:
            try:
                self.log_stop_offset = (self.dir / "celery.log").stat().st_size
                self.celery_groups()  # remember every process before stopping
            except Exception:  # noqa: BLE001
                pass
            self.honcho.stop(grace=25)
            for p in list(self.seen.values()):  # anything honcho left behind (checked by create time)
                try:
                    if p.is_running():
                        p.kill()
                except psutil.Error:
                    pass
            try:  # leases still live once every process is gone: not handed back on shutdown
                from magpie.queue.keys import QueueKeys

                sec, usec = self.r.time()
                self.after_stop["leases_left_after_stop"] = self.r.zcount(
                    QueueKeys(self.prefix, 16).leased, f"({sec * 1000 + usec // 1000}", "+inf")
            except Exception:  # noqa: BLE001
                pass
        for c in reversed(self.children):
            try:
                c.stop()
            except Exception as exc:  # noqa: BLE001
                say(f"  could not stop {c.name}: {exc}")
        for fh in self.files:
            fh.close()
        if self.pg_engine is not None:
            self.pg_engine.dispose()
        try:
            admin = sa.create_engine(PG_BASE + "postgres", isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
            with admin.connect() as c:
                c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                          {"n": self.db})
                c.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.db}"'))
            admin.dispose()
        except Exception as exc:  # noqa: BLE001
            say(f"  could not drop database {self.db}: {exc}")
        try:
            n = 0
            for pattern in (f"pbench-{self.id}*", f"*pbench-{self.id}*"):
                batch = list(self.r.scan_iter(match=pattern, count=2000))
                for i in range(0, len(batch), 1000):
                    n += self.r.delete(*batch[i:i + 1000])
            say(f"  cleaned up: processes stopped, database dropped, {n} Redis keys deleted")
        except Exception as exc:  # noqa: BLE001
            say(f"  could not delete Redis keys of {self.prefix}: {exc}")


# -- orchestration ------------------------------------------------------------------------------------------


def parse_per_pop(text: str | None, cast) -> dict[str, object]:
    """``"N"`` (every population) or ``"name=N,name=N"`` -> {name or "*": value}."""
    if not text:
        return {}
    res = {}
    for part in text.split(","):
        part = part.strip()
        if "=" in part:
            k, v = part.split("=", 1)
            if k.strip() not in POPULATIONS:
                raise ValueError(f"unknown population {k!r}")
            res[k.strip()] = cast(v)
        elif part:
            res["*"] = cast(part)
    return res


def header(args, specs, trees) -> None:
    from magpie.lab.faults import mix_counts

    cpu_model = "?"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu_model = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    r = redis.Redis(REDIS_HOST, REDIS_PORT)
    rv = r.info("server").get("redis_version")
    try:
        eng = sa.create_engine(PG_BASE + "postgres", poolclass=sa.pool.NullPool)
        with eng.connect() as c:
            pgv = c.execute(sa.text("SHOW server_version")).scalar_one()
        eng.dispose()
    except Exception:  # noqa: BLE001
        pgv = "?"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "magpie", "lua", "Procfile"],
                           capture_output=True, text=True).stdout.strip()
    out(f"# pipeline_bench {time.strftime('%Y-%m-%d %H:%M:%S')} host={platform.node()} cpu={cpu_model!r} "
        f"cores={psutil.cpu_count()} mem_gb={psutil.virtual_memory().total / 2**30:.0f} "
        f"kernel={platform.release()} python={platform.python_version()} redis={rv} postgres={pgv} "
        f"nofile={resource.getrlimit(resource.RLIMIT_NOFILE)}")
    for t in trees:
        extra = (f" (HEAD {head}{' + uncommitted changes' if dirty else ''})"
                 if t.path_name == "engine" and "work tree" in t.ref else "")
        out(f"# path={t.path_name} tree={t.root} ref={t.ref}{extra} processes={','.join(t.procfile_names())}")
    if args.profiles:
        out("# engine: --profiles: a two-judge global pool (the judge under two URLs) and a check profile on the "
            "workspace (per-owner attribution and failure streaks on)")
    cpp = f"MAGPIE_CHECKS_PER_PROCESS={args.checks_per_process}" if args.checks_per_process else \
        "MAGPIE_CHECKS_PER_PROCESS unset (each tree's default)"
    out(f"# every path: its own Procfile and defaults, {cpp}, MAGPIE_INSTANCE_HEARTBEAT={INSTANCE_HEARTBEAT_S:g}; "
        f"Redis db {args.redis_db} (schedule + broker, own prefixes), own PostgreSQL database per run; "
        f"fault labs={args.fault_labs} (tarpit ports per lab: "
        f"{args.tarpit_ports or f'auto, at least {MIN_TARPIT_PORTS}'}), tarpits alternate "
        f"{'/'.join(TARPIT_PROTOCOLS)}; log level {args.log_level}; logs in {args.log_dir}")
    for s in specs:
        n = s.routes + (1 if s.name == "trickle" else 0)
        deadline = {"tarpit": s.routes, "mix": mix_counts(s.routes, MIX_SHARES)["tarpit"], "trickle": 1}.get(s.name, 0)
        out(f"# population={s.name} routes={n} interval_s={s.interval:g} demand_per_s={n / s.interval:g} "
            f"ideal_per_s={ideal_rate(s, deadline, n - deadline):.1f} "
            f"check_timeout_s={s.timeout:g} attempts={s.attempts} warmup_s={s.warmup:g} window_s={s.seconds:g}")


def result_line(spec: Spec, path: str, res: Result) -> str:
    if res.error:
        return f"pipeline population={spec.name} path={path} error={json.dumps(res.error)}"
    return f"pipeline population={spec.name} path={path} " + " ".join(
        f"{k}={fmt(v)}" for k, v in res.fields.items())


RATIO_FIGURES = ("checks_per_s", "achieved_ratio", "cpu_us_per_check", "cpu_us_per_check_worker_checks",
                 "p50_lateness_s", "p99_lateness_s", "oldest_lateness_s", "c2s_p99_s", "in_flight_med",
                 "leases_out_med", "peak_fds_worker_checks", "pg_bytes_per_hour", "lab_cpu_util")


def ratio_line(spec: Spec, new: Result, old: Result) -> str:
    """``pipeline-ratio`` line: new/baseline for the key figures (nan where either is missing or 0)."""
    def ratio(k):
        a, b = new.fields.get(k), old.fields.get(k)
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b or math.isnan(a) \
                or math.isnan(b):
            return float("nan")
        return a / b

    return f"pipeline-ratio population={spec.name} new/baseline " + " ".join(
        f"{k}_ratio={fmt(ratio(k))}" for k in RATIO_FIGURES)


def specs_from_args(ap: argparse.ArgumentParser, args) -> list[Spec]:
    """The populations' specs from the parsed flags; a bad combination or value exits through
    ``ap.error`` (one line, exit status 2)."""

    if args.quick_mix and args.quick:
        ap.error("--quick and --quick-mix exclude each other")
    if args.quick_mix and args.populations not in (None, "mix"):
        ap.error("--quick-mix measures the mix population only")
    if args.populations is None:
        args.populations = "mix" if args.quick_mix else ",".join(POPULATIONS)
    pops = [p.strip() for p in args.populations.split(",") if p.strip()]
    bad = [p for p in pops if p not in POPULATIONS]
    if bad:
        ap.error(f"unknown population(s): {', '.join(bad)}")
    for name, v in (("--seconds", args.seconds), ("--warmup", args.warmup), ("--timeout", args.timeout)):
        if v is not None and v < 0 or name != "--warmup" and v == 0:
            ap.error(f"{name} must be > 0: {v:g}")
    if args.attempts is not None and args.attempts < 1:
        ap.error(f"--attempts must be >= 1: {args.attempts}")
    if args.tarpit_ports is not None and not 1 <= args.tarpit_ports <= 1000:
        ap.error(f"--tarpit-ports must be 1..1000: {args.tarpit_ports}")
    base = QUICK_SPECS if args.quick else {**DEFAULT_SPECS, "mix": QUICK_MIX} if args.quick_mix else DEFAULT_SPECS
    try:
        routes = parse_per_pop(args.routes, int)
        intervals = parse_per_pop(args.interval, float)
    except ValueError as exc:
        ap.error(f"--routes/--interval: {exc}")
    if any(v < 1 for v in routes.values()) or any(v <= 0 for v in intervals.values()):
        ap.error("--routes must be >= 1 and --interval > 0")
    specs = []
    for p in pops:
        s = base[p]
        s = replace(s, routes=routes.get(p, routes.get("*", s.routes)),
                    interval=intervals.get(p, intervals.get("*", s.interval)))
        if args.seconds is not None:
            s = replace(s, seconds=args.seconds)
        if args.warmup is not None:
            s = replace(s, warmup=args.warmup)
        if args.timeout is not None:
            s = replace(s, timeout=args.timeout)
        if args.attempts is not None:
            s = replace(s, attempts=args.attempts)
        s = replace(s, warmup=s.interval if s.warmup is None else s.warmup,
                    seconds=s.interval if s.seconds is None else s.seconds)
        specs.append(s)
    return specs


def make_parser() -> argparse.ArgumentParser:
    """The benchmark's command-line parser."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--populations", "--population", dest="populations", default=None,
                    help="comma-separated, of " + ",".join(POPULATIONS) + " (default: all)")
    ap.add_argument("--routes", help="routes per population: N, or name=N,... (trickle: echo routes)")
    ap.add_argument("--interval", help="check interval (s) per population: X, or name=X,...")
    ap.add_argument("--seconds", type=float, help="measurement window (s) of every population")
    ap.add_argument("--warmup", type=float, help="warm-up (s) after the first claims, every population")
    ap.add_argument("--timeout", type=float, help="MAGPIE_CHECK_TIMEOUT of every population")
    ap.add_argument("--attempts", type=int, help="MAGPIE_CHECK_ATTEMPTS of every population")
    ap.add_argument("--quick", action="store_true", help="small populations and short windows (smoke run)")
    ap.add_argument("--quick-mix", action="store_true",
                    help="the goal's quick form: population mix, 200,000 routes, 60 s interval (one interval "
                         "of warm-up, one measured)")
    ap.add_argument("--skip-baseline", action="store_true", help="measure the engine path only")
    ap.add_argument("--profiles", action="store_true",
                    help="engine path with a two-judge pool and a check profile on the workspace")
    ap.add_argument("--baseline-ref", default="daf0a42",
                    help="git ref of the baseline, run from its own Procfile (default daf0a42, the thread-based "
                         "checker); any ref with the current Procfile layout, e.g. 7adb9e4")
    ap.add_argument("--checks-per-process", type=int, default=None,
                    help="MAGPIE_CHECKS_PER_PROCESS of every path (default: unset, each tree's own default)")
    ap.add_argument("--check-concurrency", type=int, default=None,
                    help="MAGPIE_CHECK_CONCURRENCY of every path (default: unset, each tree sizes its own)")
    ap.add_argument("--tarpit-ports", type=int, default=None,
                    help=f"tarpit listening ports per fault lab (default: enough for the population's open "
                         f"connections, at least {MIN_TARPIT_PORTS})")
    ap.add_argument("--fault-labs", type=int, default=2, choices=range(1, len(LAB_HOST_BASES) + 1),
                    help="fault-server processes; routes spread over them")
    ap.add_argument("--redis-db", type=int, default=3, help="Redis database for schedule and broker")
    ap.add_argument("--log-level", default="warning", help="MAGPIE_LOG_LEVEL of the Celery processes")
    ap.add_argument("--log-dir", help="where run logs go (kept); default a new /tmp/pipeline_bench-* dir")
    ap.add_argument("--no-snapshot", action="store_true",
                    help="run the engine path from /work/main itself, not from a copy taken at start")
    ap.add_argument("--engine-ref", help="run the engine path from this git ref (git archive) instead of the "
                                         "work tree")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra environment variable of every path's processes (repeatable), e.g. a setting")
    ap.add_argument("--wait-idle", type=float, default=90,
                    help="before each run wait at most this many seconds for the machine to be < 25%% busy")
    ap.add_argument("--snapshot-wait", type=float, default=180,
                    help="seconds to keep retrying a work-tree snapshot that does not import")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = make_parser()
    args = ap.parse_args(argv)
    specs = specs_from_args(ap, args)
    args.log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pipeline_bench-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)

    signal.signal(signal.SIGTERM, _interrupt)
    global LAB_ROOT
    baseline_dir = snap_dir = None
    trees = [Tree("engine", ROOT, "work tree")]
    try:
        if args.engine_ref:
            snap_dir, commit = extract_ref(args.engine_ref, "pbench-engine-")
            problem = tree_imports(snap_dir)
            if problem:
                raise SystemExit(f"--engine-ref {args.engine_ref} does not import: {problem}")
            trees = [Tree("engine", snap_dir, f"{args.engine_ref} ({commit[:10]})")]
            LAB_ROOT = snap_dir
            sys.path.insert(0, str(snap_dir))
        elif not args.no_snapshot:
            for attempt in range(max(1, int(args.snapshot_wait // 20) + 1)):
                snap_dir = Path(tempfile.mkdtemp(prefix="pbench-engine-"))
                digest = snapshot_tree(snap_dir)
                problem = tree_imports(snap_dir)
                if problem is None:
                    break
                say(f"work tree snapshot does not import ({problem}); retrying in 20s")
                shutil.rmtree(snap_dir, ignore_errors=True)
                snap_dir = None
                time.sleep(20)
            if snap_dir is None:
                raise SystemExit(f"the work tree does not import: {problem}")
            trees = [Tree("engine", snap_dir, f"snapshot of the work tree at {time.strftime('%H:%M:%S')}, "
                                              f"files sha1 {digest}")]
            LAB_ROOT = snap_dir
            sys.path.insert(0, str(snap_dir))
        if not args.skip_baseline:
            baseline_dir, commit = extract_ref(args.baseline_ref, "pbench-baseline-")
            problem = tree_imports(baseline_dir)
            if problem:
                raise SystemExit(f"--baseline-ref {args.baseline_ref} does not import: {problem}")
            if "worker-checks" not in Tree("baseline", baseline_dir, "").procfile_names():
                raise SystemExit(f"--baseline-ref {args.baseline_ref}: its Procfile has no worker-checks process")
            trees.append(Tree("baseline", baseline_dir, f"{args.baseline_ref} ({commit[:10]})"))
        header(args, specs, trees)
        started = time.monotonic()
        for s in specs:
            results: dict[str, Result] = {}
            for tree in trees:
                say(f"population {s.name}, path {tree.path_name}")
                run = Run(s, tree, args, args.log_dir)
                try:
                    res = run.execute()
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # noqa: BLE001 - report and go on with the next run
                    res = Result(error=f"{exc.__class__.__name__}: {exc}")
                results[tree.path_name] = res
                out(result_line(s, tree.path_name, res))
                if not res.error and not res.fields.get("checks_per_s"):
                    out(f"# note population={s.name} path={tree.path_name}: no result reached PostgreSQL in the "
                        f"window; retried (judge unreachable) {res.fields.get('retried')}, completed_per_s "
                        f"{fmt(res.fields.get('completed_per_s', 0.0))}")
                for part, (n_err, n_warn, firsts) in run.log_summary().items():
                    if n_err or n_warn:
                        out(f"# log population={s.name} path={tree.path_name} phase={part} error_lines={n_err} "
                            f"warning_lines={n_warn} ({run.dir / 'celery.log'})")
                        for ln in firsts:
                            out(f"#   {ln}")
            if "engine" in results and "baseline" in results:
                out(ratio_line(s, results["engine"], results["baseline"]))
        out(f"# total {time.monotonic() - started:.0f}s")
        return 0
    except KeyboardInterrupt:
        say("interrupted; everything started was stopped")
        return 130
    finally:
        for d in (baseline_dir, snap_dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
