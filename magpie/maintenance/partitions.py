"""Job ``partitions``: ``check_history`` partitions (monthly or daily), prepared ahead of time.

``check_history`` is range-partitioned on ``checked_at`` with a DEFAULT partition,
``check_history_default``, that catches rows no partition covers. ``MAGPIE_PARTITION_SPAN`` picks the
span of one partition:

- ``month`` (default): each pass creates the partitions of the current UTC month and the next
  ``MAGPIE_PARTITION_MONTHS_AHEAD`` months, named ``check_history_pYYYYMM`` and bounded
  ``[first instant of the month, first instant of the next)`` in UTC;
- ``day``: the current UTC day and the next ``MAGPIE_PARTITION_DAYS_AHEAD`` days, named
  ``check_history_pYYYYMMDD``. At a million routes on a five-minute interval history grows by about
  275 M rows a day: daily partitions let retention drop a day at a time, so the table holds the
  retention plus one day rather than plus one month.

Switching span is safe at any time: a partition that already covers part of a wanted range is left alone
(an existing month partition keeps its days), and retention drops partitions of either span.

PostgreSQL refuses to create a partition whose range already has rows in the DEFAULT partition. When
that happens (the schedule fell behind, or history was written before partitions existed), one
transaction holding ``ACCESS EXCLUSIVE`` on ``check_history`` detaches the DEFAULT partition, creates
the month's partition, moves that month's rows into it and re-attaches the DEFAULT partition: it all
commits or nothing does. Writers wait for the lock (``lock_timeout`` 5 s, then the pass fails and
retries on its next run). The pass also adopts past months still sitting in the DEFAULT partition,
newest first, as long as they are within ``MAGPIE_HISTORY_RETENTION_DAYS`` (older rows are left to
``history_retention``), one month per batch.

Creating partitions months ahead keeps the DEFAULT partition empty in normal operation, so the move is
the exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.maintenance.base import Job, JobContext

PARENT = "check_history"
DEFAULT = "check_history_default"
LOCK_TIMEOUT = "5s"

_BOUND = re.compile(r"FOR VALUES FROM \('([^']+)'\) TO \('([^']+)'\)")


def month_start(t: datetime) -> datetime:
    """First instant (UTC) of the month containing ``t`` (naive values are taken as UTC)."""
    t = t.astimezone(UTC) if t.tzinfo else t.replace(tzinfo=UTC)
    return datetime(t.year, t.month, 1, tzinfo=UTC)


def add_months(m: datetime, n: int) -> datetime:
    """``m`` (a month start) moved by ``n`` months (negative goes back)."""
    k = m.year * 12 + (m.month - 1) + n
    return datetime(k // 12, k % 12 + 1, 1, tzinfo=UTC)


def partition_name(month: datetime) -> str:
    """``check_history_pYYYYMM`` for the month starting at ``month``."""
    return f"{PARENT}_p{month.year:04d}{month.month:02d}"


SPANS = ("month", "day")
"""The partition spans ``MAGPIE_PARTITION_SPAN`` accepts."""


def span_start(t: datetime, span: str) -> datetime:
    """First instant (UTC) of the ``span`` (``month`` or ``day``) containing ``t``; naive ``t`` is UTC."""
    if span == "month":
        return month_start(t)
    t = t.astimezone(UTC) if t.tzinfo else t.replace(tzinfo=UTC)
    return datetime(t.year, t.month, t.day, tzinfo=UTC)


def add_spans(start: datetime, n: int, span: str) -> datetime:
    """``start`` (a span start) moved by ``n`` spans (negative goes back)."""
    return add_months(start, n) if span == "month" else start + timedelta(days=n)


def span_partition_name(start: datetime, span: str) -> str:
    """``check_history_pYYYYMM`` (month) or ``check_history_pYYYYMMDD`` (day) for the span at ``start``."""
    return partition_name(start) if span == "month" else f"{partition_name(start)}{start.day:02d}"


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of ``check_history``; ``lower``/``upper`` are None for DEFAULT (or MINVALUE/MAXVALUE)."""

    name: str
    lower: datetime | None
    upper: datetime | None
    is_default: bool


