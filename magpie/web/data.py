"""PostgreSQL reads of the dashboard: filtered route health, one route's history, incidents, deliveries.

The schedule's own figures come from :mod:`magpie.queue.reads` (through :class:`~magpie.queue.RouteQueue`);
this module only adds what the dashboard pages need beyond the command line's reads: filters, paging and
joins. No credential ever leaves it: routes carry ``has_credentials`` instead of a user name, error texts
go through :func:`magpie.base.redact.mask_url_passwords`, judge bodies are never read, and webhook targets are
cut down to scheme and host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.base.redact import mask_url_passwords
from magpie.base.protocols import PROTOCOLS

ANONYMITY = ("transparent", "anonymous", "elite")
ALIVE = ("yes", "no", "unknown")
_HASH = re.compile(r"[0-9a-f]{24}")


def is_route_hash(text: str) -> bool:
    """True when ``text`` has the form of a route hash (24 lower-case hex characters)."""
    return bool(_HASH.fullmatch(text or ""))


@dataclass(frozen=True, slots=True)
class RouteFilter:
    """Filters of the route list; ``None`` means "any".

    Attributes:
        workspace: workspace name. protocol: one of :data:`PROTOCOLS`. alive: ``"yes"``, ``"no"`` or
        ``"unknown"`` (never checked). anonymity: one of :data:`ANONYMITY`. max_latency_ms /
        min_latency_ms: bounds on the latest latency in ms (routes without a latency are left out when
        either is set). search: substring of the host or the route hash.
    """

    workspace: str | None = None
    protocol: str | None = None
    alive: str | None = None
    anonymity: str | None = None
    min_latency_ms: float | None = None
    max_latency_ms: float | None = None
    search: str | None = None

    def where(self) -> tuple[str, dict]:
        """The SQL ``WHERE`` clause (possibly empty) and its bound parameters."""
        parts: list[str] = []
        params: dict = {}
        if self.workspace:
            parts.append("EXISTS (SELECT 1 FROM route_workspaces rw"
                         " JOIN workspaces w ON w.id = rw.workspace_id"
                         " WHERE rw.route_id = r.id AND w.name = :ws)")
            params["ws"] = self.workspace
        if self.protocol:
            parts.append("r.protocol = :proto")
            params["proto"] = self.protocol
        if self.alive == "yes":
            parts.append("h.alive IS TRUE")
        elif self.alive == "no":
            parts.append("h.alive IS FALSE")
        elif self.alive == "unknown":
            parts.append("h.alive IS NULL")
        if self.anonymity:
            parts.append("h.anonymity = :anon")
            params["anon"] = self.anonymity
        if self.min_latency_ms is not None:
            parts.append("h.latency_ms >= :lat_min")
            params["lat_min"] = self.min_latency_ms
        if self.max_latency_ms is not None:
            parts.append("h.latency_ms <= :lat_max")
            params["lat_max"] = self.max_latency_ms
        if self.search:
            parts.append("(r.host ILIKE :q ESCAPE '\\' OR r.route_hash LIKE :q ESCAPE '\\')")
            escaped = self.search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            params["q"] = f"%{escaped}%"
        return (" WHERE " + " AND ".join(parts)) if parts else "", params


_ROUTE_COLUMNS = """
    r.id, r.route_hash, r.protocol, r.host, r.port, r.username_enc IS NOT NULL,
    h.alive, h.latency_ms, h.status, h.anonymity, h.error, h.last_checked_at,
    COALESCE(h.checks_total, 0), COALESCE(h.alive_total, 0), COALESCE(h.consecutive_failures, 0),
    h.exit_ip, h.exit_country
