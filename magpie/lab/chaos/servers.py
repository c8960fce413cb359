"""Private Redis and PostgreSQL servers on free loopback ports, for fault scenarios that stop, restart,
pause or make read-only the servers magpie depends on (never the shared ones).

Each server is one child process this module started and stops by its PID; data lives in a temporary
directory removed on :meth:`stop`. PostgreSQL refuses to run as root, so when the harness runs as root
the cluster is created and run as the ``postgres`` system user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import redis

from magpie.errors import MagpieError


class ServerError(MagpieError, RuntimeError):
    """A private server binary is missing or the server did not start; the message says which."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (racy by nature; callers start at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A ``redis-server`` on its own port with persistence off, so a restart comes back empty.

    ``start()`` -> client (also after :meth:`kill`, same port); ``kill()`` SIGKILLs it, ``pause()`` /
    ``resume()`` send SIGSTOP / SIGCONT, ``stop()`` kills it and removes its directory. Raises
    :class:`ServerError` when ``redis-server`` is not installed or does not answer within 5 s.
    """

    def __init__(self) -> None:
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            raise ServerError("redis-server binary not installed")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="magpie-chaos-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> redis.Redis:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--maxclients", "1000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        c = redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=1)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                c.ping()
                return c
            except redis.ConnectionError:
                time.sleep(0.025)
        self.kill()
        raise ServerError(f"private redis-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    exe = shutil.which(name)
    if exe is None:
        raise ServerError(f"PostgreSQL binary {name} not found (looked in /usr/lib/postgresql/*/bin and PATH)")
    return exe


class PrivatePostgres:
    """A PostgreSQL cluster of its own (``initdb``) on a free port, trust authentication on loopback.

    ``start()`` starts the postmaster (first call creates the cluster), ``stop()`` stops it (fast shutdown,
    SIGINT to the postmaster's PID, SIGKILL after 20 s), ``read_only(on)`` makes every session's new
    transactions read-only or writable again (``ALTER SYSTEM`` + reload: sessions already open see it at
    once, pings still succeed), ``destroy()`` stops it and removes the cluster. ``url(db)`` is a
    SQLAlchemy URL. Raises :class:`ServerError` when a binary is missing or the server does not start.
    """

    def __init__(self) -> None:
        self.initdb, self.postgres = _pg_bin("initdb"), _pg_bin("postgres")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="magpie-chaos-pg-")
        self.data = os.path.join(self.dir, "data")
        self.proc: subprocess.Popen | None = None
        self._user = None
        if os.geteuid() == 0:
            self._user = pwd.getpwnam("postgres")
            os.chown(self.dir, self._user.pw_uid, self._user.pw_gid)

    def url(self, db: str = "postgres") -> str:
        """SQLAlchemy URL of database ``db`` on this server (user ``postgres``, no password)."""
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{db}"

    def _as_user(self) -> dict:
        """``subprocess`` arguments running a child as the ``postgres`` user when we are root."""
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}

    def start(self) -> None:
        if not os.path.exists(os.path.join(self.data, "PG_VERSION")):
            p = subprocess.run([self.initdb, "-D", self.data, "-U", "postgres", "-A", "trust", "--no-sync",
                                "-E", "UTF8", "--locale=C"], capture_output=True, text=True,
                               check=False, cwd=self.dir, **self._as_user())
            if p.returncode != 0:
                raise ServerError(f"initdb failed: {(p.stderr or p.stdout).strip()[-300:]}")
        with open(os.path.join(self.dir, "postgres.log"), "ab") as log:
            self.proc = subprocess.Popen(
                [self.postgres, "-D", self.data, "-p", str(self.port), "-h", "127.0.0.1", "-k", self.dir,
                 "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                 "-c", "shared_buffers=32MB", "-c", "max_connections=60"],
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True, cwd=self.dir, **self._as_user())
        import psycopg2

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"private postgres exited (rc={self.proc.returncode}), see "
                                  f"{os.path.join(self.dir, 'postgres.log')}")
            try:
                psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                                 connect_timeout=1).close()
                return
            except psycopg2.OperationalError:
                time.sleep(0.1)
        self.stop()
        raise ServerError(f"private postgres on port {self.port} did not start within 30 s")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.running():
            os.kill(self.proc.pid, signal.SIGINT)  # fast shutdown: sessions are disconnected
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def execute(self, sql: str, db: str = "postgres") -> None:
        """Run one statement with autocommit (e.g. ``CREATE DATABASE``)."""
        import psycopg2

        c = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=db, connect_timeout=5)
        try:
            c.autocommit = True
            with c.cursor() as cur:
                cur.execute(sql)
        finally:
            c.close()

    def read_only(self, on: bool) -> None:
        self.execute(f"ALTER SYSTEM SET default_transaction_read_only = {'on' if on else 'off'}")
        self.execute("SELECT pg_reload_conf()")

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
