"""Route reputation: a score 0-100 from five components, recomputed by the ``reputation`` job.

Score = 100 x (0.45 uptime + 0.20 recency + 0.15 latency + 0.10 anonymity + 0.10 streak), each component
in [0, 1] (formulas in :func:`components` and docs/derived-data.md); label ``good`` at 80 or more,
``neutral`` at 40 or more, ``poor`` below.

Ingestion marks every route it writes a result for in ``reputation_dirty`` (same transaction as the
result). The job takes up to a batch of dirty routes per transaction (``FOR UPDATE SKIP LOCKED``, then
deleted), computes their scores from ``route_health`` and the window of ``check_history``, and replaces
their ``route_reputation`` rows in the same transaction: a pass killed mid-batch leaves the routes dirty,
and a result ingested while a batch runs marks its route dirty again after the batch commits. Once no
route is dirty, routes scored longer ago than ``MAGPIE_REPUTATION_MAX_AGE`` (and checked routes never
scored) are marked dirty a batch at a time, so recency decays for routes no longer checked.

A pass scores at most ``MAGPIE_REPUTATION_PER_PASS`` routes, taking the dirty routes in route id order
from where the last pass stopped (wrapping around): with every route checked every few minutes, nearly
every route is dirty at once, and each score reads the route's whole window of history, so the job's cost
per pass is fixed rather than proportional to the population (a score may be up to
``routes / per_pass`` passes old).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa

from magpie.maintenance.base import Job, JobContext

WEIGHTS = {"uptime": 0.45, "recency": 0.20, "latency": 0.15, "anonymity": 0.10, "streak": 0.10}
"""Weight of each component in the score (they add up to 1)."""
GOOD = 80.0
"""Scores at or above are labelled ``good``."""
NEUTRAL = 40.0
"""Scores at or above (and below :data:`GOOD`) are labelled ``neutral``; below, ``poor``."""
LABELS = ("good", "neutral", "poor")
ANONYMITY = {"elite": 1.0, "anonymous": 0.5, "transparent": 0.0}
"""Anonymity component per grade; a route with no grade (never alive, or unknown) scores 0."""


@dataclass(frozen=True, slots=True)
class History:
    """What a route's score is computed from.

    Attributes:
        checks / alive: checks and alive checks in the window.
        latency_ms: mean latency (ms) of the window's alive checks that measured one; None if none.
        last_alive_age_s: seconds since the newest alive check (any time); None if never alive.
        anonymity: newest anonymity grade in the window (``elite``, ``anonymous``, ``transparent``) or None.
        consecutive_failures: failed checks since the newest alive one.
    """

    checks: int
    alive: int
    latency_ms: float | None
    last_alive_age_s: float | None
    anonymity: str | None
    consecutive_failures: int


@dataclass(frozen=True, slots=True)
class Params:
    """Scoring parameters (settings ``MAGPIE_REPUTATION_*``): recency horizon (s), latency bounds (ms),
    failure-streak limit (checks)."""

    recency_horizon_s: float = 86400.0
    latency_good_ms: float = 500.0
    latency_bad_ms: float = 5000.0
    streak_limit: int = 10

    @classmethod
    def from_settings(cls, s) -> Params:
        """The parameters of :class:`magpie.config.Settings` ``s``. Raises ``ValueError`` when the bad
        latency bound is not above the good one."""
        if s.reputation_latency_bad_ms <= s.reputation_latency_good_ms:
            raise ValueError("MAGPIE_REPUTATION_LATENCY_BAD_MS must be above "
                             "MAGPIE_REPUTATION_LATENCY_GOOD_MS")
        return cls(float(s.reputation_recency_horizon), float(s.reputation_latency_good_ms),
                   float(s.reputation_latency_bad_ms), int(s.reputation_streak_limit))


@dataclass(frozen=True, slots=True)
class Reputation:
    """A computed score (0-100, one decimal), its label and the components it came from."""

    score: float
    label: str
    components: dict


def _clamp(x: float) -> float:
    return 0.0 if x < 0 else 1.0 if x > 1 else x


def components(h: History, p: Params = Params()) -> dict:
    """The five components of ``h``, each in [0, 1]:

    * ``uptime`` = alive / checks in the window (0 without checks);
    * ``recency`` = 1 - age / horizon of the newest alive check, floored at 0 (0 if never alive);
    * ``latency`` = 1 at or below the good bound, 0 at or above the bad bound, linear between
      (0 without a measured latency);
    * ``anonymity`` = :data:`ANONYMITY` of the grade (0 without one);
    * ``streak`` = 1 - consecutive failures / streak limit, floored at 0.
    """
    uptime = h.alive / h.checks if h.checks > 0 else 0.0
    if h.last_alive_age_s is None:
        recency = 0.0
    else:
        recency = _clamp(1.0 - max(0.0, h.last_alive_age_s) / p.recency_horizon_s)
    if h.latency_ms is None:
        latency = 0.0
    else:
        latency = _clamp((p.latency_bad_ms - h.latency_ms) / (p.latency_bad_ms - p.latency_good_ms))
    anonymity = ANONYMITY.get(h.anonymity or "", 0.0)
    streak = _clamp(1.0 - h.consecutive_failures / p.streak_limit)
    return {"uptime": uptime, "recency": recency, "latency": latency, "anonymity": anonymity,
            "streak": streak}


def label_for(score: float) -> str:
    """``good`` (>= :data:`GOOD`), ``neutral`` (>= :data:`NEUTRAL`) or ``poor``."""
    return "good" if score >= GOOD else "neutral" if score >= NEUTRAL else "poor"


def score(h: History, p: Params = Params()) -> Reputation:
    """The reputation of ``h``: 100 x the weighted sum of :func:`components` (:data:`WEIGHTS`), rounded
    to one decimal, and its :func:`label_for`."""
    c = components(h, p)
    total = round(100.0 * sum(WEIGHTS[k] * v for k, v in c.items()), 1)
    return Reputation(total, label_for(total), c)


_TAKE_DIRTY = """
    DELETE FROM reputation_dirty WHERE route_id IN (
        SELECT route_id FROM reputation_dirty WHERE route_id > :after ORDER BY route_id LIMIT :batch
        FOR UPDATE SKIP LOCKED)
    RETURNING route_id
