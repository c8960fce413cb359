"""The eligible routes of a rotator, from current route health (never per connection from the database).

:func:`load_pool` reads, in one bounded query, the workspace's routes whose newest check was alive and
that pass the rotator's filters; :class:`RoutePool` hands them out (round robin, or sticky per client
address) and skips routes that just failed to connect for a short penalty, so a dead upstream costs one
try, not one per connection. The process reloads pools on a cadence and when notified of a change.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.base.egress import is_ip_literal

POOL_CAP = 20_000
"""Most routes one pool holds (the lowest-latency ones)."""

FAIL_PENALTY_S = 30.0
"""Seconds a route that failed to connect is skipped by its pool."""


@dataclass(frozen=True, slots=True)
class Upstream:
    """One eligible route: ``protocol`` (one of :data:`magpie.base.protocols.PROTOCOLS`), ``host``,
    ``port``, credentials (clear text, in memory only; never logged: :meth:`label` is the safe name),
    ``latency_ms``, ``route_id``."""

    route_id: int
    protocol: str
    host: str
    port: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    latency_ms: float | None = None

    def label(self) -> str:
        """``protocol://host:port`` without credentials (for logs, metrics and listings)."""
        return f"{self.protocol}://{self.host}:{self.port}"


def filter_sql(filters: dict, key: str = "") -> tuple[str, dict]:
    """SQL conditions (``" AND ..."``, over ``routes r`` and ``route_health h``) and their parameters
    (names prefixed with ``key``) for a rotator's ``filters``; shared with rotator-scoped alert rules."""
    where, params = [], {}
    if filters.get("protocols"):
        where.append(f"r.protocol = ANY(:{key}protocols)")
        params[f"{key}protocols"] = list(filters["protocols"])
    if filters.get("anonymity"):
        where.append(f"h.anonymity = ANY(:{key}anonymity)")
        params[f"{key}anonymity"] = list(filters["anonymity"])
    if filters.get("max_latency_ms"):
        where.append(f"h.latency_ms <= :{key}max_latency")
        params[f"{key}max_latency"] = float(filters["max_latency_ms"])
    if filters.get("reputation"):
        where.append("EXISTS (SELECT 1 FROM route_reputation rr WHERE rr.route_id = r.id "
                     f"AND rr.label = :{key}rep)")
        params[f"{key}rep"] = filters["reputation"]
    if filters.get("country"):
        where.append("EXISTS (SELECT 1 FROM route_enrichment re WHERE re.route_id = r.id "
                     f"AND re.country = ANY(:{key}country))")
        params[f"{key}country"] = list(filters["country"])
    if filters.get("exit_country"):  # where the judge saw the route exit (route_health.exit_country)
        where.append(f"h.exit_country = ANY(:{key}exit_country)")
        params[f"{key}exit_country"] = list(filters["exit_country"])
    return "".join(f" AND {w}" for w in where), params


def load_pool(engine: Engine, keyring, workspace_id: int, filters: dict, cap: int = POOL_CAP,
              egress=None) -> list[Upstream]:
    """The eligible routes of a workspace under ``filters`` (see :func:`magpie.rotator.service.check_filters`),
    lowest latency first, at most ``cap``. Credentials are decrypted with ``keyring``; a route whose
    credentials do not decrypt (another key) is left out, and so is an IP-literal route that ``egress``
    (the checks' :class:`magpie.base.egress.EgressPolicy`) refuses. Raises SQLAlchemy errors."""
    extra, params = filter_sql(filters)
    sql = sa.text(
        "SELECT r.id, r.protocol, r.host, r.port, r.username_enc, r.password_enc, h.latency_ms "
        "FROM route_workspaces rw JOIN routes r ON r.id = rw.route_id "
        "JOIN route_health h ON h.route_id = r.id "
        f"WHERE rw.workspace_id = :wid AND h.alive{extra} "
        "ORDER BY h.latency_ms NULLS LAST, r.id LIMIT :cap")
    out = []
    with engine.connect() as conn:
        rows = conn.execute(sql, {"wid": workspace_id, "cap": int(cap), **params}).all()
    for rid, proto, host, port, user_enc, pw_enc, latency in rows:
        if egress is not None and is_ip_literal(host) and egress.refusal(host):
            continue
        try:
            user = keyring.decrypt(user_enc) if user_enc else None
            pw = keyring.decrypt(pw_enc) if pw_enc else None
        except Exception:  # noqa: BLE001 - CredentialError: not ours to use
            continue
        out.append(Upstream(int(rid), proto, host, int(port), user, pw, latency))
    return out


class RoutePool:
    """Hands out upstream routes for client connections.

    Args:
        routes: the eligible routes (replace them with :meth:`replace`).
        policy: ``next`` (round robin per connection) or ``sticky`` (the same route for a client address
            for ``sticky_seconds``, while it keeps working).
        clock: seconds (monotonic) for tests.
    """

    def __init__(self, routes: list[Upstream], policy: str = "next", sticky_seconds: float = 0.0,
                 clock=time.monotonic):
        self.policy = policy
        self.sticky_seconds = float(sticky_seconds)
        self.clock = clock
        self._sticky: dict[str, tuple[Upstream, float]] = {}
        self._failed: dict[int, float] = {}
        self.replace(routes)

    def replace(self, routes: list[Upstream]) -> None:
        """Swap in a newly loaded route list (connections in flight keep their route)."""
        self.routes = list(routes)
        self._cycle = itertools.cycle(self.routes) if self.routes else None
        ids = {u.route_id for u in self.routes}
        self._sticky = {k: v for k, v in self._sticky.items() if v[0].route_id in ids}

    def __len__(self) -> int:
        return len(self.routes)

    def pick(self, client: str, exclude: set[int]) -> Upstream | None:
        """The route for the next try of ``client`` (its address), skipping ``exclude`` (route ids tried
        already) and routes in their failure penalty; None when none is left."""
        now = self.clock()
        if self.policy == "sticky":
            got = self._sticky.get(client)
            if got and got[1] > now and got[0].route_id not in exclude and not self._penalised(got[0], now):
                return got[0]
        if self._cycle is None:
            return None
        for _ in range(len(self.routes)):
            u = next(self._cycle)
            if u.route_id in exclude or self._penalised(u, now):
                continue
            if self.policy == "sticky":
                self._sticky[client] = (u, now + self.sticky_seconds)
                if len(self._sticky) > 100_000:  # bounded: drop expired entries
                    self._sticky = {k: v for k, v in self._sticky.items() if v[1] > now}
            return u
        return None

    def _penalised(self, u: Upstream, now: float) -> bool:
        until = self._failed.get(u.route_id)
        if until is None:
            return False
        if until <= now:
            del self._failed[u.route_id]
            return False
        return True

    def failed(self, u: Upstream) -> None:
        """Record that ``u`` failed to connect: skipped for :data:`FAIL_PENALTY_S` seconds."""
        self._failed[u.route_id] = self.clock() + FAIL_PENALTY_S
        if self.policy == "sticky":
            self._sticky = {k: v for k, v in self._sticky.items() if v[0].route_id != u.route_id}
