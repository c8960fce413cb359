"""Import, time, operator and read planes of the PostgreSQL schedule (mixed into
:class:`magpie.queue.pg.PgSchedule`, which provides ``tx()``, ``name``, ``keys``, ``_clk()``).

Every verb is one transaction and gives the same results and typed refusals as its Redis script.
"""

from __future__ import annotations

from magpie.errors import Refusal
from magpie.queue.pg import merge
from magpie.queue.pg.sql import NOW, SCORE_MS, ms, score_text, ts
from magpie.queue.refusals import refusal

ANALYZE_AFTER = 1000
"""An import adding at least this many routes refreshes the table statistics (``ANALYZE``) at its end."""

_LIVE = f"lease_expires_at >= {ts('%(now)s')}"


class AdminPlane:
    """The non-worker planes of :class:`~magpie.queue.pg.PgSchedule`."""

    def _now(self, cur) -> int:
        cur.execute(f"SELECT {NOW}", {"clk": self._clk()})
        return int(cur.fetchone()[0])

    # -- import and time controls --------------------------------------------------------------------
    def schedule(self, items, total: int | None = None, start_index: int = 0, batch: int = 500) -> dict[str, int]:
        """Add ``(route_hash, payload)`` pairs; route i of ``total`` is first due at now + i * interval /
        total. A stored route keeps its due time; only new workspace ids are merged into its payload.
        Returns ``{"new", "merged", "unchanged"}``."""
        from magpie.queue.pg.sql import values

        items = list(items)
        total = total or len(items) or 1
        step = self.interval_ms / total
        counts = {"new": 0, "merged": 0, "unchanged": 0}
        for off in range(0, len(items), batch):
            chunk = items[off: off + batch]
            with self.tx() as cur:
                now = self._now(cur)
                cur.execute("SELECT route, payload FROM schedule_routes WHERE schedule = %s AND route = ANY(%s) "
                            "FOR UPDATE", (self.name, [h for h, _ in chunk]))
                stored = dict(cur.fetchall())
                new, changed = [], []
                for j, (h, payload) in enumerate(chunk):
                    if h in stored:
                        upd = merge.merge_import(stored[h], payload)
                        if upd is None:
                            counts["unchanged"] += 1
                        else:
                            stored[h] = upd
                            changed.append((h, upd))
                            counts["merged"] += 1
                    else:
                        stored[h] = payload
                        new.append((self.name, h, self._shard_n(h), payload,
                                    now + int((start_index + off + j) * step)))
                if new:
                    cur.execute("INSERT INTO schedule_routes (schedule, route, shard, payload, due_at) SELECT "
                                f"v.s, v.r, v.sh, v.p, {ts('v.d::bigint')} FROM (VALUES {values(cur, new)}) "
                                "AS v(s, r, sh, p, d) ON CONFLICT DO NOTHING", {})
                    counts["new"] += len(new)
                if changed:
                    cur.execute(f"UPDATE schedule_routes r SET payload = v.p FROM (VALUES {values(cur, changed)}) "
                                "AS v(r, p) WHERE r.schedule = %(s)s AND r.route = v.r", {"s": self.name})
        if counts["new"] >= ANALYZE_AFTER:
            # fresh statistics at once: with a bulk import unseen, the planner takes the schedule for a few
            # rows and joins completions by scanning it whole until autovacuum analyzes the table
            with self.tx(autocommit=True) as cur:
                cur.execute("ANALYZE schedule_routes")
        return counts

    def _at(self, member: str, due_sql: str, value: int) -> int:
        with self.tx() as cur:
            now = self._now(cur)
            cur.execute(f"SELECT COALESCE({_LIVE}, false), due_at IS NULL FROM schedule_routes "
                        "WHERE schedule = %(s)s AND route = %(m)s FOR UPDATE", {"s": self.name, "m": member, "now": now})
            row = cur.fetchone()
            if row is None or row[1]:
                raise refusal(Refusal.GONE if row is None else Refusal.DEAD, member)
            if row[0]:  # a live lease; an expired one (its holder vanished) ends here
                raise refusal(Refusal.LEASED, member)
            due = int(value) if due_sql == "at" else now + int(value)
            cur.execute(f"UPDATE schedule_routes SET due_at = {ts('%s')}, retry = false, retries = 0, "
                        "lease_expires_at = NULL, lease_token = NULL, leased_at = NULL, last_heartbeat_at = NULL "
                        "WHERE schedule = %s AND route = %s", (due, self.name, member))
        return due

    def enqueue_at(self, member: str, at_ms: int) -> int:
        """Check ``member`` at Unix ms ``at_ms``; returns the due time. Refusals: gone, leased, dead."""
        return self._at(member, "at", at_ms)

    def enqueue_in(self, member: str, delay_ms: int = 0) -> int:
        """Check ``member`` ``delay_ms`` from now (database clock); returns the due time (ms)."""
        return self._at(member, "in", delay_ms)

    def respread(self, interval_ms: int | None = None, batch: int = 1000) -> dict[str, int]:
        """Re-spread every unleased scheduled route evenly over ``interval_ms``; leased ones keep their
        lease. Returns ``{"moved", "leased", "missing"}``."""
        interval = int(interval_ms or self.interval_ms)
        with self.tx() as cur:
            now = self._now(cur)
            cur.execute("SELECT route, lease_token IS NOT NULL FROM schedule_routes WHERE schedule = %s AND "
                        "due_at IS NOT NULL ORDER BY shard, due_at, rank, route FOR UPDATE", (self.name,))
            rows = cur.fetchall()
            step = interval / (len(rows) or 1)
            moves = [(m, now + int(i * step)) for i, (m, leased) in enumerate(rows) if not leased]
            from magpie.queue.pg.sql import values

            if moves:
                cur.execute(f"UPDATE schedule_routes r SET due_at = {ts('v.d::bigint')}, retry = false FROM "
                            f"(VALUES {values(cur, moves)}) AS v(r, d) WHERE r.schedule = %(s)s AND r.route = v.r",
                            {"s": self.name})
        return {"moved": len(moves), "leased": len(rows) - len(moves), "missing": 0}

    # -- operator plane -------------------------------------------------------------------------------
    def _set_paused(self, paused: bool) -> None:
        with self.tx() as cur:
            cur.execute("INSERT INTO schedule_meta (schedule, shards, paused) VALUES (%s, %s, %s) "
                        "ON CONFLICT (schedule) DO UPDATE SET paused = EXCLUDED.paused",
                        (self.name, self.keys.shards, paused))

    def pause(self) -> None:
        """Stop claiming: once this returns, no claim takes anything. Leases already out may finish."""
        self._set_paused(True)

    def resume(self) -> None:
        """Claim again."""
        self._set_paused(False)

    def is_paused(self) -> bool:
        """True while paused."""
        with self.tx() as cur:
            cur.execute("SELECT paused FROM schedule_meta WHERE schedule = %s", (self.name,))
            row = cur.fetchone()
        return bool(row and row[0])

    def drain(self, batch: int = 1000, progress=None) -> dict[str, int]:
        """Delete every due or waiting route, sparing live leases, in one transaction; ``progress(done,
        total)`` is called once at the end. ``{"due", "waiting", "leased_spared"}``."""
        with self.tx() as cur:
            now = self._now(cur)
            cur.execute(f"WITH d AS (DELETE FROM schedule_routes WHERE schedule = %(s)s AND due_at IS NOT NULL "
                        f"AND NOT COALESCE({_LIVE}, false) RETURNING due_at <= {ts('%(now)s')} AS due) "
                        "SELECT count(*) FILTER (WHERE due), count(*) FILTER (WHERE NOT due) FROM d",
                        {"s": self.name, "now": now})
            due, waiting = cur.fetchone()
            cur.execute(f"SELECT count(*) FROM schedule_routes WHERE schedule = %(s)s AND {_LIVE}",
                        {"s": self.name, "now": now})
            leased = cur.fetchone()[0]
        out = {"due": int(due), "waiting": int(waiting), "leased_spared": int(leased)}
        if progress is not None:
            progress(sum(out.values()), sum(out.values()))
        return out

    def obliterate(self, force: bool = False, batch: int = 1000) -> tuple[str, int]:
        """Delete the whole schedule, at most ``batch`` routes per call: ``("more"|"done", deleted)``.
        Refusals: ``not_paused``, ``active_leases`` (live leases, unless ``force``)."""
        with self.tx() as cur:
            now = self._now(cur)
            cur.execute("SELECT paused FROM schedule_meta WHERE schedule = %s FOR UPDATE", (self.name,))
            row = cur.fetchone()
            if not (row and row[0]):
                raise refusal(Refusal.NOT_PAUSED)
            if not force:
                cur.execute(f"SELECT EXISTS (SELECT 1 FROM schedule_routes WHERE schedule = %(s)s AND {_LIVE})",
                            {"s": self.name, "now": now})
                if cur.fetchone()[0]:
                    raise refusal(Refusal.ACTIVE_LEASES)
            cur.execute("DELETE FROM schedule_routes WHERE schedule = %s AND route IN (SELECT route FROM "
                        "schedule_routes WHERE schedule = %s LIMIT %s)", (self.name, self.name, int(batch)))
            deleted = cur.rowcount
            cur.execute("SELECT EXISTS (SELECT 1 FROM schedule_routes WHERE schedule = %s)", (self.name,))
            if cur.fetchone()[0]:
                return "more", deleted
            cur.execute("DELETE FROM schedule_meta WHERE schedule = %s", (self.name,))
            cur.execute("DELETE FROM schedule_results WHERE schedule = %s", (self.name,))
        return "done", deleted

    def remove_route(self, member: str, force: bool = False, expected: str | None = None) -> None:
        """Operator removal of one route. ``expected``: the payload text the caller read (None: no payload
        fence). Refusals: ``gone``; ``payload_changed`` (stored payload is not ``expected``);
        ``active_leases`` under a live lease unless ``force`` (its holder's completion then finds it gone)."""
        with self.tx() as cur:
            now = self._now(cur)
            cur.execute(f"SELECT COALESCE({_LIVE}, false), payload FROM schedule_routes WHERE schedule = %(s)s "
                        "AND route = %(m)s FOR UPDATE", {"s": self.name, "m": member, "now": now})
            row = cur.fetchone()
            if row is None:
                raise refusal(Refusal.GONE, member)
            if expected is not None and row[1] != expected:
                raise refusal(Refusal.PAYLOAD_CHANGED, member)
            if row[0] and not force:
                raise refusal(Refusal.ACTIVE_LEASES, member)
            cur.execute("DELETE FROM schedule_routes WHERE schedule = %s AND route = %s", (self.name, member))

    def update(self, member: str, payload: str, expected: str, force: bool = False) -> None:
        """Operator replacement of a route's payload, fenced on ``expected`` (the payload text the caller
        built ``payload`` from); the schedule is untouched. Refusals: ``gone``; ``payload_changed``;
        ``active_leases`` under a live lease unless ``force``. A refusal changes nothing."""
        with self.tx() as cur:
            now = self._now(cur)
            cur.execute(f"SELECT COALESCE({_LIVE}, false), payload FROM schedule_routes WHERE schedule = %(s)s "
                        "AND route = %(m)s FOR UPDATE", {"s": self.name, "m": member, "now": now})
            row = cur.fetchone()
            if row is None:
                raise refusal(Refusal.GONE, member)
            if row[1] != expected:
                raise refusal(Refusal.PAYLOAD_CHANGED, member)
            if row[0] and not force:
                raise refusal(Refusal.ACTIVE_LEASES, member)
            cur.execute("UPDATE schedule_routes SET payload = %s WHERE schedule = %s AND route = %s",
                        (payload, self.name, member))

    def dead_letters(self, limit: int = 100) -> list[dict]:
        """Dead-lettered routes, oldest first: ``[{"member", "dead_at_ms", "reason", "stalls", "claims",
        "alone"}]`` (the evidence recorded when the route was dead-lettered)."""
        with self.tx() as cur:
            cur.execute(f"SELECT route, {ms('dead_at')}, dead_reason FROM schedule_routes WHERE schedule = %s "
                        "AND dead_at IS NOT NULL ORDER BY dead_at, route LIMIT %s", (self.name, int(limit)))
            rows = cur.fetchall()
        return [{"member": m, "dead_at_ms": int(at), "reason": (d or {}).get("reason"),
                 "stalls": (d or {}).get("stalls"), "claims": (d or {}).get("claims"),
                 "alone": (d or {}).get("alone")} for m, at, d in rows]

    def reprocess(self, member: str) -> int:
        """Put a dead-lettered route back, due now, stall evidence cleared. Returns the due time (ms).
        Raises ``not_dead``."""
        with self.tx() as cur:
            now = self._now(cur)
            cur.execute(f"UPDATE schedule_routes SET due_at = {ts('%s')}, dead_at = NULL, dead_reason = NULL, "
                        "stalls = 0, suspect = 0, start_mark = NULL, retries = 0, retry = false "
                        "WHERE schedule = %s AND route = %s AND dead_at IS NOT NULL", (now, self.name, member))
            if cur.rowcount == 0:
                raise refusal(Refusal.NOT_DEAD, member)
        return now

    # -- reads ----------------------------------------------------------------------------------------
    def server_time_ms(self) -> int:
        """Now in Unix ms: the database server clock (or the test clock)."""
        if self.clock:
            return int(self.clock())
        with self.tx() as cur:
            return self._now(cur)

    def _row(self, member: str, cols: str):
        with self.tx() as cur:
            cur.execute(f"SELECT {cols} FROM schedule_routes WHERE schedule = %s AND route = %s",
                        (self.name, member))
            return cur.fetchone()

    def score(self, member: str) -> str | None:
        """The route's score as on Redis (``'%.2f'``: ``.25`` retry, ``.50`` lease), or None."""
        row = self._row(member, f"{ms('due_at')}, rank")
        return None if row is None else score_text(row[0], row[1])

    def payload(self, member: str) -> str | None:
        """The stored payload text, or None."""
        row = self._row(member, "payload")
        return None if row is None else row[0]

    def payloads(self, members) -> list[str | None]:
        """The stored payload texts of ``members`` in order (None where missing): one ``SELECT``."""
        members = list(members)
        if not members:
            return []
        with self.tx() as cur:
            cur.execute("SELECT route, payload FROM schedule_routes WHERE schedule = %s AND route = ANY(%s)",
                        (self.name, members))
            found = dict(cur.fetchall())
        return [found.get(m) for m in members]

    def inspect(self, member: str) -> dict:
        """Everything known about one route, in the shape of :func:`magpie.queue.reads.inspect`, plus
        ``last_silent_ms``: how long the last lease reaped by a claim had gone without a heartbeat."""
        now = self.server_time_ms()
        row = self._row(member, f"payload, {ms('due_at')}, rank, stalls, retries, progress, logs, "
                                f"{ms('dead_at')}, dead_reason, last_silent_ms")
        if row is None:
            return {"member": member, "payload": None, "score": None, "state": "gone", "stalls": 0, "retries": 0,
                    "progress": None, "logs": [], "dead": None}
        payload, due, rank, stalls, retries, progress, logs, dead_at, reason, silent = row
        score = score_text(due, rank)
        if score is None:
            state = "dead"
        elif rank == 1:
            state = "leased" if due - 1 >= now else "lease_expired"
        elif rank == 0:
            state = "retry"
        else:
            state = "due" if due <= now else "waiting"
        return {"member": member, "payload": payload, "score": score, "state": state, "stalls": int(stalls),
                "retries": int(retries), "progress": progress, "logs": list(logs)[-20:],
                "dead": {"at_ms": int(dead_at), **(reason or {})} if dead_at is not None else None,
                "last_silent_ms": None if silent is None else int(silent)}

    def status(self) -> dict:
        """Per-shard counts now, in the shape of :func:`magpie.queue.reads.status`."""
        with self.tx() as cur:
            now = self._now(cur)
            p = {"s": self.name, "now": now}
            cur.execute(
                f"SELECT shard, count(*) FILTER (WHERE due_at IS NOT NULL), count(*) FILTER (WHERE {_LIVE}), "
                f"count(*) FILTER (WHERE lease_expires_at < {ts('%(now)s')}), "
                f"count(*) FILTER (WHERE {SCORE_MS} <= %(now)s), "
                f"min({SCORE_MS}) FILTER (WHERE {SCORE_MS} > %(now)s), "
                f"min({SCORE_MS}) FILTER (WHERE {SCORE_MS} <= %(now)s), count(*) FILTER (WHERE dead_at IS NOT NULL) "
                "FROM schedule_routes WHERE schedule = %(s)s GROUP BY shard", p)
            rows = {r[0]: r for r in cur.fetchall()}
            cur.execute("SELECT paused FROM schedule_meta WHERE schedule = %s", (self.name,))
            meta = cur.fetchone()
        shards, dead = [], 0
        for n, key in enumerate(self.keys.all_shards()):
            r = rows.get(str(n)) or (str(n), 0, 0, 0, 0, None, None, 0)
            dead += int(r[7])
            shards.append({"shard": key, "scheduled": int(r[1]), "leased": int(r[2]), "expired_leases": int(r[3]),
                           "due_now": int(r[4]), "next_due_ms": int(r[5]) if r[5] is not None else None,
                           "oldest_lateness_s": round((now - float(r[6])) / 1000, 3) if r[6] is not None else 0.0})
        totals = {k: sum(s[k] for s in shards) for k in ("scheduled", "leased", "expired_leases", "due_now")}
        totals.update(dead=dead, next_due_ms=min((s["next_due_ms"] for s in shards if s["next_due_ms"]), default=None),
                      oldest_lateness_s=max((s["oldest_lateness_s"] for s in shards), default=0.0))
        return {"now_ms": now, "paused": bool(meta and meta[0]), "shards": shards, "totals": totals}

    def dead_count(self) -> int:
        """How many routes are dead-lettered."""
        with self.tx() as cur:
            cur.execute("SELECT count(*) FROM schedule_routes WHERE schedule = %s AND dead_at IS NOT NULL",
                        (self.name,))
            return int(cur.fetchone()[0])

    def in_flight(self, limit: int = 100) -> list[dict]:
        """Outstanding leases, soonest expiry first: ``[{"member", "lease_score", "expires_in_s",
        "silent_seconds"}]``; silence counts from the last heartbeat (or the claim)."""
        with self.tx() as cur:
            now = self._now(cur)
            cur.execute(f"SELECT route, lease_token, {ms('lease_expires_at')}, "
                        f"{ms('COALESCE(last_heartbeat_at, leased_at)')} FROM schedule_routes WHERE schedule = %s "
                        "AND lease_token IS NOT NULL ORDER BY lease_expires_at, route LIMIT %s",
                        (self.name, int(limit)))
            rows = cur.fetchall()
        return [{"member": m, "lease_score": tok, "expires_in_s": round((exp - now) / 1000, 3),
                 "silent_seconds": round((now - beat) / 1000, 3)} for m, tok, exp, beat in rows]

    # -- test hooks (the conformance suite) ---------------------------------------------------------
    def force_due(self, member: str, score: float = 1000) -> None:
        """Tests only: make ``member`` due at Unix ms ``score`` (dropping any lease)."""
        with self.tx() as cur:
            cur.execute(f"UPDATE schedule_routes SET due_at = {ts('%s')}, retry = false, lease_expires_at = NULL, "
                        "lease_token = NULL WHERE schedule = %s AND route = %s", (int(score), self.name, member))
