"""The PostgreSQL side of ingestion: one transaction writes history, current health and the replay ledger.

:func:`apply_results` applies a batch of :class:`~magpie.stats.entry.StreamEntry`:

* ``check_history`` rows (one per result),
* ``route_health`` (counters, newest result, ``consecutive_failures``; a late, older result never
  overwrites a newer ``last_checked_at``; the newest exit address a judge saw, kept across failed checks,
  with its country and ASN when a GeoIP database is given),
* ``stats_ledger`` rows for the applied stream ids. An id already in the ledger is skipped, so a replay
  (a crash between commit and ``XACK``, or two consumers holding the same entry) applies it once.
* ``reputation_dirty`` rows for the routes written (a maintenance job recomputes their reputation).
* ``route_failures``: per (workspace, route) failure streaks (:mod:`magpie.judges.failures`).

The referenced routes are locked against deletion until commit (``FOR KEY SHARE``, once per batch) and
their hash compared, so a result never lands on a deleted route or on another route that reuses the id.
That lock is what keeps ``check_history`` consistent: it has no foreign key to ``routes`` (whose trigger
would lock the route again for every row), and a route's deletion waits for the lock and then deletes
the route's history in its own transaction (:mod:`magpie.db.deletion`). Results the database rejects are
isolated by applying one result per transaction and come back as dead letters.

Per batch, ``check_history`` rows go in with one ``COPY`` (routed to the partitions as an ``INSERT`` is; a
row no partition covers fails it with the same ``check_violation``, a data error); the other statements
take each array as one literal (:mod:`magpie.db.bulk`), which costs the client and the server less than a
list adapted and parsed element by element.

Failures come in two kinds (:func:`is_data_error`, :func:`is_infra_failure`): a *data error* is that
entry's fault (``psycopg2`` ``DataError`` / ``IntegrityError``, or a :class:`MalformedEntry` found while
applying) and dead-letters it; an *infrastructure failure* is the database's (connection lost or refused,
``OperationalError`` such as disk full, lock or statement timeout, serialization failure or deadlock;
``InternalError`` such as ``cannot execute ... in a read-only transaction``; ``InterfaceError``; a
missing table) and leaves every entry of the batch as it was, for a later attempt.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import psycopg2
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.db.bulk import (
    NULL,
    bool_array,
    copy_field,
    copy_in,
    float_array,
    int_array,
    ms_timestamp,
    text_array,
    timestamp_array,
)
from magpie.judges.failures import update_failures
from magpie.stats.entry import DeadLetter, MalformedEntry, StreamEntry

_ROUTES = "SELECT id, route_hash FROM routes WHERE id = ANY(%s::bigint[]) ORDER BY id FOR KEY SHARE"
_LEDGER = """
    INSERT INTO stats_ledger (stream_id)
    SELECT s FROM unnest(%s::text[]) AS s ORDER BY s
    ON CONFLICT (stream_id) DO NOTHING
    RETURNING stream_id
"""
_HISTORY_COLUMNS = ("route_id", "checked_at", "alive", "latency_ms", "status", "attempts", "error",
                    "anonymity", "body", "judge", "stream_id", "exit_ip")
_HEALTH_ROWS = """
    INSERT INTO route_health (route_id)
    SELECT r FROM unnest(%s::bigint[]) AS r ORDER BY r
    ON CONFLICT (route_id) DO NOTHING
"""
_HEALTH_LOCK = """
    SELECT route_id, last_checked_at, consecutive_failures, last_alive_at
    FROM route_health WHERE route_id = ANY(%s::bigint[]) ORDER BY route_id FOR UPDATE
