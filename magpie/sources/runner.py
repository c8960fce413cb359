"""The source schedule and one pass of fetching due sources.

**Schedule.** Sources live on a second instance of the route schedule (:class:`magpie.queue.RouteQueue`,
the same fenced Lua scripts) under their own key prefix ``<MAGPIE_REDIS_PREFIX>sources:`` and hash tag
``{sources}``, one shard. A member is a source id; its due time is the next fetch. PostgreSQL is the
record: :func:`sync_schedule` puts every live source on the schedule (a stored one keeps its due time) and
takes removed ones off, so a lost Redis only costs one early fetch per source.

**A pass** (:func:`run_due`, the beat task ``magpie.maintenance.fetch_sources``): sync, claim up to
``MAGPIE_SOURCE_BATCH`` due sources (a lease of ``MAGPIE_SOURCE_LEASE`` seconds each), fetch them on up to
``MAGPIE_SOURCE_CONCURRENCY`` threads, and per source:

* a body: import it into the source's workspace (:func:`magpie.importer.service.import_file`, every format
  it reads, with the source's ``--format``), link the routes to the source, then complete the lease
  (fenced: next fetch ``every`` later) and record the outcome; a stale lease records nothing (the import is
  idempotent, so a second holder doing it again changes nothing);
* ``304``: complete, record ``not_modified``;
* a failure: count it; below ``MAGPIE_SOURCE_DEAD_LETTER_AFTER`` failures in a row the lease is retried on
  the exponential backoff curve (``MAGPIE_SOURCE_BACKOFF_BASE`` doubling up to ``..._CAP``), at the limit
  the source is dead-lettered: taken off the schedule (fenced removal) and flagged in PostgreSQL until
  ``magpie sources refresh ID`` (or adding it again) puts it back.
"""

from __future__ import annotations

import io
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa

from magpie.base.backoff import Backoff
from magpie.queue.keys import QueueKeys
from magpie.queue.refusals import COMPLETED, QueueError
from magpie.queue.routequeue import RouteQueue

log = logging.getLogger(__name__)

SCHEDULE_NAME = "sources"


def schedule_keys(settings) -> QueueKeys:
    """Keys of the source schedule: prefix ``<MAGPIE_REDIS_PREFIX>sources:``, hash tag ``{sources}``."""
    return QueueKeys(f"{settings.redis_prefix}sources:", 1, SCHEDULE_NAME)


def source_schedule(settings, client) -> RouteQueue:
    """The source schedule on redis-py ``client`` (the route-schedule scripts, its own keys). Its own
    interval (1 ms) makes a new source due at once; each completion passes the source's ``every``."""
    return RouteQueue(client, schedule_keys(settings), interval_ms=1,
                      lease_ms=int(settings.source_lease * 1000), max_stalled=3)


def backoff_of(settings) -> Backoff:
    """Retry curve of failing sources: exponential from ``MAGPIE_SOURCE_BACKOFF_BASE`` to ``..._CAP``."""
    base = int(settings.source_backoff_base * 1000)
    return Backoff("exponential", base, max(base, int(settings.source_backoff_cap * 1000)), 2.0, "equal")


def _payload(source_id: int) -> str:
    return json.dumps({"source": int(source_id)}, separators=(",", ":"))


def sync_schedule(engine, sched: RouteQueue) -> dict:
    """Put every live (not dead-lettered) source on the schedule and take off members with no live source.
    Returns ``{"scheduled": new ones, "unscheduled": removed ones}``."""
    with engine.connect() as conn:
        live = [i for (i,) in conn.execute(sa.text(
            "SELECT id FROM list_sources WHERE NOT dead_lettered ORDER BY id"))]
    out = {"scheduled": 0, "unscheduled": 0}
    if live:
        out["scheduled"] = sched.schedule([(str(i), _payload(i)) for i in live])["new"]
    want = {str(i) for i in live}
    for shard in sched.keys.all_shards():
        for raw in sched.r.zrange(shard, 0, -1):
            member = raw.decode() if isinstance(raw, bytes) else raw
            if member not in want:
                try:
                    sched.remove_route(member, force=True)
                    out["unscheduled"] += 1
                except QueueError:
                    pass
    return out


