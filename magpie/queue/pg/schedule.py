"""The route schedule in one PostgreSQL table, claimed with ``FOR UPDATE SKIP LOCKED`` (worker plane).

A claim is one short transaction: it takes due rows in due order, skipping rows other claimers hold,
reaps the expired leases it meets (counted by the stall rule of :mod:`magpie.queue.provider`), writes a
fresh lease token per row and commits. No sweeper runs: an expired lease waits for the next claim. Each
fenced write is one ``UPDATE ... WHERE lease_token = %s``: a stale holder's write matches no row and
changes nothing. The import, time, operator and read planes are in :mod:`magpie.queue.pg.admin`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

import psycopg2
import psycopg2.extras

from magpie.base import redisconn
from magpie.errors import Refusal
from magpie.queue.completion import Completion, StreamTarget
from magpie.queue.keys import QueueKeys, fnv1a_32
from magpie.queue.lease import Lease
from magpie.queue.pg import merge
from magpie.queue.pg.admin import AdminPlane
from magpie.queue.pg.spread import SpreadPlane
from magpie.queue.pg.sql import CLAIM, LIVE, NOW, score_text, token_ms, ts, values
from magpie.queue.refusals import COMPLETED, GONE, LEASE_LOST, REMOVED, QueueError, refusal

log = logging.getLogger(__name__)
_ADVISORY = "SELECT pg_advisory_xact_lock(hashtext('magpie.schedule:' || %s))"


def dsn_of(url: str) -> str:
    """A libpq URL from a SQLAlchemy-style one (``postgresql+psycopg2://`` -> ``postgresql://``)."""
    return "postgresql://" + url.split("://", 1)[1] if url.startswith("postgresql+") else url


class PgSchedule(AdminPlane, SpreadPlane):
    """The schedule of one deployment in PostgreSQL; the same interface as :class:`magpie.queue.RouteQueue`.

    Args:
        url: ``postgresql://`` (or ``postgresql+psycopg2://``) URL of the database holding the schedule
            tables (migration ``0006``).
        keys: :class:`QueueKeys`; its prefix names the schedule (rows of several schedules share the
            table) and its shard count labels leases (``Lease.shard``) and breaks due-time ties.
        interval_ms / lease_ms / max_stalled / log_limit: as :class:`~magpie.queue.RouteQueue`.
        clock: tests only: a callable giving "now" in Unix ms, used instead of the database clock.
        redis_client: redis-py client for what stays in Redis (the results stream, promote's budget,
            check capacity); built from ``redis_url`` on first use when None.
        pool_size: most database connections this process opens.
    """

    carries_cadence = False
    """No per-route, workspace or profile cadence: those verbs are refused."""

    def __init__(self, url: str, keys: QueueKeys, interval_ms: int, lease_ms: int = 300_000,
                 max_stalled: int = 3, log_limit: int = 100, clock: Callable[[], int] | None = None,
                 redis_client=None, redis_url: str | None = None, pool_size: int = 8):
        self.url = url
        self.keys = keys
        self.name = keys.base
        self.interval_ms = int(interval_ms)
        self.lease_ms = int(lease_ms)
        self.max_stalled = int(max_stalled)
        self.log_limit = int(log_limit)
        self.clock = clock
        self._redis = redis_client
        self._redis_url = redis_url
        # durable connections, and connections for claims and heartbeats that commit without waiting for
        # the WAL flush (see tx()); opened on first use, kept idle for reuse, at most pool_size of each
        self._dsn = dsn_of(url)
        self._idle: dict[bool, list] = {True: [], False: []}
        self._idle_lock = threading.Lock()
        self._sems = {True: threading.BoundedSemaphore(pool_size), False: threading.BoundedSemaphore(pool_size)}
        self.last_pop = {"paused": False, "dead_lettered": 0, "allowed": 0}

    @classmethod
    def from_settings(cls, settings, url: str, redis_client=None) -> PgSchedule:
        """Build from a :class:`magpie.config.ScheduleSettings` (or a whole Settings) and the schedule URL.
        Raises :class:`QueueError` ``layout_mismatch`` (see :meth:`check_layout`)."""
        sched = getattr(settings, "schedule", settings)
        q = cls(url, QueueKeys(sched.prefix, sched.shards), interval_ms=sched.interval_ms,
                lease_ms=sched.lease_ms, max_stalled=sched.max_stalled, redis_client=redis_client,
                redis_url=sched.redis_url)
        q.check_layout()
        return q

    @property
    def r(self):
        """redis-py client for the parts that stay in Redis (results stream, promote budget, capacity)."""
        if self._redis is None:
            import redis

            self._redis = redisconn.connect(self._redis_url or "redis://127.0.0.1:6379/0")
        return self._redis

    @property
    def redis(self):
        """The Redis holding what lives beside the schedule (:attr:`r`)."""
        return self.r

    @property
    def prefix(self) -> str:
        """The deployment's key prefix (``MAGPIE_REDIS_PREFIX``)."""
        return self.keys.prefix

    @property
    def shards(self) -> int:
        """The shard count (``PROXY_QUEUE_SHARDS``): lease labels and due-time ties here."""
        return self.keys.shards

    def side_key(self, name: str) -> str:
        """Key ``name`` under the schedule's hash tag in :attr:`redis`."""
        return self.keys.base + name

    def shard_of(self, member: str) -> str:
        """The shard label of a route (its :attr:`Lease.shard`)."""
        return self.keys.shard_of(member)

    def capacity_registry(self):
        """The :class:`magpie.queue.capacity.CapacityRegistry` of this schedule's check engines (in Redis)."""
        from magpie.queue.capacity import CapacityRegistry

        return CapacityRegistry(self.r, self.keys)

    def migrate_payloads(self, cipher, *, encrypt: bool, batch: int = 500, retries: int = 2,
                         progress=None) -> dict:
        """Redis only: refused here (:class:`magpie.errors.RefusedError` ``unsupported``)."""
        from magpie.errors import RefusedError

        raise RefusedError(Refusal.UNSUPPORTED, detail="migrate-payloads serves the Redis schedule only "
                                                       "(MAGPIE_SCHEDULE_URL is postgresql://)")

    def set_route_interval(self, member: str, interval_ms: int | None) -> dict:
        """Redis only: refused here (:class:`magpie.errors.RefusedError` ``unsupported``)."""
        from magpie.errors import RefusedError

        raise RefusedError(Refusal.UNSUPPORTED, detail="per-route intervals are served by the Redis schedule "
                                                       "only (MAGPIE_SCHEDULE_URL is postgresql://)")

    def set_workspace_cadence(self, workspace_id: int, **_kw) -> dict:
        """Redis only: refused here (:class:`magpie.errors.RefusedError` ``unsupported``)."""
        from magpie.errors import RefusedError

        raise RefusedError(Refusal.UNSUPPORTED, detail="workspace cadences are served by the Redis schedule "
                                                       "only (MAGPIE_SCHEDULE_URL is postgresql://)")

    def set_profile_cadence(self, workspace_id: int, **_kw) -> dict:
        """Redis only: refused here (:class:`magpie.errors.RefusedError` ``unsupported``)."""
        from magpie.errors import RefusedError

        raise RefusedError(Refusal.UNSUPPORTED, detail="check-profile cadences are served by the Redis "
                                                       "schedule only (MAGPIE_SCHEDULE_URL is postgresql://)")

    def close(self) -> None:
        """Close this process's database connections."""
        with self._idle_lock:
            conns = self._idle[True] + self._idle[False]
            self._idle = {True: [], False: []}
        for conn in conns:
            conn.close()

    @contextlib.contextmanager
    def tx(self, autocommit: bool = False, durable: bool = True):
        """A cursor in one transaction: committed on exit, rolled back on an exception.

        ``autocommit``: each statement is its own transaction (one round trip for a one-statement verb).
        ``durable=False`` (claims, heartbeats, start marks, hand-backs): the commit does not wait for the WAL
        flush. A database crash may then forget the last fraction of a second of them, which only makes a
        holder's later fenced call a refusal and its route claimable again: never two holders, never a
        lost route. Completions, retries and every operator verb stay durable.
        """
        with self._sems[durable]:
            conn = self._take(durable)
            try:
                conn.autocommit = autocommit
                with conn.cursor() as cur:
                    yield cur
                if not autocommit:
                    conn.commit()
                conn.autocommit = False
            except BaseException:
                if not conn.closed and not autocommit:
                    conn.rollback()
                if conn.closed or conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
                    conn.close()
                raise
            finally:
                if not conn.closed:
                    with self._idle_lock:
                        self._idle[durable].append(conn)

    def _take(self, durable: bool):
        with self._idle_lock:
            if self._idle[durable]:
                return self._idle[durable].pop()
        return psycopg2.connect(self._dsn, **({} if durable else {"options": "-c synchronous_commit=off"}))

    def _clk(self) -> int | None:
        return int(self.clock()) if self.clock else None

    def _shard_n(self, member: str) -> str:
        return str(fnv1a_32(member.encode()) % self.keys.shards)

    def check_layout(self) -> None:
        """Record the shard count on first use; refuse a different one later (``layout_mismatch``)."""
        with self.tx() as cur:
            cur.execute("INSERT INTO schedule_meta (schedule, shards) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                        (self.name, self.keys.shards))
            cur.execute("SELECT shards FROM schedule_meta WHERE schedule = %s", (self.name,))
            have = cur.fetchone()[0]
        if have != self.keys.shards:
            raise QueueError(Refusal.LAYOUT_MISMATCH, detail=(
                f"schedule has {have} shards, PROXY_QUEUE_SHARDS={self.keys.shards}; "
                f"keep {have}, or rebuild after `magpie queue obliterate`"))

    # -- worker in hand ------------------------------------------------------------------------------
    def pop(self, count: int = 1, max_inflight: int = 0, lease_ms: int | None = None) -> list[Lease]:
        """Claim up to ``count`` due routes in due order (one transaction; see the module docstring).

        ``max_inflight`` > 0 caps live leases (claims then serialise on a transaction advisory lock so the
        cap holds across processes). Returns the leases; :attr:`last_pop` as on Redis.
        """
        lease = int(lease_ms or self.lease_ms)
        want, got, dead, clk = int(count), [], 0, self._clk()
        allowed, before = want, time.time() * 1000
        # Uncapped, every claim round is one atomic statement (autocommit: one round trip); capped, the
        # rounds share one transaction holding the schedule's advisory lock.
        with self.tx(autocommit=max_inflight <= 0, durable=False) as cur:
            if max_inflight > 0:  # the cap holds across processes: capped claims take turns
                cur.execute(_ADVISORY, (self.name,))
                cur.execute(LIVE, {"s": self.name, "clk": clk})
                clk, live = cur.fetchone()
                want = allowed = max(0, min(want, int(max_inflight) - int(live)))
            while len(got) < want:
                cur.execute(CLAIM, {"s": self.name, "n": want - len(got), "lease": lease,
                                    "max_stalled": self.max_stalled, "clk": clk})
                rows = cur.fetchall()
                if not rows:
                    break
                clk = rows[0][10]  # one "now" (and one lease token) for the whole call
                rows.sort(key=lambda r: (r[3], r[4], r[2], r[0]))
                token = f"{clk + lease}.50"
                offset = clk - (before + time.time() * 1000) / 2
                round_dead = 0
                for route, payload, shard, due, rank, prev_token, stalled, is_dead, alone, attempts, _ in rows:
                    if is_dead:
                        round_dead += 1
                        continue
                    prev = prev_token if prev_token else score_text(due, rank)
                    got.append(Lease(route, payload, prev, token, self.keys.shard(int(shard)), bool(stalled),
                                     int(attempts), offset, bool(alone)))
                dead += round_dead
                if not round_dead:
                    break
            paused = False
            if not got and not dead:
                cur.execute("SELECT paused FROM schedule_meta WHERE schedule = %s", (self.name,))
                row = cur.fetchone()
                paused = bool(row and row[0])
                if paused:
                    allowed = 0
        self.last_pop = {"allowed": allowed, "paused": paused, "dead_lettered": dead}
        return got

    def mark_started(self, leases: Sequence[Lease]) -> list[Lease]:
        """Record that ``leases`` started checking: ``start_mark`` = the lease token (stall evidence),
        fenced on the lease token (a lease no longer held marks nothing, so a stale holder cannot overwrite
        the new holder's evidence). Returns the leases not to start: those no longer held, and those whose
        mark was already their own token (started before by a process that died)."""
        if not leases:
            return []
        with self.tx(durable=False) as cur:
            vals = values(cur, [(le.member, le.lease_score) for le in leases])
            cur.execute(f"UPDATE schedule_routes r SET start_mark = v.tok FROM (VALUES {vals}) AS v(route, tok) "
                        "WHERE r.schedule = %s AND r.route = v.route AND r.lease_token = v.tok "
                        "AND r.start_mark IS DISTINCT FROM v.tok RETURNING r.route, v.tok", (self.name,))
            marked = set(cur.fetchall())
        return [le for le in leases if (le.member, str(le.lease_score)) not in marked]

    def unmark_started(self, leases: Sequence[Lease]) -> int:
        """Clear ``start_mark`` of each lease whose mark is still its own token (its check ended without a
        completion the schedule took): its expiry then counts no stall. Returns the marks cleared."""
        if not leases:
            return 0
        with self.tx(durable=False) as cur:
            vals = values(cur, [(le.member, le.lease_score) for le in leases])
            cur.execute(f"UPDATE schedule_routes r SET start_mark = NULL FROM (VALUES {vals}) AS v(route, tok) "
                        "WHERE r.schedule = %s AND r.route = v.route AND r.start_mark = v.tok", (self.name,))
            return cur.rowcount

    def report_crash(self, lease: Lease, needed: int = 2) -> int:
        """The holder saw ``lease``'s quarantined check crash its isolated process: ``stalls`` grows by one
        beyond ``suspect``; ``needed`` such crashes in a row dead-letter the route (reason ``crashed``), else
        it is due now, still in quarantine. Returns 2 dead-lettered, 1 requeued, or ``LEASE_LOST`` /
        ``GONE``."""
        with self.tx() as cur:
            cur.execute(
                "WITH c AS (SELECT " + NOW + " AS now) "
                "UPDATE schedule_routes r SET stalls = r.stalls + 1, start_mark = NULL, lease_expires_at = NULL, "
                "lease_token = NULL, leased_at = NULL, last_heartbeat_at = NULL, retry = false, "
                "due_at = CASE WHEN r.stalls + 1 - r.suspect >= %(n)s THEN NULL ELSE " + ts("c.now") + " END, "
                "dead_at = CASE WHEN r.stalls + 1 - r.suspect >= %(n)s THEN " + ts("c.now") + " END, "
                "dead_reason = CASE WHEN r.stalls + 1 - r.suspect >= %(n)s THEN jsonb_build_object("
                "'reason', 'crashed', 'stalls', r.stalls + 1, 'claims', r.stalls + 1, "
                "'isolated_crashes', r.stalls + 1 - r.suspect, 'alone', true, 'at', c.now) END "
                "FROM c WHERE r.schedule = %(s)s AND r.route = %(m)s AND r.lease_token = %(tok)s "
                "RETURNING r.dead_at IS NOT NULL",
                {"s": self.name, "m": lease.member, "tok": lease.lease_score, "clk": self._clk(), "n": int(needed)})
            row = cur.fetchone()
            code = (2 if row[0] else 1) if row else self._missing(cur, [lease.member])[lease.member]
        lease.cancel()
        return code

    def _missing(self, cur, members: list[str]) -> dict[str, int]:
        """Refusal per member whose fenced write matched no row: ``GONE`` (no row, or dead) or ``LEASE_LOST``."""
        cur.execute("SELECT route, due_at IS NOT NULL FROM schedule_routes WHERE schedule = %s AND route = ANY(%s)",
                    (self.name, list(members)))
        alive = dict(cur.fetchall())
        return {m: LEASE_LOST if alive.get(m) else GONE for m in members}

    def _fenced_one(self, lease: Lease, sql: str, params: dict, durable: bool = True):
        """Run one fenced ``UPDATE ... RETURNING`` (params get s, m, tok, clk); raise the refusal if no row."""
        with self.tx(durable=durable) as cur:
            cur.execute(sql, {"s": self.name, "m": lease.member, "tok": lease.lease_score, "clk": self._clk(),
                              **params})
            row = cur.fetchone()
            if row is None:
                code = self._missing(cur, [lease.member])[lease.member]
        if row is None:
            lease.cancel()
            raise refusal(code, lease.member)
        return row

    _RENEW = (f"UPDATE schedule_routes r SET lease_expires_at = {ts('c.now + %(lease)s')}, "
              f"due_at = {ts('c.now + %(lease)s + 1')}, lease_token = (c.now + %(lease)s)::text || '.50', "
              f"last_heartbeat_at = {ts('c.now')}, start_mark = CASE WHEN r.start_mark = r.lease_token THEN (c.now + %(lease)s)::text || '.50' END "
              f"FROM (SELECT {NOW} AS now) c "
              "WHERE r.schedule = %(s)s AND r.route = %(m)s AND r.lease_token = %(tok)s RETURNING r.lease_token")

    def renew(self, lease: Lease, lease_ms: int | None = None) -> Lease:
        """Extend (heartbeat) ``lease``: a new token, ``last_heartbeat_at`` = now; a renewal shows the holder
        is checking, so a start mark follows the new token (an unmarked lease stays unmarked: a quarantined
        check in a process of its own is never marked). Raises ``LeaseLost``/gone."""
        row = self._fenced_one(lease, self._RENEW, {"lease": int(lease_ms or self.lease_ms)}, durable=False)
        lease.lease_score = row[0]
        return lease

    def renew_many(self, leases: Sequence[Lease], lease_ms: int | None = None) -> list[int]:
        """Extend many leases in one statement; one code per lease (1, ``LEASE_LOST``, ``GONE``); refused
        leases get their cancellation token fired."""
        if not leases:
            return []
        with self.tx(durable=False) as cur:
            vals = values(cur, [(le.member, le.lease_score) for le in leases])
            cur.execute(
                f"UPDATE schedule_routes r SET lease_expires_at = {ts('c.now + %(lease)s')}, "
                f"due_at = {ts('c.now + %(lease)s + 1')}, lease_token = (c.now + %(lease)s)::text || '.50', "
                f"last_heartbeat_at = {ts('c.now')}, start_mark = CASE WHEN r.start_mark = r.lease_token THEN (c.now + %(lease)s)::text || '.50' END "
                f"FROM (SELECT {NOW} AS now) c, (VALUES {vals}) AS v(route, tok) "
                "WHERE r.schedule = %(s)s AND r.route = v.route AND r.lease_token = v.tok "
                "RETURNING r.route, v.tok, r.lease_token",
                {"lease": int(lease_ms or self.lease_ms), "s": self.name, "clk": self._clk()})
            done = {(m, old): new for m, old, new in cur.fetchall()}
            missing = [le.member for le in leases if (le.member, le.lease_score) not in done]
            codes = self._missing(cur, missing) if missing else {}
        out = []
        for le in leases:
            new = done.get((le.member, le.lease_score))
            if new is None:
                le.cancel()
                out.append(codes[le.member])
            else:
                le.lease_score = new
                out.append(COMPLETED)
        return out

    def release(self, leases: Sequence[Lease]) -> list[int]:
        """Hand leases back unchecked: claimable at once with the previous due time (now when that was an
        expired lease), no stall counted, the start mark cleared, suspicion kept. One code per lease."""
        if not leases:
            return []
        rows = []
        for le in leases:
            prev = str(le.previous_score)
            frac = prev.split(".")[1] if "." in prev else "00"
            if frac.startswith("5"):
                rows.append((le.member, le.lease_score, None, False))
            else:
                due = token_ms(prev) + (1 if frac.startswith("25") else 0)
                rows.append((le.member, le.lease_score, due, frac.startswith("25")))
        with self.tx(durable=False) as cur:
            vals = values(cur, rows)
            cur.execute(
                f"UPDATE schedule_routes r SET due_at = {ts('COALESCE(v.due::bigint, c.now)')}, retry = v.retry, "
                "lease_expires_at = NULL, lease_token = NULL, leased_at = NULL, last_heartbeat_at = NULL, "
                f"start_mark = NULL FROM (SELECT {NOW} AS now) c, (VALUES {vals}) AS v(route, tok, due, retry) "
                "WHERE r.schedule = %(s)s AND r.route = v.route AND r.lease_token = v.tok RETURNING r.route, v.tok",
                {"s": self.name, "clk": self._clk()})
            done = set(cur.fetchall())
            missing = [le.member for le in leases if (le.member, le.lease_score) not in done]
            codes = self._missing(cur, missing) if missing else {}
        for le in leases:
            le.cancel()
        return [COMPLETED if (le.member, le.lease_score) in done else codes[le.member] for le in leases]

    def complete(self, leases: Sequence[Lease], interval_ms: int | None = None) -> list[int]:
        """Finish the cycles of ``leases`` in one statement; writes no payload. One code per lease."""
        return self.complete_with_results(leases, None, None, interval_ms).codes

    def _complete_rows(self, cur, leases: Sequence[Lease], interval_ms: int | None,
                       results: Sequence[dict | None] | None = None,
                       stream: StreamTarget | None = None) -> tuple[dict[int, int], dict[int, int]]:
        """Fenced completion of ``leases`` in one statement that also writes the result of each completed
        lease (``results[i]``) into the outbox for ``stream``: ``({index: code}, {index: outbox id})``."""
        import json

        first: dict[tuple[str, str], int] = {}
        for i, le in enumerate(leases):
            first.setdefault((le.member, le.lease_score), i)  # the same lease twice: only the first counts
        rows = [(i, m, tok, token_ms(leases[i].previous_score),
                 json.dumps(results[i]) if results is not None and stream is not None and results[i] else None)
                for (m, tok), i in first.items()]
        vals = values(cur, rows)
        cur.execute(
            f"WITH c AS (SELECT {NOW} AS now), upd AS ("
            f"UPDATE schedule_routes r SET due_at = {ts('GREATEST(v.prev, c.now) + %(iv)s')}, retry = false, "
            "lease_expires_at = NULL, lease_token = NULL, leased_at = NULL, last_heartbeat_at = NULL, "
            "stalls = 0, suspect = 0, start_mark = NULL, retries = 0 "
            f"FROM c, (VALUES {vals}) AS v(i, route, tok, prev, fields) "
            "WHERE r.schedule = %(s)s AND r.route = v.route AND r.lease_token = v.tok RETURNING v.i, v.fields), "
            "ins AS (INSERT INTO schedule_results (schedule, stream, grp, fields) SELECT %(s)s, %(st)s, %(grp)s, "
            "fields::jsonb FROM upd WHERE fields IS NOT NULL ORDER BY i RETURNING id) "
            "SELECT i, NULL FROM upd UNION ALL SELECT NULL, id FROM ins",
            {"s": self.name, "clk": self._clk(), "iv": int(interval_ms or self.interval_ms),
             "st": stream.key if stream else "", "grp": stream.group if stream else ""})
        done, ids = [], []
        for i, oid in cur.fetchall():
            (done.append(i) if i is not None else ids.append(oid))
        codes = {i: COMPLETED for i in done}
        has_fields = {row[0] for row in rows if row[4] is not None}
        with_result = sorted(i for i in done if i in has_fields)
        outbox = dict(zip(with_result, sorted(ids)))  # identities follow the insert order (by index)
        finished = {leases[i].member for i in codes}
        missing = [le.member for i, le in enumerate(leases) if i not in codes and le.member not in finished]
        refused = self._missing(cur, missing) if missing else {}
        for i, le in enumerate(leases):
            if i not in codes:
                codes[i] = LEASE_LOST if le.member in finished else refused[le.member]
        return codes, outbox

    def complete_with_results(self, leases: Sequence[Lease], results: Sequence[dict[str, str] | None] | None,
                              stream: StreamTarget | None, interval_ms: int | None = None,
                              desired: Sequence[str | None] | None = None) -> Completion:
        """Complete ``leases``, apply the holders' ownership changes (``desired[i]``, as
        :meth:`magpie.queue.RouteQueue.complete_with_results`) and record the result of each completed
        lease, in the same transaction, in the ``schedule_results`` outbox; after the commit the outbox is
        relayed to ``stream`` exactly once (:mod:`magpie.queue.pg.relay`). A result is recorded iff its
        lease completed (a route removed for want of owners records none).

        Returns a :class:`Completion` (codes 1 completed, ``REMOVED``, or a refusal; ``ids`` of the results
        the relay appended at once; ``full`` is never set: the outbox holds results until the stream has
        room). Refused leases are cancelled.
        """
        if not leases:
            return Completion()
        changes = [i for i, want in enumerate(desired or ()) if want is not None]
        if changes:
            with self.tx() as cur:  # ownership changes, completion and outbox rows in one transaction
                codes = self._apply_owner_changes(cur, leases, desired, changes)
                rest = [i for i in range(len(leases)) if i not in codes]
                if rest:
                    sub, sub_outbox = self._complete_rows(cur, [leases[i] for i in rest], interval_ms,
                                                          [results[i] for i in rest] if results else None,
                                                          stream)
                    codes.update({rest[j]: c for j, c in sub.items()})
                    outbox = {rest[j]: oid for j, oid in sub_outbox.items()}
                else:
                    outbox = {}
        else:
            with self.tx(autocommit=True) as cur:  # one statement: completion and outbox rows together
                codes, outbox = self._complete_rows(cur, leases, interval_ms, results, stream)
        pending = list(outbox.values())
        out = Completion(codes=[codes[i] for i in range(len(leases))], ids=[None] * len(leases))
        for le, c in zip(leases, out.codes):
            if c not in (COMPLETED, REMOVED):
                le.cancel()
        if pending:
            from magpie.queue.pg.relay import relay

            try:
                rep = relay(self, stream, ids=pending)
            except Exception as exc:  # noqa: BLE001 - Redis trouble: the results wait in the outbox
                log.warning("results outbox not relayed (%s); the next completion relays it", type(exc).__name__)
                return out
            out.dropped, out.trimmed = rep.dropped, rep.trimmed
            out.ids = [rep.stream_ids.get(outbox[i]) if i in outbox else None for i in range(len(leases))]
        return out

    def _apply_owner_changes(self, cur, leases: Sequence[Lease], desired: Sequence[str | None],
                             changes: list[int]) -> dict[int, int]:
        """Lock the rows of the leases with an ownership change and apply each current holder's delta;
        ``{index: code}`` of the leases settled here (removed, or refused: ``bad_payload``). The others
        are completed by the caller in the same transaction (a stale one is refused there)."""
        cur.execute("SELECT route, payload, lease_token FROM schedule_routes WHERE schedule = %s "
                    "AND route = ANY(%s) ORDER BY route FOR UPDATE",
                    (self.name, [leases[i].member for i in changes]))
        rows = {m: (p, tok) for m, p, tok in cur.fetchall()}
        codes: dict[int, int] = {}
        for i in changes:
            le = leases[i]
            stored, tok = rows.get(le.member, (None, None))
            if stored is None or tok != le.lease_score:
                continue
            updated = merge.apply_delta(stored, le.payload, desired[i])
            if updated is None:
                codes[i] = int(Refusal.BAD_PAYLOAD)
            elif updated == "":
                cur.execute("DELETE FROM schedule_routes WHERE schedule = %s AND route = %s",
                            (self.name, le.member))
                codes[i] = REMOVED
            elif updated != stored:
                cur.execute("UPDATE schedule_routes SET payload = %s WHERE schedule = %s AND route = %s",
                            (updated, self.name, le.member))
        return codes

    def complete_one(self, lease: Lease) -> None:
        """Complete a single lease; raises :class:`LeaseLost` / :class:`QueueError` when refused."""
        code = self.complete([lease])[0]
        if code != COMPLETED:
            raise refusal(code, lease.member)

    def _locked(self, cur, lease: Lease) -> tuple:
        """Lock the leased row; raise (and cancel) unless ``lease`` is current. Returns (payload,)."""
        cur.execute(f"SELECT payload, lease_token, due_at IS NULL, {NOW} FROM schedule_routes "
                    "WHERE schedule = %(s)s AND route = %(m)s FOR UPDATE",
                    {"s": self.name, "m": lease.member, "clk": self._clk()})
        row = cur.fetchone()
        if row is None or row[2] or row[1] != lease.lease_score:
            lease.cancel()
            raise refusal(GONE if row is None or row[2] else LEASE_LOST, lease.member)
        return row

    def complete_with_payload(self, lease: Lease, desired_payload: str, interval_ms: int | None = None) -> str:
        """Complete ``lease`` and apply the worker's ownership delta to the payload as stored now
        (:meth:`complete_with_results`). Returns ``"completed"`` or ``"removed"``; raises ``LeaseLost``,
        ``gone`` or ``bad_payload``."""
        comp = self.complete_with_results([lease], None, None, interval_ms, desired=[desired_payload])
        code = comp.codes[0]
        if code not in (COMPLETED, REMOVED):
            raise refusal(code, lease.member)
        return "removed" if code == REMOVED else "completed"

    def retry(self, lease: Lease, delay_ms: int) -> int:
        """End the cycle early, due again after ``delay_ms`` (a backoff retry); returns the retry count.
        Clears the stall evidence (the holder came back). Raises ``LeaseLost``/gone."""
        return int(self._fenced_one(lease, (
            f"UPDATE schedule_routes r SET due_at = {ts('c.now + %(d)s')}, retry = true, retries = retries + 1, "
            "lease_expires_at = NULL, lease_token = NULL, leased_at = NULL, last_heartbeat_at = NULL, "
            f"stalls = 0, suspect = 0, start_mark = NULL FROM (SELECT {NOW} AS now) c "
            "WHERE r.schedule = %(s)s AND r.route = %(m)s AND r.lease_token = %(tok)s RETURNING r.retries"),
            {"d": int(delay_ms)})[0])

    def progress(self, lease: Lease, value: str) -> None:
        """Record progress text for a leased route (fenced). Raises ``LeaseLost``/gone."""
        self._fenced_one(lease, "UPDATE schedule_routes SET progress = %(v)s WHERE schedule = %(s)s AND "
                                "route = %(m)s AND lease_token = %(tok)s RETURNING 1", {"v": value})

    def log(self, lease: Lease, line: str) -> int:
        """Append ``line`` to the route's log (fenced, trimmed to ``log_limit``); returns its length."""
        return int(self._fenced_one(lease, (
            "UPDATE schedule_routes SET logs = (logs || %(v)s::text)[GREATEST(1, cardinality(logs) + 2 - %(lim)s):] "
            "WHERE schedule = %(s)s AND route = %(m)s AND lease_token = %(tok)s RETURNING cardinality(logs)"),
            {"v": line, "lim": self.log_limit})[0])

    def remove(self, lease: Lease) -> None:
        """Delete a leased route, fenced on the token and on the original payload (``payload_changed``)."""
        with self.tx() as cur:
            stored = self._locked(cur, lease)[0]
            if stored != lease.payload:
                raise refusal(Refusal.PAYLOAD_CHANGED, lease.member)
            cur.execute("DELETE FROM schedule_routes WHERE schedule = %s AND route = %s", (self.name, lease.member))