"""
_HEALTH_UPDATE = """
    UPDATE route_health AS h SET
        checks_total = h.checks_total + u.n,
        alive_total = h.alive_total + u.n_alive,
        consecutive_failures = u.cf,
        last_alive_at = u.last_alive_at,
        last_checked_at = CASE WHEN u.newer THEN u.checked_at ELSE h.last_checked_at END,
        alive = CASE WHEN u.newer THEN u.alive ELSE h.alive END,
        latency_ms = CASE WHEN u.newer THEN u.latency_ms ELSE h.latency_ms END,
        status = CASE WHEN u.newer THEN u.status ELSE h.status END,
        anonymity = CASE WHEN u.newer THEN u.anonymity ELSE h.anonymity END,
        error = CASE WHEN u.newer THEN u.error ELSE h.error END,
        attempts = CASE WHEN u.newer THEN u.attempts ELSE h.attempts END,
        exit_ip = CASE WHEN u.newer AND u.exit_ip IS NOT NULL THEN u.exit_ip ELSE h.exit_ip END,
        exit_country = CASE WHEN NOT (u.newer AND u.exit_ip IS NOT NULL) THEN h.exit_country
                            WHEN u.exit_rev IS NOT NULL THEN u.exit_country
                            WHEN h.exit_ip IS DISTINCT FROM u.exit_ip THEN NULL ELSE h.exit_country END,
        exit_asn = CASE WHEN NOT (u.newer AND u.exit_ip IS NOT NULL) THEN h.exit_asn
                        WHEN u.exit_rev IS NOT NULL THEN u.exit_asn
                        WHEN h.exit_ip IS DISTINCT FROM u.exit_ip THEN NULL ELSE h.exit_asn END,
        exit_geo_revision = CASE WHEN NOT (u.newer AND u.exit_ip IS NOT NULL) THEN h.exit_geo_revision
                                 WHEN u.exit_rev IS NOT NULL THEN u.exit_rev
                                 WHEN h.exit_ip IS DISTINCT FROM u.exit_ip THEN NULL
                                 ELSE h.exit_geo_revision END,
        updated_at = now()
    FROM unnest(%s::bigint[], %s::integer[], %s::integer[], %s::integer[], %s::timestamptz[],
                %s::boolean[], %s::timestamptz[], %s::boolean[], %s::real[], %s::integer[], %s::text[],
                %s::text[], %s::smallint[], %s::text[], %s::text[], %s::bigint[], %s::text[])
         AS u(route_id, n, n_alive, cf, last_alive_at, newer, checked_at, alive, latency_ms, status,
              anonymity, error, attempts, exit_ip, exit_country, exit_asn, exit_rev)
    WHERE h.route_id = u.route_id
"""

_MARK_DIRTY = """
    INSERT INTO reputation_dirty (route_id)
    SELECT r FROM unnest(%s::bigint[]) AS r ORDER BY r
    ON CONFLICT (route_id) DO NOTHING
"""


_APPLIED = "SELECT stream_id FROM stats_ledger WHERE stream_id = ANY(%s::text[])"


def ping_error(engine: Engine) -> str | None:
    """``None`` when PostgreSQL answers ``SELECT 1`` (one round trip), else the failure as one line;
    never raises for an outage. Answering is not accepting writes (see :func:`is_infra_failure`)."""
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        return None
    except (sa.exc.DBAPIError, sa.exc.TimeoutError, OSError) as exc:
        return describe_failure(exc)


_WRITE_PROBE = "UPDATE stats_ledger SET committed_at = committed_at WHERE stream_id IS NULL"


def write_probe_error(engine: Engine) -> str | None:
    """``None`` when PostgreSQL accepts a write statement on the ingestion's tables, else the failure as
    one line. The statement matches no row (the ledger's key is never NULL), so it changes nothing, but
    a read-only database, a lock held against the ledger (past ``lock_timeout``) or an unreachable server
    fails it. Never raises for an outage."""
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(_WRITE_PROBE)
        return None
    except (sa.exc.DBAPIError, sa.exc.TimeoutError, OSError) as exc:
        return describe_failure(exc)


def database_answers(engine: Engine) -> bool:
    """True when PostgreSQL answers ``SELECT 1`` (one round trip); never raises for an outage."""
    return ping_error(engine) is None


def is_data_error(exc: BaseException) -> bool:
    """True when the failure is the entry's own: the database rejected its data (``DataError``,
    ``IntegrityError`` on a live connection) or it proved malformed while being applied."""
    if isinstance(exc, MalformedEntry):
        return True
    return (
        isinstance(exc, sa.exc.DBAPIError)
        and not exc.connection_invalidated
        and isinstance(exc.orig, (psycopg2.DataError, psycopg2.IntegrityError))
    )


def is_infra_failure(exc: BaseException) -> bool:
    """True when the database, not the entry, failed: any other DBAPI error (connection, read-only,
    disk full, lock or statement timeout, serialization failure, deadlock, interface, missing schema),
    a pool timeout or a socket error. Such a failure must not count toward an entry's delivery limit."""
    if is_data_error(exc):
        return False
    return isinstance(exc, (sa.exc.DBAPIError, sa.exc.TimeoutError, sa.exc.DisconnectionError, OSError))


