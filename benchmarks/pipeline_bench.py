"""End-to-end pipeline benchmark: the Procfile's real processes on fault-lab route populations.

For every population and path it starts a judge and the lab's fault servers (``magpie.lab.faults``),
creates a fresh PostgreSQL database (migrated by the path's own ``magpie db upgrade``), imports the
population with the path's own ``magpie import`` into a fresh Redis key prefix (broker on its own Redis
database with its own key prefix), starts the path's Procfile processes through honcho (beat -> promote ->
check -> complete -> stream -> PostgreSQL ingestion), waits for the first claims plus ``--warmup`` seconds,
measures for ``--seconds``, stops everything and drops/deletes what it created. It prints a header, one
``pipeline`` line per population and path and one ``pipeline-ratio`` line per population (engine against
the baseline measured in the same run).

Paths:
  engine   the work tree (its Procfile: worker-promote, worker-checks, worker-jobs, beat)
  threads  the thread-based check path of ``--baseline-ref`` (default daf0a42), extracted with
           ``git archive`` to a temporary directory and run from there (its own Procfile, celeryconfig.py,
           lua/ and magpie package; the same virtualenv)

Populations: live (echo), refused, tarpit, mix (70 % tarpit, 10 % refused, 15 % echo, 5 % slow), trickle
(one trickle route among echo routes).

Figures per line (window = ``--seconds`` after warm-up):
  checks_per_s            check_history rows added in the window / window (end to end)
  completed_per_s         results published to the stream (metrics counters alive+dead) / window
  demand_per_s            routes / interval
  peak_inflight_per_process  max over 0.5 s samples and worker-checks processes of open TCP sockets
  lab_conns_peak          max over samples of the fault servers' open sockets (their accepted connections)
  cpu_us_per_check        (magpie processes + Redis + PostgreSQL) CPU in the window / checks
  cpu_us_per_check_<proc> per Procfile process (all its processes: shell, Celery main, pool children)
  redis_cpu_us_per_check  Redis ``INFO cpu`` (used_cpu_user + used_cpu_sys) delta / checks
  pg_cpu_us_per_check     every ``postgres`` process (the postmaster incl. reaped backends) / checks
  lab_cpu_us_per_check    fault servers + judge (not part of cpu_us_per_check)
  p50/p99_lateness_s      from the check-lateness histogram delta (bucket interpolation)
  sched_lag_s / due_end   at the window's end: now minus the oldest claimable score, claimable routes
  rss_mb_<proc>           largest RSS of one process of that Procfile process at the window's end

    .venv/bin/python benchmarks/pipeline_bench.py                 # all populations, both paths (~15 min)
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
START_DEADLINE_S = 90.0
MIX_SHARES = {"tarpit": 0.70, "refused": 0.10, "echo": 0.15, "slow": 0.05}
POPULATIONS = ("live", "refused", "tarpit", "mix", "trickle")
LAB_HOST_BASES = ("127.0.0.20", "127.0.0.40", "127.0.0.60", "127.0.0.80")


@dataclass
class Spec:
    """One population's settings. ``routes`` for trickle counts the echo routes (plus one trickle)."""

    name: str
    routes: int
    interval: float
    warmup: float
    seconds: float
    timeout: float = 10.0
    attempts: int = 2


