"""Run maintenance jobs under their leader locks and record every pass in ``maintenance_runs``.

One pass of a job: take the job's leader lock (``<prefix>leader:<job>``; a pass that does not get it
does nothing and reports ``skipped``), record the start (``runs_total + 1``), run the job with its limits,
then record success (``last_success_at``, ``last_result``) or failure (``failures_total + 1``,
``last_error``). The lock is renewed in the background; losing it sets the job's cancellation event and
the job stops at its next batch boundary.

One leader at a time: every run record (start, success, failure) and the job's fenced writes carry the
lock's generation (:mod:`magpie.coordination.fencing`); a pass whose generation is older than one already recorded
(a newer leader ran meanwhile) is refused and reports ``skipped`` with reason ``fenced``. Beat-triggered
passes (``once_per_slot``) run once per cadence slot, ``floor(redis time / cadence)``: the first pass
to hold the lock records the slot with ``SET NX`` (key ``<prefix>leader:<lock>:slot:<n>``), and a second
beat's trigger for the same slot is skipped, however the two beats' phases fall.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from datetime import UTC, datetime

import redis as redis_lib
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.base import redisconn
from magpie.errors import MagpieError
from magpie.coordination.fencing import StaleLeader, fence
from magpie.coordination.leader import LeaderLock, locks_held
from magpie.maintenance.base import Job, JobContext

log = logging.getLogger(__name__)

_START = """
    INSERT INTO maintenance_runs (job, last_started_at, runs_total, updated_at)
    VALUES (:job, now(), 1, now())
    ON CONFLICT (job) DO UPDATE SET last_started_at = now(), runs_total = maintenance_runs.runs_total + 1,
                                    updated_at = now()
    RETURNING state
"""
_SUCCESS = """
    UPDATE maintenance_runs SET last_finished_at = now(), last_success_at = now(), last_duration_s = :d,
                                last_result = CAST(:r AS jsonb), updated_at = now()
    WHERE job = :job
"""
_FAILURE = """
    UPDATE maintenance_runs SET last_finished_at = now(), last_error = :e, last_error_at = now(),
                                failures_total = failures_total + 1, last_duration_s = :d, updated_at = now()
    WHERE job = :job
"""


_SKIP_REASONS = {
    "held": "another process holds the leader lock",
    "restarting": "Redis started moments ago: waiting for a former leader to notice",
}


def cadence_of(settings, job: Job) -> float:
    """The job's effective cadence in seconds (``MAGPIE_MAINTENANCE_CADENCES`` over :attr:`Job.every`)."""
    from magpie.config import parse_cadences

    return float(parse_cadences(settings.maintenance_cadences).get(job.name, job.every))


def slot_key(prefix: str, lock: str, slot: int) -> str:
    """Redis key recording that cadence slot ``slot`` of the lock ``lock`` ran."""
    from magpie.coordination.leader import slot_key as key

    return key(prefix, lock, slot)


def claim_slot(redis: redis_lib.Redis, prefix: str, job: Job, cadence: float,
               generation: int | None) -> bool:
    """Record that this pass runs ``job``'s current cadence slot (``SET NX``, Redis clock); False when a
    pass already ran it (:func:`magpie.coordination.leader.claim_cadence_slot`). Raises ``redis.RedisError`` when
    Redis is unreachable."""
    from magpie.coordination.leader import claim_cadence_slot

    return claim_cadence_slot(redis, prefix, job.lock, cadence, generation) is not None


