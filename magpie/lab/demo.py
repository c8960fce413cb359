"""``make demo``: the main job end to end on this machine, then a health table.

Starts the lab (a judge and real proxy servers on 127.0.0.x), migrates a demo database, imports the
lab's proxy list, runs a Celery worker pair and beat from the Procfile (via honcho) at a short check
interval until every route was checked at least twice, prints the health table next to what the lab
intends, and stops everything it started. Exit status 0 when every route matches the lab's intent.

It needs a checkout of the repository and the ``dev`` and ``lab`` extras (``make setup`` installs them);
run elsewhere it says so in one line and exits with status 2.

Settings come from the environment like the product's: exported ``MAGPIE_*`` variables win over the
demo's defaults (a short check interval and timeouts, below), so the demo can be pointed at other servers.
What identifies its data is always its own: the Redis key prefix ``MAGPIE_DEMO_PREFIX`` (default
``magpie-demo:``) for the schedule and, as kombu's key prefix, for a Redis broker; and the PostgreSQL
database ``MAGPIE_DEMO_DATABASE`` (default ``magpie_demo``) on the server of ``MAGPIE_DATABASE_URL``. At
start it deletes only keys under its prefix and drops the database only if the demo created it (it
marks it with a comment); it never flushes a Redis database.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from magpie.base import redisconn

ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / ".demo"
DEMO_DEFAULTS = {
    "MAGPIE_REDIS_URL": "redis://127.0.0.1:6379/0",
    "MAGPIE_DATABASE_URL": "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres",
    "MAGPIE_CHECK_ALLOW_PRIVATE": "127.0.0.0/8",  # the lab is on loopback
    "MAGPIE_EGRESS_ONLY": "127.0.0.0/8,::1",  # and nothing else is ever dialled
    "MAGPIE_CHECK_INTERVAL": "8",
    "MAGPIE_CHECK_TIMEOUT": "6",
    "MAGPIE_LEASE_SECONDS": "60",
    "MAGPIE_RENEW_BELOW_SECONDS": "20",
    "MAGPIE_CHECK_CONCURRENCY": "2",
    "MAGPIE_BEAT_SCHEDULE_FILE": str(STATE / "celerybeat-schedule"),
    "MAGPIE_LOG_LEVEL": "info",  # goes to .demo/celery.log
}
"""Used where the environment does not set the variable."""
DB_MARK = "created by magpie make demo"
"""Comment the demo puts on its database; it drops only a database carrying it."""
CHECKS_WANTED = 2
DEADLINE_S = 150


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def demo_env(environ) -> dict[str, str]:
    """The variables the demo runs with, from ``environ`` (a mapping such as ``os.environ``).

    Exported values win over :data:`DEMO_DEFAULTS`. The identity is the demo's own whatever was exported:
    ``MAGPIE_REDIS_PREFIX`` = ``MAGPIE_DEMO_PREFIX``; ``MAGPIE_DATABASE_URL`` names
    ``MAGPIE_DEMO_DATABASE`` on the exported server; the broker is the exported Redis broker (else the
    schedule's ``MAGPIE_REDIS_URL``) under the key prefix ``<demo prefix>broker:``. A non-Redis broker is
    replaced so (its queues could not be kept apart from another deployment's).

    Returns the variables to set. Raises :class:`magpie.config.ConfigError` for a bad
    ``MAGPIE_DEMO_PREFIX``/``MAGPIE_DEMO_DATABASE``, or a demo prefix equal to the product's default.
    """
    from sqlalchemy.engine import make_url

    from magpie.config import ConfigError, Settings, load_settings

    env = {k: environ.get(k, v) for k, v in DEMO_DEFAULTS.items()}
    ids = load_settings(demo_prefix=environ.get("MAGPIE_DEMO_PREFIX", "magpie-demo:"),
                        demo_database=environ.get("MAGPIE_DEMO_DATABASE", "magpie_demo"))
    prefix = ids.demo_prefix
    if prefix == Settings.model_fields["redis_prefix"].default:
        raise ConfigError(f"MAGPIE_DEMO_PREFIX: {prefix!r} is the product's own prefix; the demo resets "
                          "everything under its prefix, so pick another")
    env["MAGPIE_REDIS_PREFIX"] = prefix
    url = make_url(env["MAGPIE_DATABASE_URL"]).set(database=ids.demo_database)
    env["MAGPIE_DATABASE_URL"] = url.render_as_string(hide_password=False)
    broker = environ.get("MAGPIE_BROKER_URL", "")
    env["MAGPIE_BROKER_URL"] = broker if broker.startswith(("redis://", "rediss://")) else env["MAGPIE_REDIS_URL"]
    env["MAGPIE_BROKER_KEY_PREFIX"] = prefix + "broker:"
    return env


def _reset(settings) -> None:
    """Delete the demo's keys (schedule and broker, all under its prefix) and its own database."""
    import redis

    for url in {settings.redis_url, settings.broker_url}:
        r = redisconn.connect(url)
        for pattern in (settings.redis_prefix + "*", "{" + settings.redis_prefix + "*"):
            batch = []
            for key in r.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    r.delete(*batch)
                    batch.clear()
            if batch:
                r.delete(*batch)
        r.close()
    _drop_own_database(settings.database_url)


def _admin(url):
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    return sa.create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT",
                            poolclass=sa.pool.NullPool)


def _drop_own_database(url: str) -> None:
    """Drop the database named in ``url`` if the demo created it; refuse (one line, exit 2) a foreign one."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    name = make_url(url).database
    admin = _admin(url)
    try:
        with admin.connect() as c:
            row = c.execute(sa.text("SELECT shobj_description(oid, 'pg_database') FROM pg_database "
                                    "WHERE datname = :n"), {"n": name}).first()
            if row is None:
                return
            if row[0] != DB_MARK:
                print(f"[demo] database {name} exists and was not created by the demo: set MAGPIE_DEMO_DATABASE "
                      "to another name (the demo drops only its own database)", file=sys.stderr)
                raise SystemExit(2)
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                      {"n": name})
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    finally:
        admin.dispose()


def _create_own_database(url: str) -> None:
    """Create the demo's database and mark it as the demo's (see :data:`DB_MARK`)."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    from magpie.db.migrate import ensure_database

    ensure_database(url)
    name = make_url(url).database
    admin = _admin(url)
    try:
        with admin.connect() as c:
            c.execute(sa.text(f"COMMENT ON DATABASE \"{name}\" IS '{DB_MARK}'"))
    finally:
        admin.dispose()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=25)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def cannot_run() -> str | None:
    """Why the demo cannot run here, as one line, or ``None`` when it can.

    It needs a checkout of the repository (it runs the repository's ``Procfile`` and keeps its state in
    ``.demo/`` there) and the ``dev`` and ``lab`` extras (honcho runs the Procfile, pproxy serves the lab).
    """
    if not (ROOT / "Procfile").is_file():
        return (f"the demo needs a checkout of the magpie repository (it runs its Procfile; none in {ROOT}): "
                "clone it and run `make demo` there")
    missing = [m for m in ("honcho", "pproxy") if importlib.util.find_spec(m) is None]
    if missing:
        return f"the demo needs {' and '.join(missing)}: pip install -e '.[dev,lab]' (or `make setup`)"
    return None