DEFAULT_SPECS = {
    "live": Spec("live", 20_000, 5.0, 10, 30),
    "refused": Spec("refused", 20_000, 5.0, 10, 30),
    "tarpit": Spec("tarpit", 30_000, 5.0, 30, 30),
    "mix": Spec("mix", 30_000, 120.0, 30, 30),
    "trickle": Spec("trickle", 1_000, 5.0, 10, 50),
}
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
    from magpie.lab.faults import mix_lines, population_lines

    n_labs = len(labs)

    def split(n: int) -> list[int]:
        return [n // n_labs + (1 if i < n % n_labs else 0) for i in range(n_labs)]

    def interleave(lists: list[list[str]]) -> list[str]:
        res = []
        for i in range(max((len(x) for x in lists), default=0)):
            res.extend(x[i] for x in lists if i < len(x))
        return res

    extras: dict = {}
    if spec.name in ("live", "refused", "tarpit"):
        kind = {"live": "echo"}.get(spec.name, spec.name)
        lines = interleave([population_lines(lab[kind], n) for lab, n in zip(labs, split(spec.routes))])
    elif spec.name == "mix":
        lines = interleave([[line for _, line in mix_lines(lab, n, MIX_SHARES)]
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
    return {addr.rsplit(":", 1)[0]: kind for lab in labs for kind, addr in lab.items() if kind != "pid"}


# -- one run ----------------------------------------------------------------------------------------------


@dataclass
class Tree:
    path_name: str  # engine | threads
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
    code = ("import magpie.tasks, magpie.cli, magpie.importer.service\n"
            "try:\n    import magpie.checkpool\nexcept ModuleNotFoundError:\n    pass\n"
            "import magpie.queue.scripts as s, sys\n"
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
            "PYTHONUNBUFFERED": "1",
        })
        if self.tree.path_name == "engine":
            env["MAGPIE_CHECKS_PER_PROCESS"] = str(self.args.checks_per_process)
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
        for i in range(args.fault_labs):
            c = Child(f"faults{i}", [PY, "-m", "magpie.lab.faults", "--host-base", LAB_HOST_BASES[i],
                                     "--judge-host", "127.0.0.1", "--judge-port", str(judge_port)],
                      cwd=LAB_ROOT, env={**os.environ, "PYTHONPATH": str(LAB_ROOT)}, log=lab_log,
                      stdout_pipe=True, preexec=_raise_nofile)
            self.children.append(c)
            self.labs.append(json.loads(c.first_line(20)))
        lines, extras = build_lines(s, self.labs)
        kinds = host_kinds(self.labs)
        list_file = self.dir / "routes.txt"
        list_file.write_text("\n".join(lines) + "\n")
        env = self.env(judge_url)
        t = time.monotonic()
        self.magpie_cli(env, "db", "upgrade")
        rep = json.loads(self.magpie_cli(env, "import", str(list_file), "--workspace", WORKSPACE, "--json"))
        if rep.get("invalid") or rep.get("imported") != len(lines):
            raise RuntimeError(f"import stored {rep.get('imported')} of {len(lines)} routes: {rep.get('invalid')[:3]}")
        say(f"  db {self.db} migrated, {len(lines)} routes imported in {time.monotonic() - t:.1f}s")
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

        from magpie.metrics import read_counters
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
        with self.pg_engine.connect() as conn:
            max_id0 = conn.execute(sa.text("SELECT coalesce(max(id), 0) FROM check_history")).scalar_one()
        t0 = time.monotonic()
        peak_sock, peak_lab = 0, 0
        sum_sock = sum_leased = n_samples = 0
        trace = open(self.dir / "samples.csv", "w")
        self.files.append(trace)
        trace.write("t_s,check_process_sockets,live_leases,lab_sockets\n")
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
            peak_sock = max(peak_sock, top)
            sum_sock += top
            leased = self.r.zcount(keys.leased, f"({int(time.time() * 1000)}", "+inf")
            sum_leased += leased
            n_samples += 1
            lab_n = sum(socks.count(c.ps.pid) for c in self.children if c.name != "judge")
            peak_lab = max(peak_lab, lab_n)
            trace.write(f"{now - t0:.2f},{'/'.join(map(str, sorted(per_proc)))},{leased},{lab_n}\n")
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
        with self.pg_engine.connect() as conn:
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
            "demand_per_s": len(lines) / s.interval, "completed_per_s": (done1 - done0) / window,
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
                raise SystemExit(f"unknown population {k!r}")
            res[k.strip()] = cast(v)
        elif part:
            res["*"] = cast(part)
    return res


def header(args, specs, trees) -> None:
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
    out(f"# engine: MAGPIE_CHECKS_PER_PROCESS={args.checks_per_process}, Procfile defaults otherwise "
        f"(MAGPIE_CHECK_CONCURRENCY 2 check processes); threads: its Procfile defaults (4 check processes, "
        f"16 threads per message, MAGPIE_MAX_INFLIGHT 10000); Redis db {args.redis_db} (schedule + broker, "
        f"own prefixes), own PostgreSQL database per run; fault labs={args.fault_labs}; "
        f"log level {args.log_level}; logs in {args.log_dir}")
    for s in specs:
        n = s.routes + (1 if s.name == "trickle" else 0)
        out(f"# population={s.name} routes={n} interval_s={s.interval:g} demand_per_s={n / s.interval:g} "
            f"check_timeout_s={s.timeout:g} attempts={s.attempts} warmup_s={s.warmup:g} window_s={s.seconds:g}")


def result_line(spec: Spec, path: str, res: Result) -> str:
    if res.error:
        return f"pipeline population={spec.name} path={path} error={json.dumps(res.error)}"
    return f"pipeline population={spec.name} path={path} " + " ".join(
        f"{k}={fmt(v)}" for k, v in res.fields.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--populations", default=",".join(POPULATIONS), help="comma-separated, of " + ",".join(POPULATIONS))
    ap.add_argument("--routes", help="routes per population: N, or name=N,... (trickle: echo routes)")
    ap.add_argument("--interval", help="check interval (s) per population: X, or name=X,...")
    ap.add_argument("--seconds", type=float, help="measurement window (s) of every population")
    ap.add_argument("--warmup", type=float, help="warm-up (s) after the first claims, every population")
    ap.add_argument("--timeout", type=float, help="MAGPIE_CHECK_TIMEOUT of every population")
    ap.add_argument("--attempts", type=int, help="MAGPIE_CHECK_ATTEMPTS of every population")
    ap.add_argument("--quick", action="store_true", help="small populations and short windows (smoke run)")
    ap.add_argument("--skip-baseline", action="store_true", help="measure the engine path only")
    ap.add_argument("--profiles", action="store_true",
                    help="engine path with a two-judge pool and a check profile on the workspace")
    ap.add_argument("--baseline-ref", default="daf0a42", help="git ref of the thread-based baseline")
    ap.add_argument("--checks-per-process", type=int, default=10_000, help="engine MAGPIE_CHECKS_PER_PROCESS")
    ap.add_argument("--fault-labs", type=int, default=2, choices=range(1, len(LAB_HOST_BASES) + 1),
                    help="fault-server processes; routes spread over them")
    ap.add_argument("--redis-db", type=int, default=3, help="Redis database for schedule and broker")
    ap.add_argument("--log-level", default="warning", help="MAGPIE_LOG_LEVEL of the Celery processes")
    ap.add_argument("--log-dir", help="where run logs go (kept); default a new /tmp/pipeline_bench-* dir")
    ap.add_argument("--no-snapshot", action="store_true",
                    help="run the engine path from /work/main itself, not from a copy taken at start")
    ap.add_argument("--engine-ref", help="run the engine path from this git ref (git archive) instead of the "
                                         "work tree")
    ap.add_argument("--wait-idle", type=float, default=90,
                    help="before each run wait at most this many seconds for the machine to be < 25%% busy")
    ap.add_argument("--snapshot-wait", type=float, default=180,
                    help="seconds to keep retrying a work-tree snapshot that does not import")
    args = ap.parse_args(argv)

    pops = [p.strip() for p in args.populations.split(",") if p.strip()]
    bad = [p for p in pops if p not in POPULATIONS]
    if bad:
        ap.error(f"unknown population(s): {', '.join(bad)}")
    base = QUICK_SPECS if args.quick else DEFAULT_SPECS
    routes = parse_per_pop(args.routes, int)
    intervals = parse_per_pop(args.interval, float)
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
        specs.append(s)
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
            trees.append(Tree("threads", baseline_dir, f"{args.baseline_ref} ({commit[:10]})"))
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
            if "engine" in results and "threads" in results:
                e, t = results["engine"], results["threads"]

                def ratio(a, b):
                    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")

                out(f"pipeline-ratio population={s.name} checks_per_s_ratio={fmt(ratio(e.checks_per_s, t.checks_per_s))} "
                    f"cpu_us_per_check_ratio={fmt(ratio(e.cpu_us, t.cpu_us))}")
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