"""
_HISTORY = """
    SELECT h.route_id, h.consecutive_failures, h.last_alive_at, w.checks, w.alive, w.latency_ms, w.anonymity
    FROM route_health h
    CROSS JOIN LATERAL (
        SELECT count(*) AS checks, count(*) FILTER (WHERE c.alive) AS alive,
               avg(c.latency_ms) FILTER (WHERE c.alive AND c.latency_ms IS NOT NULL) AS latency_ms,
               (array_agg(c.anonymity ORDER BY c.checked_at DESC) FILTER (WHERE c.anonymity IS NOT NULL))[1]
                   AS anonymity
        FROM check_history c WHERE c.route_id = h.route_id AND c.checked_at >= :since AND c.checked_at <= :now
    ) w
    WHERE h.route_id = ANY(CAST(:ids AS bigint[]))
"""
_UPSERT = """
    INSERT INTO route_reputation (route_id, score, label, uptime, recency, latency, anonymity, streak, checks,
                                  computed_at)
    SELECT *, CAST(:now AS timestamptz) FROM unnest(CAST(:ids AS bigint[]), CAST(:score AS real[]),
        CAST(:label AS text[]), CAST(:up AS real[]), CAST(:rec AS real[]), CAST(:lat AS real[]),
        CAST(:anon AS real[]), CAST(:streak AS real[]), CAST(:checks AS integer[]))
    ON CONFLICT (route_id) DO UPDATE SET score = EXCLUDED.score, label = EXCLUDED.label,
        uptime = EXCLUDED.uptime, recency = EXCLUDED.recency, latency = EXCLUDED.latency,
        anonymity = EXCLUDED.anonymity, streak = EXCLUDED.streak, checks = EXCLUDED.checks,
        computed_at = EXCLUDED.computed_at