def main() -> int:
    why = cannot_run()
    if why is not None:
        print(f"[demo] {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # run the finally blocks: stop Celery and the lab
    try:
        os.environ.update(demo_env(os.environ))
    except Exception as exc:  # noqa: BLE001 - a bad MAGPIE_DEMO_* value: one line
        print(f"[demo] {exc}", file=sys.stderr)
        return 2
    STATE.mkdir(exist_ok=True)
    from magpie.lab.lab import Lab

    with Lab() as lab:
        os.environ["MAGPIE_JUDGE_URL"] = lab.judge_url
        from magpie.config import get_settings
        from magpie.base.crypto import get_keyring
        from magpie.db.migrate import upgrade
        from magpie.db.repo import latest_health
        from magpie.db.session import get_engine
        from magpie.importer.service import import_file

        settings = get_settings()
        _say(f"lab up: judge {lab.judge_url}, {len(lab.proxies)} routes")
        _reset(settings)
        _create_own_database(settings.database_url)
        upgrade(settings.database_url)
        _say("database migrated")
        list_file = STATE / "lab-proxies.txt"
        lab.write_list(list_file)
        rep = import_file(list_file, "demo", settings)
        _say(f"imported {rep.imported} routes from {list_file} (invalid: {len(rep.invalid)})")

        env = dict(os.environ)
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        log = open(STATE / "celery.log", "w")
        honcho = subprocess.Popen(
            [sys.executable, "-m", "honcho", "-f", str(ROOT / "Procfile"), "start", "worker-promote", "worker-checks", "worker-jobs",
             "beat"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        _say(f"celery worker-promote, worker-checks, worker-jobs and beat started (log: {STATE / 'celery.log'})")
        engine = get_engine(settings.database_url)
        keyring = get_keyring(settings.encryption_key)
        rows = []
        try:
            t0 = time.monotonic()
            last_done = -1
            deadline = max(DEADLINE_S, CHECKS_WANTED * settings.check_interval + 90)
            while time.monotonic() - t0 < deadline:
                time.sleep(2)
                if honcho.poll() is not None:
                    _say("the Celery processes exited early; see the log")
                    break
                rows = latest_health(engine, "demo", keyring=keyring)
                done = sum(1 for r in rows if (r["checks_total"] or 0) >= CHECKS_WANTED)
                line = f"[demo] routes checked {CHECKS_WANTED}+ times: {done}/{len(rows)}  ({time.monotonic() - t0:.0f}s)"
                if sys.stdout.isatty():
                    print("\r" + line, end="", flush=True)
                elif done != last_done:  # a log gets one line per change, not a run-on line
                    print(line, flush=True)
                last_done = done
                if rows and done == len(rows):
                    break
            if sys.stdout.isatty():
                print()
        finally:
            _stop(honcho)
            log.close()
            _say("celery processes stopped")
        rows = latest_health(engine, "demo", keyring=keyring)
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        expected = {(p.route.host, p.route.port): p for p in lab.proxies}
        table = Table(title="magpie demo: route health")
        for col in ("lab proxy", "route", "protocol", "alive", "latency ms", "anonymity", "checks", "as intended"):
            table.add_column(col)
        bad = []
        for r in rows:
            p = expected.get((r["host"], r["port"]))
            ok = p is not None and (r["checks_total"] or 0) >= CHECKS_WANTED and r["alive"] == p.expect_alive and (
                r["anonymity"] == p.expect_anonymity)
            if not ok:
                bad.append(f"{p.name if p else r['host']}: got alive={r['alive']} anonymity={r['anonymity']} "
                           f"checks={r['checks_total']}, lab intends alive={p and p.expect_alive} "
                           f"anonymity={p and p.expect_anonymity}")
            host = f"[{r['host']}]" if ":" in r["host"] else r["host"]
            table.add_row(p.name if p else "?", Text(f"{host}:{r['port']}"), r["protocol"],
                          {True: "yes", False: "no", None: "-"}[r["alive"]],
                          f"{r['latency_ms']:.0f}" if r["latency_ms"] is not None else "-", r["anonymity"] or "-",
                          str(r["checks_total"] or 0), "yes" if ok else "NO")
        Console(width=max(110, Console().width)).print(table)
        engine.dispose()
    _say("lab stopped")
    if bad or len(rows) != len(expected):
        _say("MISMATCH with the lab's intent:\n  " + "\n  ".join(bad or ["missing routes"]))
        return 1
    _say(f"every route checked at least {CHECKS_WANTED} times and matches what the lab intends")
    return 0


if __name__ == "__main__":
    sys.exit(main())