def describe_failure(exc: BaseException) -> str:
    """One line naming a database failure: the class, the SQLSTATE when known, the driver's first line."""
    orig = getattr(exc, "orig", None) or exc
    code = getattr(orig, "pgcode", None)
    first = (str(orig).strip().splitlines() or [""])[0]
    return f"{orig.__class__.__name__}{f' [{code}]' if code else ''}: {first}"[:300]


def applied_ids(engine: Engine, ledger_ids: Sequence[str]) -> set[str]:
    """Which of ``ledger_ids`` the replay ledger holds (already applied). One query.

    Raises ``sqlalchemy.exc.DBAPIError`` on a database failure."""
    if not ledger_ids:
        return set()
    with engine.connect() as conn:
        return set(conn.exec_driver_sql(_APPLIED, (text_array(sorted(set(ledger_ids))),)).scalars())


def apply_results(engine: Engine, entries: list[StreamEntry], geo=None) -> tuple[int, int, list[DeadLetter]]:
    """Apply ``entries`` in one transaction; if the database rejects the data, isolate the culprits by
    applying one entry per transaction.

    ``geo``: a configured :class:`magpie.enrich.geo.GeoDatabases` enriching each route's newest exit
    address as it is written (cached lookups); None (or a file that cannot be read) leaves the exit's
    country and ASN to the ``geo_enrichment`` job.

    Returns:
        ``(committed, replayed, dead)``: entries written, entries skipped as already in the ledger (or
        given twice under one :attr:`~StreamEntry.ledger_id`), and dead letters (route gone, hash
        mismatch, rejected by the database).
    Raises:
        sqlalchemy.exc.DBAPIError (or ``OSError``): an infrastructure failure (:func:`is_infra_failure`);
            nothing of the failed transaction is kept (single entries committed while isolating a data
            error stay committed, and are replays next time).
    """
    try:
        with engine.begin() as conn:
            return _apply_tx(conn, entries, geo)
    except (sa.exc.DBAPIError, MalformedEntry) as exc:
        if not is_data_error(exc):
            raise
    committed = replayed = 0
    dead: list[DeadLetter] = []
    for e in entries:
        try:
            with engine.begin() as conn:
                c, rp, d = _apply_tx(conn, [e], geo)
        except (sa.exc.DBAPIError, MalformedEntry) as exc:
            if not is_data_error(exc):
                raise
            if isinstance(exc, MalformedEntry):
                dead.append(DeadLetter(e.stream_id, f"malformed: {exc}", e.fields))
                continue
            msg = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            dead.append(DeadLetter(e.stream_id, f"rejected by database: {msg}", e.fields))
            continue
        committed += c
        replayed += rp
        dead.extend(d)
    return committed, replayed, dead


def _apply_tx(conn: sa.Connection, entries: Sequence[StreamEntry], geo=None) -> tuple[int, int, list[DeadLetter]]:
    # Lock the referenced routes against deletion until commit (check_history has no foreign key: this
    # lock is its integrity, see magpie.db.deletion), and check the hash so a result never lands on a
    # different route that reuses an id (e.g. after a database rebuild).
    locked = conn.exec_driver_sql(_ROUTES, (int_array(sorted({e.route_id for e in entries})),))
    known: dict[int, str] = {rid: route_hash for rid, route_hash in locked}
    good: list[StreamEntry] = []
    dead: list[DeadLetter] = []
    for e in entries:
        stored = known.get(e.route_id)
        if stored is None:
            dead.append(DeadLetter(e.stream_id, f"route {e.route_id} no longer exists", e.fields))
        elif e.route_hash is not None and e.route_hash != stored:
            reason = f"route {e.route_id} hash mismatch ({e.route_hash} != {stored})"
            dead.append(DeadLetter(e.stream_id, reason, e.fields))
        else:
            good.append(e)
    if not good:
        return 0, 0, dead

    fresh = set(conn.exec_driver_sql(_LEDGER, (text_array(sorted({e.ledger_id for e in good})),)).scalars())
    todo: list[StreamEntry] = []
    for e in good:  # one entry per ledger id, even when a redriven copy shares the batch
        if e.ledger_id in fresh:
            fresh.discard(e.ledger_id)
            todo.append(e)
    replayed = len(good) - len(todo)
    if not todo:
        return 0, replayed, dead

    copy_in(conn, "check_history", _HISTORY_COLUMNS, _history_rows(todo))
    _update_health(conn, todo, geo)
    update_failures(conn, todo)  # per (workspace, route) failure streaks (magpie.judges.failures)
    return len(todo), replayed, dead