"""
_ROUTE_KEYS = ("route_id", "route_hash", "protocol", "host", "port", "has_credentials", "alive",
               "latency_ms", "status", "anonymity", "error", "last_checked_at", "checks_total",
               "alive_total", "consecutive_failures", "exit_ip", "exit_country")


def _route_row(row) -> dict:
    d = dict(zip(_ROUTE_KEYS, row))
    d["route_hash"] = d["route_hash"].strip()
    d["error"] = mask_url_passwords(d["error"]) if d["error"] else d["error"]
    return d


def list_routes(engine: Engine, flt: RouteFilter, *, limit: int = 100, offset: int = 0) -> dict:
    """One page of routes with their latest health, ordered by protocol, host, port.

    Args:
        engine: engine on the magpie database. flt: the filters. limit: rows (1..1000). offset: rows
            skipped (>= 0).
    Returns:
        ``{"total": int (rows matching), "routes": [dict]}``; each route has the keys of
        :data:`_ROUTE_KEYS` (``latency_ms`` in ms, ``last_checked_at`` an aware datetime or None).
    """
    where, params = flt.where()
    base = " FROM routes r LEFT JOIN route_health h ON h.route_id = r.id" + where
    params = dict(params, limit=int(limit), offset=int(offset))
    with engine.connect() as conn:
        total = conn.execute(sa.text("SELECT count(*)" + base), params).scalar_one()
        rows = conn.execute(sa.text(f"SELECT {_ROUTE_COLUMNS} {base}"
                                    " ORDER BY r.protocol, r.host, r.port, r.id"
                                    " LIMIT :limit OFFSET :offset"), params).all()
    return {"total": int(total), "routes": [_route_row(r) for r in rows]}


def list_routes_after(engine: Engine, flt: RouteFilter, *, limit: int = 100, after: int = 0) -> list[dict]:
    """One keyset page of routes in route id order: those with ``route_id > after`` matching ``flt``.

    An index range scan wherever the page starts (``magpie routes --after``); a workspace filter walks
    that workspace's membership in id order. Returns at most ``limit`` dicts keyed as in
    :func:`list_routes`; the last one's ``route_id`` is the next page's ``after``.
    """
    where, params = RouteFilter(None, flt.protocol, flt.alive, flt.anonymity, flt.min_latency_ms,
                                flt.max_latency_ms, flt.search).where()
    params = dict(params, limit=int(limit), after=int(after))
    if flt.workspace:
        base = (" FROM route_workspaces rw JOIN routes r ON r.id = rw.route_id"
                " LEFT JOIN route_health h ON h.route_id = r.id"
                " WHERE rw.workspace_id = (SELECT id FROM workspaces WHERE name = :ws) AND rw.route_id > :after")
        order = " ORDER BY rw.route_id"
        params["ws"] = flt.workspace
    else:
        base = " FROM routes r LEFT JOIN route_health h ON h.route_id = r.id WHERE r.id > :after"
        order = " ORDER BY r.id"
    if where:
        base += " AND " + where.removeprefix(" WHERE ")
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT {_ROUTE_COLUMNS} {base}{order} LIMIT :limit"), params).all()
    return [_route_row(r) for r in rows]


def history_page(engine: Engine, route_id: int, *, limit: int = 100,
                 before: tuple[int, int] | None = None) -> list[dict]:
    """One page of a route's check results, newest first, keyed by ``(checked_at, id)``.

    Args:
        before: ``(checked_at as Unix microseconds, id)`` of the last row of the previous page, or None.
    Returns:
        Dicts as :func:`route_history` gives, plus ``_us`` and ``_id`` (the row's cursor parts).
    """
    sql = ("SELECT checked_at, alive, latency_ms, status, attempts, error, anonymity, judge, id,"
           " floor(extract(epoch FROM date_trunc('second', checked_at)))::bigint * 1000000"
           " + extract(microseconds FROM checked_at)::bigint % 1000000"
           " FROM check_history WHERE route_id = :id")
    params: dict = {"id": int(route_id), "n": int(limit)}
    if before is not None:
        sql += (" AND (checked_at, id) < (timestamptz 'epoch' + :us * interval '1 microsecond', :rid)")
        params.update(us=int(before[0]), rid=int(before[1]))
    sql += " ORDER BY checked_at DESC, id DESC LIMIT :n"
    keys = ("checked_at", "alive", "latency_ms", "status", "attempts", "error", "anonymity", "judge", "_id", "_us")
    out = []
    with engine.connect() as conn:
        for row in conn.execute(sa.text(sql), params):
            d = dict(zip(keys, row))
            for k in ("error", "judge"):
                if d[k]:
                    d[k] = mask_url_passwords(d[k])
            out.append(d)
    return out


def route_by_hash(engine: Engine, route_hash: str) -> dict | None:
    """One route's latest health (keys as in :func:`list_routes`) plus ``workspaces`` (names), or None."""
    with engine.connect() as conn:
        row = conn.execute(sa.text(f"SELECT {_ROUTE_COLUMNS} FROM routes r LEFT JOIN route_health h"
                                   " ON h.route_id = r.id WHERE r.route_hash = :h"),
                           {"h": route_hash}).first()
        if row is None:
            return None
        out = _route_row(row)
        out["workspaces"] = list(conn.execute(sa.text(
            "SELECT w.name FROM route_workspaces rw JOIN workspaces w ON w.id = rw.workspace_id"
            " WHERE rw.route_id = :id ORDER BY w.name"), {"id": out["route_id"]}).scalars())
    return out


def routes_by_hashes(engine: Engine, hashes: list[str]) -> dict[str, dict]:
    """``{route_hash: {"protocol", "host", "port"}}`` for the stored routes among ``hashes``."""
    if not hashes:
        return {}
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT route_hash, protocol, host, port FROM routes"
                                    " WHERE route_hash = ANY(:hs)"), {"hs": list(hashes)}).all()
    return {h.strip(): {"protocol": p, "host": host, "port": port} for h, p, host, port in rows}