"""
_MARK_STALE = """
    INSERT INTO reputation_dirty (route_id)
    SELECT h.route_id FROM route_health h LEFT JOIN route_reputation rr ON rr.route_id = h.route_id
    WHERE h.checks_total > 0 AND (rr.route_id IS NULL OR rr.computed_at < :stale)
    ORDER BY h.route_id LIMIT :batch
    ON CONFLICT (route_id) DO NOTHING
"""


def recompute(conn: sa.Connection, route_ids: list[int], now: datetime, window_days: int, p: Params) -> int:
    """Compute and store the reputation of ``route_ids`` (routes without health are skipped) as of
    ``now`` (aware datetime) over the ``window_days`` before it; returns the rows written."""
    if not route_ids:
        return 0
    rows = conn.execute(sa.text(_HISTORY), {"ids": sorted(route_ids), "now": now,
                                            "since": now - timedelta(days=window_days)}).all()
    cols: dict[str, list] = {k: [] for k in ("ids", "score", "label", "up", "rec", "lat", "anon", "streak",
                                             "checks")}
    for rid, cf, last_alive, checks, alive, lat, anon in rows:
        age = None if last_alive is None else (now - last_alive).total_seconds()
        lat = None if lat is None else float(lat)
        rep = score(History(int(checks), int(alive), lat, age, anon, int(cf)), p)
        c = rep.components
        for k, v in zip(cols, (rid, rep.score, rep.label, c["uptime"], c["recency"], c["latency"],
                               c["anonymity"], c["streak"], int(checks))):
            cols[k].append(v)
    if rows:
        conn.execute(sa.text(_UPSERT), {**cols, "now": now})
    return len(rows)


class ReputationJob(Job):
    name = "reputation"
    every = 60.0
    description = "recompute reputation scores of routes marked dirty by ingestion (and of stale scores)"

    def run(self, ctx: JobContext) -> dict:
        s = ctx.settings
        p = Params.from_settings(s)
        scored = marked = 0
        stale = ctx.now - timedelta(seconds=float(s.reputation_max_age))
        left = int(s.reputation_per_pass)  # a bounded share per pass, resumed in route id order
        after = int(ctx.state.get("after", 0))
        while left > 0 and not ctx.should_stop():
            n, wrapped = 0, False
            batch = min(ctx.batch_size, left)
            with ctx.engine.begin() as conn:
                ctx.fence(conn)
                ids = list(conn.execute(sa.text(_TAKE_DIRTY), {"after": after, "batch": batch}).scalars())
                if ids:
                    scored += recompute(conn, ids, ctx.now, int(s.reputation_window_days), p)
                    left -= len(ids)
                    after = max(ids)
                elif after:
                    after, wrapped = 0, True  # the end of the id range: on to the routes dirtied meanwhile
                else:
                    n = conn.execute(sa.text(_MARK_STALE), {"stale": stale, "batch": batch}).rowcount
                    marked += n
                ctx.save_state({"after": after}, conn)
            ctx.tick()
            if not ids and not wrapped and n == 0:
                return {"scored": scored, "stale_marked": marked, "complete": True}
        return {"scored": scored, "stale_marked": marked, "complete": False}


def read_reputation(conn: sa.Connection, route_ids: list[int]) -> dict[int, dict]:
    """``{route_id: {"score": float, "label": str, "computed_at": datetime}}`` for the scored routes of
    ``route_ids``."""
    if not route_ids:
        return {}
    rows = conn.execute(sa.text("SELECT route_id, score, label, computed_at FROM route_reputation "
                                "WHERE route_id = ANY(CAST(:ids AS bigint[]))"), {"ids": list(route_ids)})
    return {r[0]: {"score": float(r[1]), "label": r[2], "computed_at": r[3]} for r in rows}


JOB = ReputationJob()
