"""Import storage and reads over the PostgreSQL schema (:mod:`magpie.db.models`).

Bulk paths send driver-level SQL (``exec_driver_sql``, psycopg2 adapts Python lists to arrays) of the
form ``INSERT … SELECT FROM unnest(array, …)`` in chunks: one statement per chunk per table instead of
one per row. Every write is idempotent (``ON CONFLICT DO
NOTHING``), so a repeated or concurrent import of the same routes never duplicates or damages rows.

Routes come back as :class:`RouteRecord` (id, hash, route, workspaces); turning one into a Redis schedule
entry is the caller's business (:func:`magpie.queue.payload.schedule_item`), so this storage layer
knows nothing of the schedule.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.base.crypto import Keyring
from magpie.base.routes import Route

IMPORT_CHUNK = 5000
"""Routes per statement/transaction in :func:`upsert_routes`."""


@dataclass(slots=True)
class RouteRecord:
    """One stored route and the workspaces it belongs to.

    Attributes:
        route_id: ``routes.id``.
        route_hash: keyed route hash (24 hex chars).
        route: the route with plaintext credentials.
        workspace_ids: sorted ids of *all* workspaces the route belongs to.
    """

    route_id: int
    route_hash: str
    route: Route
    workspace_ids: list[int]


@dataclass(slots=True)
class StoredRoute(RouteRecord):
    """One imported route as stored: a :class:`RouteRecord` (``workspace_ids`` as after the import) and
    ``new_member``, ``True`` if this import added the route to the importing workspace."""

    new_member: bool


@dataclass(slots=True)
class ImportStore:
    """Result of :func:`upsert_routes`.

    Attributes:
        workspace_id / workspace: the importing workspace.
        routes: one :class:`StoredRoute` per input route, in input order.
        new_members: the routes this import added to the workspace (subset of ``routes``).
        already_members: the routes the workspace already had.
        inserted: how many rows this call inserted into ``routes`` (routes new to the database).
    """

    workspace_id: int
    workspace: str
    routes: list[StoredRoute] = field(default_factory=list)
    new_members: list[StoredRoute] = field(default_factory=list)
    already_members: list[StoredRoute] = field(default_factory=list)
    inserted: int = 0


_INSERT_WORKSPACE = "INSERT INTO workspaces (name) VALUES (%s) ON CONFLICT (name) DO NOTHING RETURNING id"
_SELECT_WORKSPACE = "SELECT id FROM workspaces WHERE name = %s"
_SELECT_ROUTES_BY_HASH = "SELECT route_hash, id FROM routes WHERE route_hash = ANY(%s::char(24)[])"
_INSERT_ROUTES = """
    INSERT INTO routes (route_hash, protocol, host, port, username_enc, password_enc)
    SELECT * FROM unnest(%s::char(24)[], %s::text[], %s::text[], %s::int[], %s::text[], %s::text[])
    ON CONFLICT (route_hash) DO NOTHING
    RETURNING route_hash, id
"""
_INSERT_MEMBERS = """
    INSERT INTO route_workspaces (route_id, workspace_id)
    SELECT r, %s FROM unnest(%s::bigint[]) AS r
    ON CONFLICT (route_id, workspace_id) DO NOTHING
    RETURNING route_id
"""
_SELECT_MEMBERSHIP = """
    SELECT route_id, array_agg(workspace_id ORDER BY workspace_id)
    FROM route_workspaces WHERE route_id = ANY(%s::bigint[]) GROUP BY route_id