def run_job(
    job: Job,
    settings,
    *,
    engine: Engine | None = None,
    redis: redis_lib.Redis | None = None,
    now: datetime | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    max_seconds: float | None = None,
    once_per_slot: bool = False,
) -> dict:
    """Run one pass of ``job`` now, under its leader lock.

    Args:
        job: the :class:`Job` (by name: :func:`magpie.wiring.jobs.run_job`).
        settings: :class:`magpie.config.Settings`.
        engine / redis: default: the process-wide engine on ``MAGPIE_DATABASE_URL`` / a client on
            ``MAGPIE_REDIS_URL``.
        now: reference time for cutoffs (aware datetime; default: now, UTC).
        batch_size / max_batches / max_seconds: override ``MAGPIE_MAINTENANCE_BATCH_SIZE`` /
            ``MAGPIE_MAINTENANCE_MAX_BATCHES`` / ``MAGPIE_MAINTENANCE_MAX_RUN_SECONDS`` for this pass.
        once_per_slot: run only if no pass ran the job's current cadence slot yet (beat triggers; a
            job with cadence 0 is not slotted). Operator runs leave it False.
    Returns:
        ``{"job": name, "status": "ok" | "skipped" | "error", "result": dict | None, "error": str | None,
        "seconds": float, "reason": str | None, "generation": int | None}``. ``skipped`` (with
        ``reason``): another process holds the lock, Redis started moments ago, the slot already ran,
        or the pass was fenced by a newer leader; nothing more is recorded. ``error``: the pass raised
        (recorded as a failure and logged; not re-raised).
    """
    j = job
    if engine is None:
        from magpie.db.session import get_engine

        engine = get_engine(settings.database_url)
    if redis is None:
        redis = redisconn.connect(settings.redis_url)
    out = {"job": j.name, "status": "skipped", "result": None, "error": None, "seconds": 0.0, "reason": None,
           "generation": None}
    t0 = time.monotonic()
    lock = LeaderLock(redis, settings.redis_prefix, j.lock, int(settings.maintenance_lock_ttl * 1000))
    try:
        redis.ping()
    except redis_lib.RedisError as exc:  # not contention: no lock can be taken at all
        out.update(status="error", error=f"Redis unreachable: {exc}", seconds=round(time.monotonic() - t0, 3))
        return out
    with lock.hold() as lost:
        if lost is None:
            out["reason"] = _SKIP_REASONS.get(lock.refusal or "held")
            return out
        gen, fence_name = lock.generation, lock.fence_name
        out["generation"] = gen
        cadence = cadence_of(settings, j)
        if once_per_slot and cadence > 0 and not claim_slot(redis, settings.redis_prefix, j, cadence, gen):
            out["reason"] = "this cadence slot already ran"
            return out
        try:
            with engine.begin() as conn:
                fence(conn, fence_name, gen)
                state = conn.execute(sa.text(_START), {"job": j.name}).scalar_one() or {}
        except StaleLeader as exc:
            out.update(reason=str(exc), seconds=round(time.monotonic() - t0, 3))
            return out
        except Exception as exc:  # noqa: BLE001 - database down: nothing to record it in
            log.error("maintenance %s: cannot record the start of a pass: %s", j.name, exc)
            out.update(
                status="error",
                error=f"{exc.__class__.__name__}: {exc}",
                seconds=round(time.monotonic() - t0, 3),
            )
            return out
        ctx = JobContext(
            job=j.name,
            settings=settings,
            engine=engine,
            redis=redis,
            now=now or datetime.now(UTC),
            cancel=lost,
            deadline=t0 + (max_seconds if max_seconds is not None else settings.maintenance_max_run_seconds),
            batch_size=int(batch_size or settings.maintenance_batch_size),
            max_batches=int(max_batches or settings.maintenance_max_batches),
            state=dict(state),
            generation=gen,
            fence_name=fence_name,
        )
        try:
            result = j.run(ctx)
        except StaleLeader as exc:  # a newer leader runs the job now: record nothing over its records
            log.warning("maintenance %s: %s", j.name, exc)
            out.update(reason=str(exc), seconds=round(time.monotonic() - t0, 3))
            return out
        except Exception as exc:  # noqa: BLE001 - recorded, then reported
            msg = f"{exc.__class__.__name__}: {exc}"[:2000]
            if isinstance(exc, MagpieError):  # a failure the job reports in words: one line, no traceback
                log.error("maintenance %s failed: %s", j.name, msg)
            else:
                log.exception("maintenance %s failed", j.name)
            dt = time.monotonic() - t0
            try:
                with engine.begin() as conn:
                    fence(conn, fence_name, gen)
                    conn.execute(sa.text(_FAILURE), {"job": j.name, "e": msg, "d": dt})
            except Exception as rec_exc:  # noqa: BLE001
                log.error("maintenance %s: cannot record the failure: %s", j.name, rec_exc)
            out.update(status="error", error=msg, seconds=round(dt, 3))
            return out
        dt = time.monotonic() - t0
        result = dict(result or {})
        if "complete" not in result:
            result["complete"] = True
        if ctx.stop_reason() == "cancelled":
            result["complete"] = False
            result["stopped"] = "leader lock lost"
        try:
            with engine.begin() as conn:
                fence(conn, fence_name, gen)
                conn.execute(sa.text(_SUCCESS),
                             {"job": j.name, "d": dt, "r": json.dumps(result, default=str)})
        except StaleLeader as exc:
            log.warning("maintenance %s: %s", j.name, exc)
            out.update(reason=str(exc), seconds=round(dt, 3))
            return out
        out.update(status="ok", result=result, seconds=round(dt, 3))
        return out


