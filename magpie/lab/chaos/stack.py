"""One magpie deployment for a fault scenario: the Procfile's processes on private servers and a lab.

A :class:`Stack` owns a private Redis for the schedule (and the results stream), a private Redis for the
broker (or a database of the first one; or, with ``broker="amqp"``, a vhost of its own on the local
RabbitMQ, :class:`magpie.lab.rabbitmq.Vhost`), a database of its own on a :class:`PrivatePostgres`, a judge and
the lab's fault servers in threads of the calling process, and the Celery processes it spawns by role
(``promote``, ``checks``, ``jobs``, ``beat``: the Procfile's command lines, each in its own session). The
harness plays the supervisor: a scenario that kills a whole process starts it again with
:meth:`Stack.spawn`. :meth:`Stack.close` stops everything it started, by PID, and drops its database.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from magpie.lab.chaos.servers import PrivatePostgres, PrivateRedis

KEY = "chaos-suite-key-0123456789abcdef"
PREFIX = "chaos:"
WORKSPACE = "chaos"
LAB_HOST_BASE = "127.0.0.120"
ROOT = Path(__file__).resolve().parents[3]

BROKERS = ("redis", "amqp")
"""Brokers a stack runs on."""

ROLES = {
    "promote": ["worker", "-Q", "promote", "--pool=solo"],
    "checks": ["worker", "-Q", "checks", "--concurrency=2"],
    "jobs": ["worker", "-Q", "stats,alerts,delivery,email,maintenance", "--concurrency=2"],
}
"""Worker roles as in the Procfile (``beat`` apart: it takes a schedule file)."""

BASE_ENV = {
    "MAGPIE_CHECK_INTERVAL": "2",
    "MAGPIE_CHECK_TIMEOUT": "1",
    "MAGPIE_CHECK_ATTEMPTS": "1",
    "MAGPIE_LEASE_SECONDS": "4",
    "MAGPIE_RENEW_BELOW_SECONDS": "1.5",
    "MAGPIE_CHECKS_PER_PROCESS": "500",
    "MAGPIE_CHECKER_HEARTBEAT": "1",
    "MAGPIE_MAINTENANCE_LOCK_TTL": "6",  # quiet period after a Redis start: a third of it + 1 s
    "MAGPIE_CHECK_ALLOW_PRIVATE": "127.0.0.0/8",
    "MAGPIE_LOG_LEVEL": "info",
    # one judge, no per-workspace profile longer than the check itself: a check never outlives its lease
    "MAGPIE_JUDGE_FAILOVERS": "0",
    "MAGPIE_PROFILE_MAX_TIMEOUT": "1",
    "MAGPIE_PROFILE_MAX_ATTEMPTS": "1",
}
"""Settings of every scenario unless it overrides them: short cycles, so faults play out in seconds."""


class Proc:
    """One spawned Celery process group: ``role``, ``popen``, ``log`` (path), ``node`` (the network
    namespace host it runs in, :class:`magpie.lab.chaos.netstack.NetStack`; None on this host)."""

    def __init__(self, role: str, popen: subprocess.Popen, log: Path, node: str | None = None) -> None:
        self.role, self.popen, self.log, self.node = role, popen, log, node

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def pids(self) -> list[int]:
        """The group leader and its descendants alive now."""
        try:
            p = psutil.Process(self.pid)
            return [p.pid] + [c.pid for c in p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def children(self) -> list[int]:
        """Pool children (descendants of the leader) alive now."""
        try:
            return [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the group (warm shutdown: leases are handed back), SIGKILL after ``grace`` s."""
        if self.alive():
            self.signal_group(signal.SIGCONT)
            self.signal_group(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.popen.wait()
        for pid in self.pids():  # a pool child left behind by its killed leader
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Stack:
    """A deployment on private servers; see the module doc.

    Args:
        name: scenario name (database and log names).
        pg: the private PostgreSQL server the stack's database is created on.
        env: ``MAGPIE_*`` settings over :data:`BASE_ENV` (strings).
        cadences: maintenance job -> seconds; every other registered job is switched off (0).
        separate_broker: the broker on a private Redis of its own (else database 1 of the schedule's).
        log_dir: where process logs go (a new temporary directory when None).
        broker: ``redis`` or ``amqp`` (a RabbitMQ vhost of the stack's own, deleted on close; it is
            separate from the schedule whatever ``separate_broker`` says).
    Raises :class:`magpie.lab.chaos.servers.ServerError` when a private server does not start,
    :class:`magpie.lab.rabbitmq.RabbitUnavailable` when RabbitMQ is not reachable, ValueError for another
    ``broker``.
    """

    def __init__(self, name: str, pg: PrivatePostgres, env: dict[str, str] | None = None,
                 cadences: dict[str, float] | None = None, separate_broker: bool = False,
                 log_dir: Path | None = None, broker: str = "redis") -> None:
        from magpie.lab.rabbitmq import Vhost
        from magpie.wiring.jobs import JOBS

        if broker not in BROKERS:
            raise ValueError(f"broker must be one of {', '.join(BROKERS)}, not {broker!r}")

        self.name = name
        self.pg = pg
        self.dir = Path(log_dir or tempfile.mkdtemp(prefix=f"magpie-chaos-{name}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.db = f"chaos_{name.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
        self.procs: list[Proc] = []
        self._n = 0
        self.redis_server = PrivateRedis()
        self.broker = broker
        self.vhost = Vhost() if broker == "amqp" else None
        self.broker_server = PrivateRedis() if separate_broker and not self.vhost else None
        self.lab = self.judge = None
        self.extra_kinds: dict[str, str] = {}  # listen host -> kind of servers beside the lab (measure.route_kinds)
        cad = {j: 0.0 for j in JOBS}
        cad.update(cadences or {})
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("MAGPIE_", "PROXY_", "CELERY"))}
        self.env.update(BASE_ENV)
        self.env.update({
            "MAGPIE_REDIS_URL": self.redis_server.url, "MAGPIE_REDIS_PREFIX": PREFIX,
            "MAGPIE_BROKER_URL": (self.vhost.url if self.vhost else self.broker_server.url if self.broker_server
                                  else self.redis_server.url[:-1] + "1"),
            "MAGPIE_DATABASE_URL": pg.url(self.db), "PROXY_ENCRYPTION_KEY": KEY,
            "MAGPIE_MAINTENANCE_CADENCES": ",".join(f"{k}={v:g}" for k, v in cad.items()),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT),  # the processes run the code the harness imported
        })
        self.env.update(env or {})

    # -- services -------------------------------------------------------------------------------------

    def start_services(self) -> None:
        """Start the private Redis servers, the judge and fault lab, create and migrate the database."""
        from magpie.checker.judge import JudgeThread
        from magpie.db.migrate import upgrade
        from magpie.lab.faults import start_free_fault_lab

        self.r = self.redis_server.start()
        if self.broker_server:
            self.broker_server.start()
        if self.vhost:
            self.vhost.create()
        self.judge = JudgeThread("127.0.0.1", 0)
        self.env["MAGPIE_JUDGE_URL"] = self.judge.url
        self.lab = start_free_fault_lab(LAB_HOST_BASE, slow_delay=float(self.env.get("CHAOS_SLOW_DELAY", 1.5)),
                                        judge_port=self.judge.port)
        self.pg.execute(f'CREATE DATABASE "{self.db}"')
        upgrade(self.pg.url(self.db), encryption_key=KEY)
        import sqlalchemy as sa

        self.engine = sa.create_engine(self.pg.url(self.db), poolclass=sa.pool.NullPool)

    def restart_broker_empty(self, down_s: float = 1.0) -> None:
        """The broker comes back empty after ``down_s`` seconds: the private Redis broker killed and started
        again, or the RabbitMQ vhost deleted (its connections closed, its queues and messages gone) and
        created again. Raises RuntimeError for a broker on the schedule's Redis (nothing to restart)."""
        if self.vhost:
            self.vhost.delete()
            time.sleep(down_s)
            self.vhost.create()
        elif self.broker_server:
            self.broker_server.kill()
            time.sleep(down_s)
            self.broker_server.start()
        else:
            raise RuntimeError("the broker shares the schedule's Redis: start the stack with separate_broker")

    def settings(self):
        """In-process :class:`magpie.config.Settings` equal to the processes' environment."""
        from magpie.config import load_settings

        return load_settings(**{k: v for k, v in self.env.items() if k.startswith(("MAGPIE_", "PROXY_"))})

    def queue(self):
        from magpie.queue.provider import create_provider

        return create_provider(None, self.settings(), redis_client=self.r)

    def import_lines(self, lines: list[str]) -> int:
        """Import proxy-list ``lines`` into workspace ``chaos`` (PostgreSQL and the schedule); returns the
        count imported. Raises RuntimeError when a line is refused."""
        from magpie.importer.service import import_file

        path = self.dir / f"routes-{len(lines)}.txt"
        path.write_text("\n".join(lines) + "\n")
        rep = import_file(path, WORKSPACE, self.settings())
        if rep.invalid or rep.imported != len(lines):
            raise RuntimeError(f"import stored {rep.imported} of {len(lines)} routes: {rep.invalid[:3]}")
        return rep.imported

    def address(self, kind: str) -> str:
        """``host:port`` of a fault-lab server kind (echo, slow, trickle, tarpit, refused)."""
        return self.lab.addresses[kind]

    # -- processes ------------------------------------------------------------------------------------

    def spawn(self, role: str, node: str | None = None, **env: str) -> Proc:
        """Start one Procfile process (``promote``, ``checks``, ``jobs`` or ``beat``) in its own session,
        output to its own log; ``env`` overrides settings for this process only. ``node``: the host to run
        it on (subclasses with several hosts; None: :meth:`place` picks)."""
        self._n += 1
        node = node or self.place(role)
        log = self.dir / f"{role}-{self._n}{'-' + node if node else ''}.log"
        if role == "beat":
            args = ["beat", f"--schedule={self.dir / f'beat-{self._n}'}"]
        else:
            args = [*ROLES[role], "-n", f"{role}{self._n}@{node or 'chaos'}", "--without-mingle",
                    "--without-gossip"]
        args.append(f"--loglevel={self.env['MAGPIE_LOG_LEVEL']}")
        with open(log, "ab") as fh:
            popen = subprocess.Popen(self.wrap(node, [sys.executable, "-m", "celery", "-A", "magpie", *args]),
                                     cwd=ROOT, env={**self.env, **env}, stdin=subprocess.DEVNULL, stdout=fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        p = Proc(role, popen, log, node)
        self.procs.append(p)
        return p

    def place(self, role: str) -> str | None:
        """The host a new ``role`` process runs on (None: this one, the only host of a plain Stack)."""
        return None

    def wrap(self, node: str | None, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` on ``node`` (here: ``argv`` itself)."""
        return argv

    def running(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role and p.alive()]

    def all_pids(self) -> set[int]:
        """Every process of every group this stack started, alive now."""
        return {pid for p in self.procs for pid in p.pids()}

    def wait_engines(self, n: int, timeout: float = 60.0) -> None:
        """Wait until ``n`` check engines announce their slots; raises RuntimeError (with a log tail)."""
        reg = self.queue().capacity_registry()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(reg.engines()) >= n:
                return
            time.sleep(0.25)
        raise RuntimeError(f"{self.name}: fewer than {n} check engines after {timeout:g}s\n{self.log_tail()}")

    def log_tail(self, chars: int = 2500) -> str:
        out = []
        for p in self.procs[-4:]:
            try:
                out.append(f"--- {p.log.name}\n" + p.log.read_text(errors="replace")[-chars:])
            except OSError:
                pass
        return "\n".join(out)

    def stop_processes(self, roles: tuple[str, ...] = ("beat", "promote", "checks", "jobs")) -> None:
        """Stop the processes of ``roles``, in that order (claiming first, then the checks hand back)."""
        for role in roles:
            group = [p for p in self.procs if p.role == role and p.alive()]
            for p in group:  # the processes of one role stop together
                p.signal_group(signal.SIGCONT)
                p.signal_group(signal.SIGTERM)
            for p in group:
                p.stop()

    def close(self, keep_logs: bool = False) -> None:
        """Stop every process, server and thread started, drop the database. Never raises."""
        for p in self.procs:  # every group told at once, then each waited for
            if p.alive():
                p.signal_group(signal.SIGCONT)
                p.signal_group(signal.SIGTERM)
        for p in self.procs:
            with contextlib.suppress(Exception):  # cleanup goes on whatever one step raises
                p.stop(grace=5)
        for stopper in (getattr(self.lab, "stop", None), getattr(self.judge, "stop", None),
                        self.redis_server.stop,
                        self.broker_server.stop if self.broker_server else None,
                        self.vhost.delete if self.vhost else None):
            if stopper:
                with contextlib.suppress(Exception):
                    stopper()
        with contextlib.suppress(Exception):
            if getattr(self, "engine", None) is not None:
                self.engine.dispose()
            if self.pg.running():
                self.pg.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{self.db}'")
                self.pg.execute(f'DROP DATABASE IF EXISTS "{self.db}"')
        if not keep_logs:
            shutil.rmtree(self.dir, ignore_errors=True)