def _ts(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def list_partitions(conn: sa.Connection) -> list[Partition]:
    """The partitions of ``check_history`` with their bounds (read in UTC), ordered by lower bound.

    Sets ``TimeZone`` to UTC for the rest of ``conn``'s transaction (bounds print in the session zone)."""
    conn.exec_driver_sql("SET LOCAL TIME ZONE 'UTC'")
    rows = conn.exec_driver_sql(
        """
        SELECT c.relname, pg_get_expr(c.relpartbound, c.oid)
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'check_history'::regclass
        """
    ).all()
    out = []
    for name, bound in rows:
        if bound.strip().upper() == "DEFAULT":
            out.append(Partition(name, None, None, True))
            continue
        m = _BOUND.search(bound)
        lo, hi = (_ts(m.group(1)), _ts(m.group(2))) if m else (None, None)
        out.append(Partition(name, lo, hi, False))
    return sorted(out, key=lambda p: (p.is_default, p.lower or datetime.min.replace(tzinfo=UTC)))


def _lit(t: datetime) -> str:
    return "'" + t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S+00") + "'"


def create_month_partition(engine: Engine, month: datetime) -> dict:
    """Create the partition of ``month`` (a month start), moving its rows out of DEFAULT if needed;
    :func:`create_partition` with the ``month`` span."""
    return create_partition(engine, month, "month")


def create_partition(engine: Engine, at: datetime, span: str = "month") -> dict:
    """Create the partition of the ``span`` (``month`` or ``day``) containing ``at``, moving its rows
    out of DEFAULT if needed.

    One transaction (``ACCESS EXCLUSIVE`` on ``check_history``, ``lock_timeout`` 5 s), taken only when the
    partition is missing. Idempotent: an existing partition covering any part of the month is left alone.

    Returns:
        ``{"name": str, "created": bool, "moved": int}`` (rows moved from DEFAULT).
    Raises:
        sqlalchemy.exc.OperationalError: lock not obtained within the timeout (nothing changed).
    """
    if span not in SPANS:
        raise ValueError(f"partition span must be one of {', '.join(SPANS)}, got {span!r}")
    lo = span_start(at, span)
    hi = add_spans(lo, 1, span)
    name = span_partition_name(lo, span)

    def covering(parts: list[Partition]) -> Partition | None:
        for p in parts:
            if not p.is_default and p.lower is not None and p.upper is not None and p.lower < hi and lo < p.upper:
                return p
        return None

    with engine.begin() as conn:  # usual case, no lock taken: the partition exists already
        found = covering(list_partitions(conn))
    if found is not None:
        return {"name": found.name, "created": False, "moved": 0}
    with engine.begin() as conn:
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        conn.exec_driver_sql(f"LOCK TABLE {PARENT} IN ACCESS EXCLUSIVE MODE")
        parts = list_partitions(conn)
        found = covering(parts)
        if found is not None:  # created concurrently
            return {"name": found.name, "created": False, "moved": 0}
        has_default = any(p.is_default for p in parts)
        create = f"CREATE TABLE {name} PARTITION OF {PARENT} FOR VALUES FROM ({_lit(lo)}) TO ({_lit(hi)})"
        blocked = (
            has_default
            and conn.exec_driver_sql(
                f"SELECT EXISTS (SELECT 1 FROM {DEFAULT} WHERE checked_at >= %s AND checked_at < %s)",
                (lo, hi),
            ).scalar_one()
        )
        if not blocked:
            conn.exec_driver_sql(create)
            return {"name": name, "created": True, "moved": 0}
        conn.exec_driver_sql(f"ALTER TABLE {PARENT} DETACH PARTITION {DEFAULT}")
        conn.exec_driver_sql(create)
        moved = conn.exec_driver_sql(
            f"""
            WITH moved AS (
                DELETE FROM {DEFAULT} WHERE checked_at >= %s AND checked_at < %s RETURNING *
            )
            INSERT INTO {name} SELECT * FROM moved
            """,
            (lo, hi),
        ).rowcount
        conn.exec_driver_sql(f"ALTER TABLE {PARENT} ATTACH PARTITION {DEFAULT} DEFAULT")
        return {"name": name, "created": True, "moved": moved}


def _default_spans(engine: Engine, not_before: datetime, span: str = "month") -> list[datetime]:
    """Span starts (newest first) of rows in DEFAULT at or after ``not_before``."""
    with engine.connect() as conn:
        if conn.execute(sa.text("SELECT to_regclass(:n) IS NULL"), {"n": DEFAULT}).scalar_one():
            return []
        lo_hi = conn.exec_driver_sql(
            f"SELECT min(checked_at), max(checked_at) FROM {DEFAULT} WHERE checked_at >= %s", (not_before,)
        ).one()
        if lo_hi[0] is None:
            return []
        months = []
        m = span_start(lo_hi[1], span)
        first = span_start(lo_hi[0], span)
        while m >= first:
            exists = conn.exec_driver_sql(
                f"SELECT EXISTS (SELECT 1 FROM {DEFAULT} WHERE checked_at >= %s AND checked_at < %s)",
                (m, add_spans(m, 1, span)),
            ).scalar_one()
            if exists:
                months.append(m)
            m = add_spans(m, -1, span)
        return months


class PartitionsJob(Job):
    name = "partitions"
    every = 3600.0
    description = "create check_history partitions ahead; move rows out of DEFAULT when needed"

    def run(self, ctx: JobContext) -> dict:
        s = ctx.settings
        span = getattr(s, "partition_span", "month")
        current = span_start(ctx.now, span)
        ahead = int(s.partition_months_ahead) if span == "month" else int(s.partition_days_ahead)
        wanted = [add_spans(current, i, span) for i in range(ahead + 1)]
        keep_from = ctx.now - timedelta(days=int(s.history_retention_days))
        created, moved, existing = [], 0, 0
        for m in wanted:
            if ctx.should_stop():
                return {"created": created, "moved": moved, "existing": existing, "complete": False}
            r = create_partition(ctx.engine, m, span)
            ctx.tick()
            if r["created"]:
                created.append(r["name"])
                moved += r["moved"]
            else:
                existing += 1
        # Past spans whose rows are still in DEFAULT (and within retention): adopt them.
        for m in _default_spans(ctx.engine, span_start(keep_from, span), span):
            if ctx.should_stop():
                return {"created": created, "moved": moved, "existing": existing, "complete": False}
            r = create_partition(ctx.engine, m, span)
            ctx.tick()
            if r["created"]:
                created.append(r["name"])
                moved += r["moved"]
        return {"created": created, "moved": moved, "existing": existing, "complete": True}


JOB = PartitionsJob()