def _history_rows(entries: Sequence[StreamEntry]) -> str:
    """``check_history`` rows of ``entries`` (columns :data:`_HISTORY_COLUMNS`) in ``COPY`` text format."""
    rows = []
    for e in entries:
        r = e.result
        alive, lat, status, attempts = r.alive, r.latency_ms, r.status, r.attempts
        rows.append(
            f"{e.route_id}\t{ms_timestamp(r.checked_at_ms)}\t"
            f"{NULL if alive is None else 't' if alive else 'f'}\t"
            f"{NULL if lat is None else repr(float(lat))}\t"
            f"{NULL if status is None else int(status)}\t"
            f"{NULL if attempts is None else int(attempts)}\t"
            f"{copy_field(r.error)}\t{copy_field(r.anonymity)}\t{copy_field(r.body)}\t"
            f"{copy_field(r.judge)}\t{copy_field(e.ledger_id)}\t{copy_field(r.exit_ip)}\n"
        )
    return "".join(rows)


def _exit_geo(geo, ip: str | None) -> tuple[str | None, int | None, str | None]:
    """``(country, asn, revision)`` of an exit address; all None when it cannot be enriched now."""
    if geo is None or ip is None:
        return None, None, None
    from magpie.enrich.geo import GeoError

    try:
        info = geo.lookup(ip)
    except GeoError:
        return None, None, None
    if info is None or geo.revision is None:
        return None, None, None
    return info.country, info.asn, geo.revision


def _update_health(conn: sa.Connection, entries: list[StreamEntry], geo=None) -> None:
    by_route: dict[int, list[StreamEntry]] = defaultdict(list)
    for e in entries:
        by_route[e.route_id].append(e)
    route_ids = sorted(by_route)
    ids = int_array(route_ids)  # one literal for the three statements on these routes
    conn.exec_driver_sql(_HEALTH_ROWS, (ids,))
    locked = conn.exec_driver_sql(_HEALTH_LOCK, (ids,))  # rows taken one at a time, no list of them kept
    state = {rid: (last, cf, last_alive) for rid, last, cf, last_alive in locked}
    cols: tuple[list, ...] = tuple([] for _ in _HEALTH_ARRAYS)  # in _HEALTH_UPDATE's column order
    for rid in route_ids:
        es = by_route[rid]
        if len(es) > 1:
            es.sort(key=lambda e: e.order)
        last, cf, last_alive = state[rid]
        n_alive = n_newer = 0
        newest_alive = exit_ip = None
        top = es[-1]
        for e in es:
            r = e.result
            if r.alive:
                n_alive += 1
                newest_alive = e
            # Only results newer than the stored newest one extend (or reset) the failure streak and
            # replace the "current" fields; older, late results only count in the totals.
            if last is None or e.checked_at > last:
                n_newer += 1
                top = e
                cf = 0 if r.alive else cf + 1
                if r.exit_ip:  # the exit address: of the newest newer result that saw one
                    exit_ip = r.exit_ip
        if newest_alive is not None and (last_alive is None or newest_alive.checked_at > last_alive):
            last_alive = newest_alive.result.checked_at_ms  # Unix ms (timestamp_array takes both)
        r = top.result
        row = (
            rid,
            len(es),
            n_alive,
            cf,
            last_alive,
            n_newer > 0,
            r.checked_at_ms,
            r.alive,
            r.latency_ms,
            r.status,
            r.anonymity,
            r.error,
            r.attempts,
            exit_ip,
            *_exit_geo(geo, exit_ip),
        )
        for col, v in zip(cols, row):
            col.append(v)
    conn.exec_driver_sql(_HEALTH_UPDATE, tuple(f(col) for f, col in zip(_HEALTH_ARRAYS, cols)))
    conn.exec_driver_sql(_MARK_DIRTY, (ids,))  # reputation recomputes them (magpie.derived)


# literal builders of _HEALTH_UPDATE's arrays, in its order
_HEALTH_ARRAYS = (
    int_array, int_array, int_array, int_array, timestamp_array, bool_array, timestamp_array, bool_array,
    float_array, int_array, text_array, text_array, int_array, text_array, text_array, int_array, text_array,
)


__all__ = [
    "applied_ids",
    "apply_results",
    "database_answers",
    "describe_failure",
    "is_data_error",
    "is_infra_failure",
    "ping_error",
    "write_probe_error",
]
