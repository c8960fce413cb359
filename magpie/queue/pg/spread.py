"""Bounded respread batches of the PostgreSQL schedule (the counterpart of ``lua/respread_batch.lua``),
mixed into :class:`magpie.queue.pg.PgSchedule` for the interval-change job of
:mod:`magpie.maintenance.interval`."""

from __future__ import annotations

from magpie.queue.pg.sql import ts


class SpreadPlane:
    """``route_count`` and ``respread_batch`` with the same arguments and replies as on Redis."""

    def route_count(self) -> int:
        """Scheduled routes (leased ones included; dead letters are not scheduled)."""
        with self.tx() as cur:
            cur.execute("SELECT count(*) FROM schedule_routes WHERE schedule = %s AND due_at IS NOT NULL",
                        (self.name,))
            return int(cur.fetchone()[0])

    def respread_batch(self, shard: int, cursor: str = "0", *, count: int = 1000, placed: int = 0,
                       total: int = 1, interval_ms: int | None = None, progress_key: str | None = None,
                       run: str | None = None) -> dict:
        """Move one batch of shard ``shard``: route number ``p`` becomes due at now +
        ``(p mod total) * interval_ms / total``; leased routes keep their lease but take their number.

        ``cursor`` is the last route hash of the previous batch (``"0"`` starts the shard; the reply's
        ``"0"`` ends it). With ``progress_key``/``run`` the batch runs only while the Redis hash's ``run``
        equals ``run`` and then records ``cursor``, ``placed``, ``moved``, ``leased`` and ``shard`` there
        (right after the database commit, not atomically with it: a crash between them repeats one batch,
        which only moves the same routes again). Returns ``{"cursor", "moved", "leased", "placed",
        "superseded"}``.
        """
        if progress_key and self.r.hget(progress_key, "run") not in (run, (run or "").encode()):
            return {"cursor": str(cursor), "moved": 0, "leased": 0, "placed": placed, "superseded": True}
        interval, total = int(interval_ms or self.interval_ms), max(1, int(total))
        moved = leased = 0
        with self.tx() as cur:
            now = self._now(cur)
            cur.execute("SELECT route, lease_token IS NOT NULL FROM schedule_routes WHERE schedule = %s AND "
                        "shard = %s AND due_at IS NOT NULL AND route > %s ORDER BY route LIMIT %s FOR UPDATE",
                        (self.name, str(int(shard)), "" if str(cursor) == "0" else str(cursor), int(count)))
            rows = cur.fetchall()
            moves = []
            for route, is_leased in rows:
                if is_leased:
                    leased += 1
                else:
                    moves.append((route, now + (placed % total) * interval // total))
                    moved += 1
                placed += 1
            if moves:
                from magpie.queue.pg.sql import values

                cur.execute(f"UPDATE schedule_routes r SET due_at = {ts('v.d::bigint')}, retry = false FROM "
                            f"(VALUES {values(cur, moves)}) AS v(r, d) WHERE r.schedule = %(s)s AND r.route = v.r",
                            {"s": self.name})
        nxt = rows[-1][0] if len(rows) == int(count) else "0"
        if progress_key:
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(progress_key, mapping={"cursor": nxt, "placed": placed})
            pipe.hincrby(progress_key, "moved", moved)
            pipe.hincrby(progress_key, "leased", leased)
            if nxt == "0":
                pipe.hincrby(progress_key, "shard", 1)
            pipe.execute()
        return {"cursor": nxt, "moved": moved, "leased": leased, "placed": placed, "superseded": False}