def _load(engine, source_id: int) -> dict | None:
    with engine.connect() as conn:
        row = conn.execute(sa.text(
            "SELECT s.id, s.url_enc, s.format, s.protocol, s.every_s, s.browser, s.ignore_robots, s.etag, "
            "s.last_modified, s.consecutive_failures, s.dead_lettered, s.last_status, w.name AS workspace "
            "FROM list_sources s JOIN workspaces w ON w.id = s.workspace_id WHERE s.id = :i"),
            {"i": int(source_id)}).mappings().first()
    return dict(row) if row else None


def fetch_source(src: dict, settings):
    """Fetch one source row (as :func:`_load` reads it): a :class:`magpie.sources.fetch.Fetched`.
    Raises :class:`magpie.sources.fetch.FetchFailed`."""
    from magpie.base.crypto import get_keyring
    from magpie.sources.fetch import FetchOptions, fetch_pages, policy_of, robots_cache

    url = get_keyring(settings.encryption_key).decrypt(src["url_enc"])
    conditional = src["last_status"] in ("ok", "not_modified")
    opts = FetchOptions.from_settings(settings, robots=not src["ignore_robots"],
                                      etag=src["etag"] if conditional else None,
                                      last_modified=src["last_modified"] if conditional else None)
    if src["browser"]:
        from magpie.sources.browser import render

        return render(url, opts, policy=policy_of(settings), robots=robots_cache(settings),
                      executable=settings.source_chromium, pages=settings.source_browser_pages)
    return fetch_pages(url, opts, policy=policy_of(settings), robots=robots_cache(settings),
                       max_pages=settings.source_max_pages)


def _link(engine, source_id: int, route_ids: list[int]) -> None:
    if not route_ids:
        return
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO list_source_routes (source_id, route_id) "
            "SELECT :s, r FROM unnest(CAST(:ids AS bigint[])) AS r ORDER BY r "
            "ON CONFLICT (source_id, route_id) DO UPDATE SET last_seen_at = now()"),
            {"s": int(source_id), "ids": sorted(set(route_ids))})


def process(lease, sched: RouteQueue, settings, engine, route_queue) -> dict:
    """Fetch and import the source of ``lease`` and end the lease (module docstring). Returns
    ``{"id", "status": ok|not_modified|error|dead_lettered|gone|lease_lost, "error"?, "imported"?}``."""
    from magpie.importer.service import import_file
    from magpie.sources.fetch import FetchFailed

    sid = int(lease.member)
    src = _load(engine, sid)
    if src is None or src["dead_lettered"]:
        try:
            sched.remove(lease)
        except QueueError:
            pass
        return {"id": sid, "status": "gone"}
    report, got, error = None, None, None
    try:
        got = fetch_source(src, settings)
        if not got.not_modified:
            stream = io.BytesIO(got.body)
            stream.name = f"<source {sid}>"
            report = import_file(stream, src["workspace"], settings, protocol=src["protocol"], fmt=src["format"],
                                 queue=route_queue, engine=engine, on_stored=lambda ids: _link(engine, sid, ids))
    except FetchFailed as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - an import or storage failure counts as a failed fetch
        first = (str(exc).strip().splitlines() or [""])[0]
        from magpie.base.redact import mask_url_passwords

        error = mask_url_passwords(f"import failed: {exc.__class__.__name__}: {first}")[:300]
    if error is None:
        code = sched.complete([lease], interval_ms=src["every_s"] * 1000)[0]
        if code != COMPLETED:
            return {"id": sid, "status": "lease_lost"}
        status = "not_modified" if got.not_modified else "ok"
        with engine.begin() as conn:
            conn.execute(sa.text(
                "UPDATE list_sources SET last_fetch_at = now(), last_ok_at = now(), last_status = :st, "
                "last_error = NULL, consecutive_failures = 0, etag = :etag, last_modified = :lm, "
                "last_bytes = COALESCE(:b, last_bytes), last_valid = COALESCE(:v, last_valid), "
                "last_imported = COALESCE(:imp, last_imported), last_invalid = COALESCE(:inv, last_invalid) "
                "WHERE id = :i"),
                {"st": status, "etag": got.etag, "lm": got.last_modified, "i": sid,
                 "b": None if report is None else len(got.body),
                 "v": None if report is None else report.valid,
                 "imp": None if report is None else report.imported,
                 "inv": None if report is None else len(report.invalid)})
        out = {"id": sid, "status": status}
        if report is not None:
            out.update(imported=report.imported, valid=report.valid, pages=got.pages)
        return out
    failures = int(src["consecutive_failures"]) + 1
    dead = failures >= settings.source_dead_letter_after
    try:
        if dead:
            sched.remove(lease)
        else:
            sched.retry(lease, backoff_of(settings).delay(failures))
    except QueueError:
        return {"id": sid, "status": "lease_lost", "error": error}
    with engine.begin() as conn:
        conn.execute(sa.text(
            "UPDATE list_sources SET last_fetch_at = now(), last_status = 'error', last_error = :e, "
            "consecutive_failures = :f, dead_lettered = :d, "
            "dead_lettered_at = CASE WHEN :d THEN now() ELSE dead_lettered_at END WHERE id = :i"),
            {"e": error[:500], "f": failures, "d": dead, "i": sid})
    log.warning("source %s fetch failed (%d in a row%s): %s", sid, failures, ", dead-lettered" if dead else "",
                error)
    return {"id": sid, "status": "dead_lettered" if dead else "error", "error": error}