"""


def ensure_workspace(engine: Engine, name: str) -> int:
    """Return the id of workspace ``name``, creating it if missing (safe under concurrency)."""
    with engine.begin() as conn:
        row = conn.exec_driver_sql(_INSERT_WORKSPACE, (name,)).first()
        if row is None:
            row = conn.exec_driver_sql(_SELECT_WORKSPACE, (name,)).first()
        return int(row[0])


def upsert_routes(
    engine: Engine,
    keyring: Keyring,
    workspace: str,
    routes: Sequence[Route],
    *,
    chunk: int = IMPORT_CHUNK,
) -> ImportStore:
    """Store parsed routes and add them to ``workspace`` (created if missing).

    Per chunk of ``chunk`` routes, in one transaction: look up existing routes by keyed hash, encrypt the
    credentials of the missing ones only and insert them (``ON CONFLICT (route_hash) DO NOTHING``; a
    route inserted concurrently by another importer is read back), insert membership rows
    (``ON CONFLICT DO NOTHING RETURNING`` tells new members from existing ones), then read every route's
    full workspace list. Rows are written in hash / id order so that concurrent importers lock in the
    same order and cannot deadlock.

    Args:
        engine: SQLAlchemy engine on the magpie database (psycopg2 driver).
        keyring: gives ``route_hash`` and encrypts credentials at rest.
        workspace: workspace name.
        routes: unique, already parsed routes (a duplicate is harmless: it maps to the same row).
        chunk: routes per statement and transaction.
    Returns:
        :class:`ImportStore`; ``routes`` follows the input order.
    Raises:
        sqlalchemy.exc.DBAPIError (or psycopg2 errors): database failures. Chunks committed before the
        failure stay committed; re-running the import completes it (every step is idempotent).
    """
    workspace_id = ensure_workspace(engine, workspace)
    result = ImportStore(workspace_id=workspace_id, workspace=workspace)
    if not routes:
        return result
    hashes = [keyring.route_hash(r) for r in routes]
    # Process in hash order (consistent lock order between concurrent importers), report in input order.
    order = sorted(range(len(routes)), key=hashes.__getitem__)
    stored: list[StoredRoute | None] = [None] * len(routes)
    for start in range(0, len(order), chunk):
        idx = order[start : start + chunk]
        with engine.begin() as conn:
            ids, inserted = _store_chunk(conn, keyring, [routes[i] for i in idx], [hashes[i] for i in idx])
            result.inserted += inserted
            uniq_ids = sorted(set(ids.values()))
            new_ids = set(conn.exec_driver_sql(_INSERT_MEMBERS, (workspace_id, uniq_ids)).scalars())
            membership = {rid: list(ws) for rid, ws in conn.exec_driver_sql(_SELECT_MEMBERSHIP, (uniq_ids,))}
        for i in idx:
            rid = ids[hashes[i]]
            stored[i] = StoredRoute(
                rid, hashes[i], routes[i], membership.get(rid, [workspace_id]), rid in new_ids
            )
    seen: set[int] = set()
    for s in stored:
        assert s is not None
        result.routes.append(s)
        if s.route_id in seen:  # duplicate input route: reported in ``routes`` only
            continue
        seen.add(s.route_id)
        (result.new_members if s.new_member else result.already_members).append(s)
    return result


def _store_chunk(
    conn: sa.Connection, keyring: Keyring, routes: list[Route], hashes: list[str]
) -> tuple[dict[str, int], int]:
    """Insert the missing routes of one chunk; returns ({route_hash: route_id}, rows inserted)."""
    ids: dict[str, int] = dict(conn.exec_driver_sql(_SELECT_ROUTES_BY_HASH, (hashes,)).all())
    missing: dict[str, Route] = {}
    for h, r in zip(hashes, routes):
        if h not in ids and h not in missing:
            missing[h] = r
    inserted = 0
    if missing:
        enc = keyring.encrypt
        cols: tuple[list, ...] = ([], [], [], [], [], [])
        for h, r in missing.items():
            cols[0].append(h)
            cols[1].append(r.protocol)
            cols[2].append(r.host)
            cols[3].append(r.port)
            cols[4].append(enc(r.username) if r.username is not None else None)
            cols[5].append(enc(r.password) if r.password is not None else None)
        rows = conn.exec_driver_sql(_INSERT_ROUTES, cols).all()
        inserted = len(rows)
        ids.update(rows)
        if len(ids) < len(set(hashes)):
            # Lost an insert race: the other importer committed (ON CONFLICT waited for it), so a new
            # statement sees its rows.
            lost = [h for h in missing if h not in ids]
            ids.update(conn.exec_driver_sql(_SELECT_ROUTES_BY_HASH, (lost,)).all())
    return ids, inserted


def _decrypt(keyring: Keyring | None, token: str | None) -> str | None:
    if token is None or keyring is None:
        return None
    return keyring.decrypt(token)


_HEALTH_COLUMNS = (
    "alive",
    "latency_ms",
    "status",
    "anonymity",
    "error",
    "last_checked_at",
    "checks_total",
    "alive_total",
    "exit_ip",
    "exit_country",
)


def latest_health(engine: Engine, workspace: str | None = None, keyring: Keyring | None = None, *,
                  limit: int | None = None, after: int | None = None) -> list[dict]:
    """Current health of every route (of one workspace when ``workspace`` is given), or one page of it.

    Args:
        engine: engine on the magpie database.
        workspace: workspace name; ``None`` for all routes. An unknown name gives an empty list.
        keyring: when given, ``username`` is decrypted; otherwise it is ``None``. Passwords are never
            returned.
        limit: at most this many routes (keyset paging in route id order, an index range scan however
            many routes are stored); None: every route.
        after: with ``limit``, only routes whose ``route_id`` is greater (the last id of the previous page).
    Returns:
        One dict per route, ordered by protocol, host, port (by ``route_id`` when paged), with keys ``route_id`` (int), ``route_hash``
        (str), ``protocol``, ``host``, ``port``, ``username`` (str | None), ``alive`` (bool | None; None
        for a route never checked), ``latency_ms`` (float ms | None), ``status`` (int | None),
        ``anonymity``, ``error`` (str | None), ``last_checked_at`` (aware datetime | None),
        ``checks_total``, ``alive_total`` (int; 0 when never checked), ``exit_ip`` and ``exit_country``
        (where the judge saw the route exit, None until a judge reported it).
    Raises:
        magpie.base.crypto.CredentialError: ``keyring`` cannot decrypt a stored username.
    """
    sql = """
        SELECT r.id, r.route_hash, r.protocol, r.host, r.port, r.username_enc,
               h.alive, h.latency_ms, h.status, h.anonymity, h.error, h.last_checked_at,
               COALESCE(h.checks_total, 0), COALESCE(h.alive_total, 0), h.exit_ip, h.exit_country
        FROM routes r
        LEFT JOIN route_health h ON h.route_id = r.id
    """
    params: dict = {}
    if limit is not None and workspace is not None:  # a range of the membership's primary key, in id order
        sql += """
        JOIN route_workspaces rw ON rw.route_id = r.id
        WHERE rw.workspace_id = (SELECT id FROM workspaces WHERE name = :ws) AND rw.route_id > :after
        ORDER BY rw.route_id LIMIT :limit
        """
        params.update(ws=workspace, after=int(after or 0), limit=int(limit))
    elif limit is not None:
        sql += " WHERE r.id > :after ORDER BY r.id LIMIT :limit"
        params.update(after=int(after or 0), limit=int(limit))
    else:
        if workspace is not None:
            sql += """
            WHERE EXISTS (SELECT 1 FROM route_workspaces rw JOIN workspaces w ON w.id = rw.workspace_id
                          WHERE rw.route_id = r.id AND w.name = :ws)
            """
            params["ws"] = workspace
        sql += " ORDER BY r.protocol, r.host, r.port, r.id"
    out: list[dict] = []
    with engine.connect() as conn:
        for row in conn.execute(sa.text(sql), params):
            d = {
                "route_id": row[0],
                "route_hash": row[1],
                "protocol": row[2],
                "host": row[3],
                "port": row[4],
                "username": _decrypt(keyring, row[5]),
            }
            d.update(zip(_HEALTH_COLUMNS, row[6:]))
            out.append(d)
    return out


def profile_cadences(engine: Engine) -> dict[int, dict]:
    """Every check profile that sets a cadence (migration 0016), in the schedule's form:
    ``{workspace id: {"interval_ms", "dead_after", "dead_factor"}}`` (0 where unset), as
    :func:`magpie.queue.cadence.restore_profile_cadences` takes it. Raises ``DBAPIError``."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT workspace_id, check_interval, dead_after, dead_factor FROM check_profiles "
            "WHERE check_interval IS NOT NULL OR dead_after IS NOT NULL")).all()
    return {int(w): {"interval_ms": int(round(float(iv) * 1000)) if iv else 0, "dead_after": int(a or 0),
                     "dead_factor": int(f or 0) if a else 0} for w, iv, a, f in rows}


