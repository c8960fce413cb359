"""Ingestion benchmark: PostgreSQL CPU per check result written by :func:`magpie.stats.store.apply_results`.

Every result the ``stats`` consumer takes from the results stream is applied in one transaction per batch:
a ``check_history`` row, a ``stats_ledger`` row, the ``route_health`` upsert, a ``reputation_dirty`` mark
(and ``route_failures`` for routes checked under several profiles; the synthetic results carry none). This
script measures that write path alone, without Redis or Celery, on two schemas in the same run:

  baseline  the database migrated to ``--baseline-revision`` (default: the revision before the newest)
  head      the database migrated to the newest revision

and, with ``--extras``, on the newest revision with more DDL applied (to weigh a change before writing a
migration for it; see :data:`EXTRAS`).

Each schema gets a database of its own (``magpie_ingestbench_<random>_<n>``, created on
``MAGPIE_BENCH_PG_ADMIN_URL``, loopback only, dropped at the end) holding ``--routes`` routes in one
workspace and the month's ``check_history`` partition. Two phases, both through the real
``apply_results`` in batches of ``--batch`` (``MAGPIE_STATS_BATCH``, 2,000):

  first    one result for every route, in a shuffled order: every route's first ``route_health`` row
  steady   ``--results`` more results: whole check cycles (every route once, shuffled, each cycle a
           "chunk").

Before each chunk (and the first phase) ``--reputation-cleared`` routes leave ``reputation_dirty`` as
the ``reputation`` job's passes take them in one check interval (5,000 a pass every 60 s, routes checked
every 300 s: 25,000), so a result marks its route dirty again (an insert) only when the job took it since
its last check: at 50,000 routes about half of them, at a million routes one in forty. Then the database
is vacuumed and analysed. Autovacuum is off on the benchmark's tables: when it ran on its own, it
analysed one database and not another mid-chunk and their plans and figures drifted apart. The schemas
take turns batch by batch (who goes first rotates), so the shared machine's load swings alike for all of
them.

Figures per phase and schema:
  rows_per_s      results applied / wall seconds spent in ``apply_results``
  pg_us_per_row   CPU (user + system, ``/proc/<pid>/stat`` ticks) of the PostgreSQL backend serving the
                  benchmark's one connection (``pg_backend_pid()``), per result; background processes
                  (WAL writer, checkpointer, autovacuum) are not counted
  client_us_per_row  this process's CPU (``time.process_time``) in ``apply_results``, per result
  chunk_pg_us     lowest / median / highest ``pg_us_per_row`` of the steady chunks (the noise)
and, per schema other than the baseline, its figures over the baseline's (``x``: rows/s, PG and client
CPU per row over the whole phase) and the median (lowest-highest) of the chunks' PG CPU ratios.

    .venv/bin/python benchmarks/ingest_bench.py [--routes 50000] [--results 200000] [--batch 2000]
        [--alive 0.15] [--reputation-cleared 25000] [--baseline-revision 0016] [--extras health-fk,dirty-fk]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import make_url

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("MAGPIE_EGRESS_ONLY", "127.0.0.0/8,::1")  # benchmarks dial loopback only

from magpie.db import migrate  # noqa: E402
from magpie.stats.entry import StreamEntry, encode_result, parse_entry  # noqa: E402
from magpie.stats.store import apply_results  # noqa: E402

ADMIN = os.environ.get("MAGPIE_BENCH_PG_ADMIN_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
TICK = os.sysconf("SC_CLK_TCK")

EXTRAS: dict[str, tuple[str, list[str]]] = {
    "health-fk": ("without route_health's foreign key",
                  ["ALTER TABLE route_health DROP CONSTRAINT fk_route_health_route_id_routes"]),
    "dirty-fk": ("without reputation_dirty's foreign key",
                 ["ALTER TABLE reputation_dirty DROP CONSTRAINT fk_reputation_dirty_route_id_routes"]),
    "ledger-committed": ("without ix_stats_ledger_committed_at", ["DROP INDEX ix_stats_ledger_committed_at"]),
    "ledger-order": ("without ix_stats_ledger_stream_order", ["DROP INDEX ix_stats_ledger_stream_order"]),
    "history-fk": ("without check_history's foreign key (if any)",
                   ["ALTER TABLE check_history DROP CONSTRAINT IF EXISTS fk_check_history_route_id_routes"]),
}
"""``--extras`` names: (what it is, DDL applied on top of the newest revision)."""

JUDGE = "http://127.0.0.1:8899/"
ERRORS = ("timeout", "connect_timeout", "refused", "reset", "proxy_error")


@dataclass
class Totals:
    """Sums over the batches of one phase: results, wall seconds, backend and client CPU seconds."""

    rows: int = 0
    wall: float = 0.0
    pg: float = 0.0
    client: float = 0.0
    chunks: list[float] = field(default_factory=list)  # pg_us_per_row of each chunk

    def add(self, rows: int, wall: float, pg: float, client: float) -> None:
        self.rows += rows
        self.wall += wall
        self.pg += pg
        self.client += client
        self.chunks.append(pg / rows * 1e6 if rows else float("nan"))

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall if self.wall else float("nan")

    @property
    def pg_us(self) -> float:
        return self.pg / self.rows * 1e6 if self.rows else float("nan")

    @property
    def client_us(self) -> float:
        return self.client / self.rows * 1e6 if self.rows else float("nan")


@dataclass
class Schema:
    """One database under test: its name, what it is, and its engine (one pooled connection)."""

    label: str
    about: str
    name: str
    url: str
    engine: sa.Engine | None = None
    pid: int = 0
    dirty_after: int = 0  # the emulated reputation job's cursor
    phases: dict[str, Totals] = field(default_factory=dict)


def backend_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used: ``/proc/<pid>/stat`` fields 14 and 15.

    Raises ``OSError`` when the process is not on this machine (PostgreSQL elsewhere)."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICK


def database_url(name: str) -> str:
    return make_url(ADMIN).set(database=name).render_as_string(hide_password=False)


def admin_engine() -> sa.Engine:
    host = make_url(ADMIN).host or "localhost"
    if host not in LOOPBACK:
        raise SystemExit(f"MAGPIE_BENCH_PG_ADMIN_URL must name a loopback host, not {host!r}")
    return sa.create_engine(ADMIN, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


def create(schema: Schema, revision: str, ddl: list[str], routes: int, now: datetime) -> None:
    """Create and migrate ``schema``'s database, apply ``ddl``, store ``routes`` routes in one workspace
    and the month's ``check_history`` partition; open its one-connection engine and note the backend."""
    from magpie.maintenance.partitions import create_month_partition

    migrate.ensure_database(schema.url)
    migrate.upgrade(schema.url, revision)
    engine = sa.create_engine(schema.url, pool_size=1, max_overflow=0)
    with engine.begin() as c:
        for stmt in ddl:
            c.exec_driver_sql(stmt)
        c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('bench')"))
        c.execute(sa.text("""
            INSERT INTO routes (route_hash, protocol, host, port)
            SELECT lpad(to_hex(g), 24, '0'), (ARRAY['http','https','socks4','socks5'])[1 + g % 4],
                   '10.' || (g >> 16 & 255) || '.' || (g >> 8 & 255) || '.' || (g & 255), 1024 + g % 60000
            FROM generate_series(1, :n) g"""), {"n": routes})
        c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) SELECT id, 1 FROM routes"))
    create_month_partition(engine, now)
    with engine.begin() as c:  # vacuum and statistics only between chunks, for every schema alike
        for (table,) in c.exec_driver_sql("SELECT oid::regclass::text FROM pg_class WHERE relkind = 'r' "
                                          "AND relnamespace = 'public'::regnamespace"):
            c.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    with engine.connect() as c:
        schema.pid = int(c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
    schema.engine = engine


_TAKE_DIRTY = """
    DELETE FROM reputation_dirty WHERE route_id IN (
        SELECT route_id FROM reputation_dirty WHERE route_id > %s ORDER BY route_id LIMIT %s)
    RETURNING route_id
"""


def settle(schema: Schema, cleared: int) -> None:
    """Between two check cycles: take up to ``cleared`` routes off ``reputation_dirty`` in route id order
    from where the last cycle stopped, wrapping around (what the ``reputation`` job's passes do in one
    check interval), then ``VACUUM ANALYZE`` the database (what autovacuum does, at the same point for
    every schema)."""
    with schema.engine.begin() as c:
        left, wrapped = cleared, False
        while left > 0:
            ids = c.exec_driver_sql(_TAKE_DIRTY, (schema.dirty_after, left)).scalars().all()
            left -= len(ids)
            if ids:
                schema.dirty_after = max(ids)
            elif schema.dirty_after and not wrapped:
                schema.dirty_after, wrapped = 0, True
            else:
                break
    with schema.engine.connect() as c:
        c.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE")


def route_map(engine: sa.Engine) -> list[tuple[int, str]]:
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT id, route_hash FROM routes ORDER BY id"))
        return [(int(i), h.strip()) for i, h in rows]


class Results:
    """Synthetic stream entries: whole check cycles over the routes, in a shuffled order per cycle."""

    def __init__(self, routes: list[tuple[int, str]], alive: float, seed: int):
        self.routes = routes
        self.alive = alive
        self.rnd = random.Random(seed)
        self.ms = int(time.time() * 1000) - 3_600_000  # stream ids and check times: the last hour
        self.seq = 0

    def entry(self, rid: int, rhash: str) -> StreamEntry:
        self.seq += 1
        if self.seq % 7 == 0:
            self.ms += 1
        r = self.rnd
        if r.random() < self.alive:
            last = f"10.{r.randrange(256)}.{r.randrange(256)}.{r.randrange(256)}"
            body = ('{"remote_addr": "%s", "headers": {"Host": "127.0.0.1:8899", "User-Agent": '
                    '"magpie/1", "Accept": "*/*", "Connection": "close"}, "method": "GET", "path": "/"}') % last
            fields = encode_result(route_id=rid, route_hash=rhash, alive=True, checked_at_ms=self.ms,
                                   latency_ms=r.uniform(80, 3000), status=200, attempts=1, body=body,
                                   anonymity=r.choice(("elite", "anonymous", "transparent")), judge=JUDGE,
                                   exit_ip=last)
        else:
            fields = encode_result(route_id=rid, route_hash=rhash, alive=False, checked_at_ms=self.ms,
                                   attempts=2, error=r.choice(ERRORS), judge=JUDGE)
        return parse_entry(f"{self.ms}-{self.seq}", fields)

    def cycle(self) -> list[StreamEntry]:
        """One result per route, shuffled."""
        order = list(self.routes)
        self.rnd.shuffle(order)
        return [self.entry(rid, rh) for rid, rh in order]


def run(schemas: list[Schema], entries: list[StreamEntry], batch: int, phase: str, cleared: int) -> None:
    """:func:`settle` every schema (``cleared``), then apply ``entries`` to every schema in batches of
    ``batch``, the schemas taking turns batch by batch (who goes first rotates), and add each schema's
    sums as one chunk of ``phase``."""
    for s in schemas:
        settle(s, cleared)
    sums = {s.label: [0.0, 0.0, 0.0] for s in schemas}  # wall, PG CPU, client CPU
    for k, off in enumerate(range(0, len(entries), batch)):
        part = entries[off:off + batch]
        for s in schemas[k % len(schemas):] + schemas[:k % len(schemas)]:
            pg0, cl0, t0 = backend_cpu(s.pid), time.process_time(), time.perf_counter()
            committed, replayed, dead = apply_results(s.engine, part)
            wall, client, pg = time.perf_counter() - t0, time.process_time() - cl0, backend_cpu(s.pid) - pg0
            if dead or replayed or committed != len(part):
                raise SystemExit(f"{s.label}: unexpected outcome {committed=} {replayed=} dead={dead[:1]}")
            acc = sums[s.label]
            acc[0] += wall
            acc[1] += pg
            acc[2] += client
    for s in schemas:
        with s.engine.connect() as c:  # the pool must have kept its one connection
            if int(c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()) != s.pid:
                raise SystemExit(f"{s.label}: the engine's connection changed; the CPU figures are void")
        wall, pg, client = sums[s.label]
        s.phases.setdefault(phase, Totals()).add(len(entries), wall, pg, client)


def report(schemas: list[Schema]) -> None:
    base = schemas[0]
    print(f"{'phase':<7} {'schema':<22} {'results':>8} {'rows/s':>8} {'PG us/row':>10} {'client us/row':>14}"
          f" {'chunk PG us min/med/max':>24} {'rows/s x':>9} {'PG x':>6} {'client x':>9}"
          f" {'chunk PG x med (min-max)':>25}")
    for phase in ("first", "steady"):
        b = base.phases[phase]
        for s in schemas:
            t = s.phases[phase]
            spread = (f"{min(t.chunks):.1f}/{statistics.median(t.chunks):.1f}/{max(t.chunks):.1f}"
                      if len(t.chunks) > 1 else "-")
            ratios = ""
            if s is not base:
                per = [x / y for x, y in zip(t.chunks, b.chunks)]
                chunk_x = (f"{statistics.median(per):.3f} ({min(per):.3f}-{max(per):.3f})" if len(per) > 1
                           else "-")
                ratios = (f" {t.rows_per_s / b.rows_per_s:9.3f} {t.pg_us / b.pg_us:6.3f}"
                          f" {t.client_us / b.client_us:9.3f} {chunk_x:>25}")
            print(f"{phase:<7} {s.label:<22} {t.rows:8d} {t.rows_per_s:8.0f} {t.pg_us:10.1f} {t.client_us:14.1f}"
                  f" {spread:>24}{ratios}")
    for s in schemas:
        print(f"  {s.label}: {s.about} (database {s.name})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routes", type=int, default=50_000, help="routes per database (default 50000)")
    ap.add_argument("--results", type=int, default=200_000,
                    help="steady results per schema, rounded up to whole cycles of --routes (default 200000)")
    ap.add_argument("--batch", type=int, default=2000, help="results per apply_results call (default 2000)")
    ap.add_argument("--alive", type=float, default=0.15, help="share of alive results (default 0.15)")
    ap.add_argument("--reputation-cleared", type=int, default=25_000,
                    help="routes the reputation job takes off reputation_dirty per check cycle (default 25000: "
                         "MAGPIE_REPUTATION_PER_PASS 5000 x 5 passes in a 300 s interval)")
    ap.add_argument("--baseline-revision", default=None,
                    help="the baseline's revision (default: the one before the newest)")
    ap.add_argument("--extras", default="", help=f"more schemas, comma-separated, of {','.join(EXTRAS)}")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args(argv)
    extras = [x for x in a.extras.split(",") if x]
    unknown = [x for x in extras if x not in EXTRAS]
    if unknown:
        ap.error(f"unknown extras {unknown}; known: {', '.join(EXTRAS)}")
    head = migrate.head_revision()
    revs = {r["revision"]: r for r in migrate.history()}
    base_rev = a.baseline_revision or revs[head]["down_revision"]
    token = uuid.uuid4().hex[:8]
    plan = [("baseline", f"revision {base_rev}", base_rev, []), ("head", f"revision {head} (newest)", head, [])]
    plan += [(f"head-{x}", f"revision {head} {EXTRAS[x][0]}", head, EXTRAS[x][1]) for x in extras]
    names = [f"magpie_ingestbench_{token}_{i}" for i in range(len(plan))]
    schemas = [Schema(label, about, name, database_url(name)) for (label, about, _, _), name in zip(plan, names)]
    admin = admin_engine()
    now = datetime.now(UTC)
    cycles = max(1, -(-a.results // a.routes))
    print(f"ingest_bench: {a.routes} routes, first results {a.routes} + steady {cycles} x {a.routes} per schema, "
          f"batches of {a.batch}, alive {a.alive:.0%}, baseline revision {base_rev}, head {head}, "
          f"cores={os.cpu_count()}", flush=True)
    try:
        for s, (_, _, rev, ddl) in zip(schemas, plan):
            t = time.monotonic()
            create(s, rev, ddl, a.routes, now)
            print(f"  {s.label}: database ready in {time.monotonic() - t:.1f} s (backend pid {s.pid})",
                  flush=True)
        routes = route_map(schemas[0].engine)
        if any(route_map(s.engine) != routes for s in schemas[1:]):
            raise SystemExit("the databases' routes differ")
        gen = Results(routes, a.alive, a.seed)
        run(schemas, gen.cycle(), a.batch, "first", a.reputation_cleared)
        for k in range(cycles):
            run(schemas, gen.cycle(), a.batch, "steady", a.reputation_cleared)
            figures = ", ".join(f"{s.label} {s.phases['steady'].chunks[-1]:.1f} PG us/row" for s in schemas)
            print(f"  steady chunk {k + 1}/{cycles}: {figures}", flush=True)
        expected = a.routes * (cycles + 1)
        for s in schemas:
            with s.engine.connect() as c:
                n = c.exec_driver_sql("SELECT count(*) FROM check_history").scalar_one()
            if n != expected:
                raise SystemExit(f"{s.label}: {n} check_history rows, expected {expected}")
        report(schemas)
    finally:
        for s in schemas:
            if s.engine is not None:
                s.engine.dispose()
        with admin.connect() as c:
            for s in schemas:
                c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                          {"n": s.name})
                c.execute(sa.text(f'DROP DATABASE IF EXISTS "{s.name}"'))
        admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