def run_due(settings, engine, client, route_queue=None, *, limit: int | None = None) -> dict:
    """One pass: sync the schedule, claim up to ``limit`` (``MAGPIE_SOURCE_BATCH``) due sources and process
    them on ``MAGPIE_SOURCE_CONCURRENCY`` threads. Returns ``{"claimed", "ok", "not_modified", "error",
    "dead_lettered", "lease_lost", "gone", "imported", "results": [per source]}``."""
    from magpie.queue.provider import create_provider

    sched = source_schedule(settings, client)
    sync_schedule(engine, sched)
    route_queue = route_queue or create_provider(settings.schedule_url, settings, redis_client=client)
    leases = sched.pop(int(limit or settings.source_batch))
    out = {"claimed": len(leases), "ok": 0, "not_modified": 0, "error": 0, "dead_lettered": 0, "lease_lost": 0,
           "gone": 0, "imported": 0, "results": []}
    if not leases:
        return out
    workers = min(len(leases), settings.source_concurrency)

    def one(lease):
        try:
            return process(lease, sched, settings, engine, route_queue)
        except Exception as exc:  # noqa: BLE001 - one source's bug must not lose the others' outcomes
            log.exception("source %s: unexpected failure", lease.member)
            return {"id": int(lease.member), "status": "lease_lost", "error": exc.__class__.__name__}

    if workers == 1:
        results = [one(le) for le in leases]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="magpie-source") as pool:
            results = list(pool.map(one, leases))
    for r in results:
        out[r["status"]] += 1
        out["imported"] += r.get("imported", 0)
    out["results"] = results
    return out


def refresh_now(settings, engine, client, source_id: int, route_queue=None, wait: float | None = None) -> dict:
    """Fetch source ``source_id`` now: take it off the dead-letter list (failures reset), make it due now
    and run passes until its outcome is recorded (at most ``wait`` seconds, default the fetch timeout plus
    30 s). Returns its result as :func:`process` gives it, or ``{"id", "status": "pending"}`` when another
    process holds its lease past the wait. Raises :class:`magpie.sources.store.SourceError` for no source."""
    from magpie.sources.store import get_source

    get_source(engine, source_id)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE list_sources SET dead_lettered = false, dead_lettered_at = NULL, "
                             "consecutive_failures = CASE WHEN dead_lettered THEN 0 ELSE consecutive_failures "
                             "END WHERE id = :i"), {"i": int(source_id)})
    sched = source_schedule(settings, client)
    sync_schedule(engine, sched)
    member = str(int(source_id))
    end = time.monotonic() + (wait if wait is not None else settings.source_fetch_timeout + 30)
    while True:
        try:
            sched.enqueue_in(member, 0)
        except QueueError:
            pass  # leased: a fetch is running now; its pass records the outcome
        res = run_due(settings, engine, client, route_queue, limit=max(settings.source_batch, 1))
        mine = [r for r in res["results"] if r["id"] == int(source_id)]
        if mine:
            return mine[0]
        if time.monotonic() >= end:
            return {"id": int(source_id), "status": "pending"}
        time.sleep(0.2)


__all__ = ["backoff_of", "fetch_source", "process", "refresh_now", "run_due", "schedule_keys",
           "source_schedule", "sync_schedule"]
