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

    ``host`` / ``port`` / ``wrap`` place it elsewhere: ``wrap`` turns the command line into the one to run
    (e.g. :meth:`magpie.lab.netns.Topology.argv` for a namespace whose address is ``host``; protected mode
    is then off, so clients of other hosts are served) and ``track`` is called with each started Popen.
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, wrap=None, track=None) -> None:
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            raise ServerError("redis-server binary not installed")
        self.host = host
        self.port = port or free_port()
        self.wrap, self.track = wrap, track
        self.dir = tempfile.mkdtemp(prefix="magpie-chaos-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``redis://<host>:<port>/0``."""
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> redis.Redis:
        argv = [self.exe, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--maxclients", "1000"]
        if self.wrap is not None:
            argv = self.wrap([*argv, "--protected-mode", "no"])
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        if self.track is not None:
            self.track(self.proc)
        c = redis.Redis(host=self.host, port=self.port, socket_timeout=2, socket_connect_timeout=1)
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

    ``host`` / ``port`` / ``wrap`` / ``track`` place it elsewhere as for :class:`PrivateRedis`; with
    ``trust_cidr`` (e.g. ``10.231.7.0/24``) clients of that network are trusted too. When root, a wrapped
    postmaster drops to the ``postgres`` user with ``setpriv`` inside the wrapper.
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, wrap=None, track=None,
                 trust_cidr: str | None = None) -> None:
        self.initdb, self.postgres = _pg_bin("initdb"), _pg_bin("postgres")
        self.host = host
        self.port = port or free_port()
        self.wrap, self.track, self.trust_cidr = wrap, track, trust_cidr
        self.dir = tempfile.mkdtemp(prefix="magpie-chaos-pg-")
        self.data = os.path.join(self.dir, "data")
        self.proc: subprocess.Popen | None = None
        self._user = None
        if os.geteuid() == 0:
            self._user = pwd.getpwnam("postgres")
            os.chown(self.dir, self._user.pw_uid, self._user.pw_gid)

    def url(self, db: str = "postgres") -> str:
        """SQLAlchemy URL of database ``db`` on this server (user ``postgres``, no password)."""
        return f"postgresql+psycopg2://postgres@{self.host}:{self.port}/{db}"

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
            if self.trust_cidr:
                with open(os.path.join(self.data, "pg_hba.conf"), "a") as fh:
                    fh.write(f"host all all {self.trust_cidr} trust\n")
        argv = [self.postgres, "-D", self.data, "-p", str(self.port), "-h", self.host, "-k", self.dir,
                "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                "-c", "shared_buffers=32MB", "-c", "max_connections=60"]
        user = self._as_user()
        if self.wrap is not None:
            if self._user is not None:
                argv = ["setpriv", f"--reuid={self._user.pw_uid}", f"--regid={self._user.pw_gid}",
                        "--clear-groups", *argv]
            argv, user = self.wrap(argv), {}
        with open(os.path.join(self.dir, "postgres.log"), "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=log, start_new_session=True, cwd=self.dir, **user)
        if self.track is not None:
            self.track(self.proc)
        import psycopg2

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"private postgres exited (rc={self.proc.returncode}), see "
                                  f"{os.path.join(self.dir, 'postgres.log')}")
            try:
                psycopg2.connect(host=self.host, port=self.port, user="postgres", dbname="postgres",
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

        c = psycopg2.connect(host=self.host, port=self.port, user="postgres", dbname=db, connect_timeout=5)
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