def run_all(settings, jobs: Iterable[Job], **kw) -> list[dict]:
    """One pass of every job of ``jobs``, in their order (see :func:`run_job`; same keywords)."""
    return [run_job(j, settings, **kw) for j in jobs]


def read_job_status(engine: Engine) -> list[dict]:
    """Every row of ``maintenance_runs``, ordered by job.

    Returns:
        dicts with ``job``, ``last_started_at``, ``last_finished_at``, ``last_success_at``,
        ``last_error_at`` (aware datetimes or None), ``last_error`` (str | None), ``last_duration_s``
        (float seconds | None), ``last_result`` (dict | None), ``state`` (dict), ``runs_total``,
        ``failures_total`` (int).
    Raises:
        sqlalchemy.exc.DBAPIError: database unavailable (or the table missing: schema not migrated).
    """
    with engine.connect() as conn:
        rows = (
            conn.execute(
                sa.text(
                    "SELECT job, last_started_at, last_finished_at, last_success_at, last_error_at, "
                    "last_error, last_duration_s, last_result, state, runs_total, failures_total "
                    "FROM maintenance_runs ORDER BY job"
                )
            )
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


def job_status(settings, jobs: Iterable[Job], *, engine: Engine | None = None,
               redis: redis_lib.Redis | None = None) -> list[dict]:
    """Status of every job of ``jobs`` for operators (``magpie maintenance status``).

    Returns:
        One dict per job in the order of ``jobs``: ``job``, ``description``, ``every_s`` (effective cadence,
        seconds; 0 = not scheduled), ``leader_active`` (bool | None when Redis is unreachable), plus the
        :func:`read_job_status` fields (None / 0 for a job that never ran).
    Raises:
        sqlalchemy.exc.DBAPIError: database unavailable.
    """
    from magpie.config import parse_cadences

    jobs = list(jobs)
    if engine is None:
        from magpie.db.session import get_engine

        engine = get_engine(settings.database_url)
    if redis is None:
        redis = redisconn.connect(settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    rows = {r["job"]: r for r in read_job_status(engine)}
    cadences = parse_cadences(settings.maintenance_cadences)
    try:
        held: list = locks_held(redis, settings.redis_prefix, [j.lock for j in jobs])
    except redis_lib.RedisError:
        held = [None] * len(jobs)
    out = []
    empty = {
        "last_started_at": None,
        "last_finished_at": None,
        "last_success_at": None,
        "last_error_at": None,
        "last_error": None,
        "last_duration_s": None,
        "last_result": None,
        "state": {},
        "runs_total": 0,
        "failures_total": 0,
    }
    for j, h in zip(jobs, held):
        d = {
            "job": j.name,
            "description": j.description,
            "every_s": cadences.get(j.name, j.every),
            "leader_active": h,
        }
        d.update({k: v for k, v in rows.get(j.name, empty).items() if k != "job"})
        out.append(d)
    return out


__all__ = ["job_status", "read_job_status", "run_all", "run_job"]