def all_route_records(
    engine: Engine, keyring: Keyring, *, include_orphans: bool = False, batch: int = 5000
) -> Iterator[RouteRecord]:
    """Yield a :class:`RouteRecord` for every stored route, in route id order (server-side cursor).

    Credentials are decrypted; ``workspace_ids`` is the sorted list of the route's workspace ids.

    Args:
        engine: engine on the magpie database.
        keyring: decrypts credentials (must derive from the same ``PROXY_ENCRYPTION_KEY`` as the import).
        include_orphans: also yield routes that belong to no workspace (``workspace_ids == []``); by
            default they are skipped, since nothing asks for them to be checked.
        batch: rows fetched per round trip.
    Raises:
        magpie.base.crypto.CredentialError: stored credentials do not decrypt with ``keyring``.

    The generator holds a database connection until exhausted or closed.
    """
    join = "LEFT JOIN" if include_orphans else "JOIN"
    sql = f"""
        SELECT r.id, r.route_hash, r.protocol, r.host, r.port, r.username_enc, r.password_enc,
               COALESCE(array_agg(rw.workspace_id ORDER BY rw.workspace_id)
                        FILTER (WHERE rw.workspace_id IS NOT NULL), '{{}}')
        FROM routes r {join} route_workspaces rw ON rw.route_id = r.id
        GROUP BY r.id
        ORDER BY r.id
    """
    with engine.connect() as conn:
        result = conn.execution_options(stream_results=True, yield_per=batch).execute(sa.text(sql))
        for rid, rhash, proto, host, port, uenc, penc, ws in result:
            route = Route(proto, host, port, _decrypt(keyring, uenc), _decrypt(keyring, penc))
            yield RouteRecord(rid, rhash, route, list(ws))