def route_history(engine: Engine, route_id: int, limit: int = 50) -> list[dict]:
    """The newest ``limit`` check results of one route, newest first (index on route_id, checked_at).

    Returns ``[{"checked_at", "alive", "latency_ms", "status", "attempts", "error", "anonymity",
    "judge"}]``; the judge's response body is never read.
    """
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT checked_at, alive, latency_ms, status, attempts, error, anonymity, judge"
            " FROM check_history WHERE route_id = :id ORDER BY checked_at DESC LIMIT :n"),
            {"id": route_id, "n": int(limit)}).all()
    keys = ("checked_at", "alive", "latency_ms", "status", "attempts", "error", "anonymity", "judge")
    out = []
    for row in rows:
        d = dict(zip(keys, row))
        for k in ("error", "judge"):
            if d[k]:
                d[k] = mask_url_passwords(d[k])
        out.append(d)
    return out


def workspaces(engine: Engine, limit: int = 1000) -> list[str]:
    """Workspace names, sorted (at most ``limit``)."""
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT name FROM workspaces ORDER BY name LIMIT :n"),
                                 {"n": int(limit)}).scalars())


def incidents(engine: Engine, *, open_only: bool = True, limit: int = 100) -> list[dict]:
    """Alert incidents, newest first: ``[{"id", "workspace", "rule", "kind", "threshold", "status",
    "opened_at", "recovered_at", "open_value", "recover_value"}]`` (open ones only by default)."""
    sql = """
        SELECT i.id, w.name, r.name, r.kind, r.threshold, i.status, i.opened_at, i.recovered_at,
               i.open_value, i.recover_value
        FROM alert_incidents i JOIN alert_rules r ON r.id = i.rule_id
        JOIN workspaces w ON w.id = i.workspace_id
    """
    if open_only:
        sql += " WHERE i.status = 'open'"
    sql += " ORDER BY i.opened_at DESC, i.id DESC LIMIT :n"
    keys = ("id", "workspace", "rule", "kind", "threshold", "status", "opened_at", "recovered_at",
            "open_value", "recover_value")
    with engine.connect() as conn:
        return [dict(zip(keys, row)) for row in conn.execute(sa.text(sql), {"n": int(limit)})]


def target_origin(url: str) -> str:
    """``scheme://host[:port]`` of a webhook URL: path, query and user info can hold secrets."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(unparsable URL)"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{port}"


def deliveries(engine: Engine, limit: int = 50) -> list[dict]:
    """Recent webhook deliveries, newest first: ``[{"id", "delivery_id", "incident_id", "event",
    "channel", "target" (scheme and host only), "status", "attempts", "max_attempts",
    "last_http_status", "last_error", "created_at", "sent_at", "next_attempt_at"}]``."""
    sql = """
        SELECT d.id, d.delivery_id, d.incident_id, d.event, c.name, c.target, d.status, d.attempts,
               d.max_attempts, d.last_http_status, d.last_error, d.created_at, d.sent_at, d.next_attempt_at
        FROM alert_deliveries d JOIN alert_channels c ON c.id = d.channel_id
        ORDER BY d.created_at DESC, d.id DESC LIMIT :n
    """
    keys = ("id", "delivery_id", "incident_id", "event", "channel", "target", "status", "attempts",
            "max_attempts", "last_http_status", "last_error", "created_at", "sent_at", "next_attempt_at")
    out = []
    with engine.connect() as conn:
        for row in conn.execute(sa.text(sql), {"n": int(limit)}):
            d = dict(zip(keys, row))
            d["delivery_id"] = str(d["delivery_id"])
            full, d["target"] = d["target"], target_origin(d["target"])
            if d["last_error"]:  # an error may quote the URL, whose path can be the secret
                d["last_error"] = mask_url_passwords(d["last_error"].replace(full, d["target"] + "/***"))
            out.append(d)
    return out


__all__ = ["ALIVE", "ANONYMITY", "PROTOCOLS", "RouteFilter", "deliveries", "incidents", "is_route_hash",
           "list_routes",
           "list_routes_after", "history_page", "route_by_hash", "route_history", "routes_by_hashes",
           "target_origin", "workspaces"]
