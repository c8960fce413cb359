"""The dashboard's JSON API under ``/api``, described by the app's OpenAPI document (``/api/openapi.json``).

Reads return the same figures the pages show. Actions (``POST``) need ``Authorization: Bearer
<MAGPIE_WEB_TOKEN>`` and answer ``{"ok": true, "result": ...}``; a refusal answers ``{"ok": false,
"refused": <code>, "detail": <one line>, "member": <route hash or null>}`` with status 401 (no or wrong
token), 403 (actions disabled: no token configured) or 409 (the schedule refused: ``gone``, ``not_dead``,
``leased``, ``dead``, ``layout_mismatch``). An admin API token (``magpie tokens create --role admin``)
acts as ``MAGPIE_WEB_TOKEN`` does; weaker API tokens get 403 here (:mod:`magpie.web.program` serves them).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from pydantic import BaseModel, Field

from magpie.web import data
from magpie.web.auth import AuthRefused, bearer, require_action_token
from magpie.web.service import Dashboard

HASH = Annotated[str, Path(pattern=r"^[0-9a-f]{24}$", description="Route hash (24 hex characters).")]
TEXT = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL


class Shard(BaseModel):
    shard: str
    name: str
    scheduled: int
    leased: int
    expired_leases: int
    due_now: int
    next_due_ms: int | None
    oldest_lateness_s: float


class Totals(BaseModel):
    scheduled: int
    leased: int
    expired_leases: int
    due_now: int
    dead: int
    next_due_ms: int | None
    oldest_lateness_s: float


class Partition(Totals):
    """One partition of a partitioned schedule (``MAGPIE_SCHEDULE_PARTITIONS`` > 1): its number, hash-tag
    name, whether it is paused, and its counts summed over its shards."""

    partition: int
    name: str
    paused: bool


class Status(BaseModel):
    """Per-shard schedule state as ``magpie status --json`` prints it (times in Unix ms, lateness in s);
    ``partitions`` (a partitioned schedule only) gives each partition's counts beside the totals."""

    now_ms: int
    paused: bool
    shards: list[Shard]
    totals: Totals
    partitions: list[Partition] | None = None


class Point(BaseModel):
    t_ms: int
    checks_per_s: float | None
    lateness_mean_s: float | None
    lateness_p50_s: float | None
    lateness_p99_s: float | None
    due_now: int | None
    leased: int | None
    scheduled: int | None
    dead: int | None
    oldest_lateness_s: float | None


class Series(BaseModel):
    """Throughput (finished checks per second) and check lateness per sample interval, oldest first."""

    interval_s: float
    points: list[Point]


class RouteRef(BaseModel):
    protocol: str
    host: str
    port: int


class DeadLetter(BaseModel):
    member: str
    dead_at_ms: int
    reason: str | None
    stalls: int | None
    route: RouteRef | None


class DeadList(BaseModel):
    total: int
    dead: list[DeadLetter]


class RouteHealth(BaseModel):
    route_id: int
    route_hash: str
    protocol: str
    host: str
    port: int
    has_credentials: bool
    alive: bool | None
    latency_ms: float | None
    status: int | None
    anonymity: str | None
    error: str | None
    last_checked_at: datetime | None
    checks_total: int
    alive_total: int
    consecutive_failures: int
    exit_ip: str | None = Field(None, description="the address the judge saw the route exit from")
    exit_country: str | None = Field(None, description="that address's GeoIP country")


class RouteStored(RouteHealth):
    workspaces: list[str]


class HistoryRow(BaseModel):
    checked_at: datetime
    alive: bool
    latency_ms: float | None
    status: int | None
    attempts: int
    error: str | None
    anonymity: str | None
    judge: str | None


class ScheduleInfo(BaseModel):
    """The route's schedule entry (:func:`magpie.queue.reads.inspect`), without its payload."""

    member: str
    score: str | None
    state: str
    stalls: int
    retries: int
    progress: str | None
    logs: list[str]
    dead: dict | None


class RouteDetail(BaseModel):
    route: RouteStored | None
    history: list[HistoryRow]
    schedule: ScheduleInfo | None


class Incident(BaseModel):
    id: int
    workspace: str
    rule: str
    kind: str
    threshold: float
    status: str
    opened_at: datetime
    recovered_at: datetime | None
    open_value: float | None
    recover_value: float | None


class Delivery(BaseModel):
    id: int
    delivery_id: str
    incident_id: int
    event: str
    channel: str
    target: str
    status: str
    attempts: int
    max_attempts: int
    last_http_status: int | None
    last_error: str | None
    created_at: datetime
    sent_at: datetime | None
    next_attempt_at: datetime


class Probe(BaseModel):
    ok: bool
    detail: str
    ms: float
    warn: bool = False


class Health(BaseModel):
    ready: bool
    checks: dict[str, Probe]


class RotatorView(BaseModel):
    """A rotator and its listener (``magpie rotators list``); client credentials show as ``auth`` only."""

    id: int
    name: str
    workspace: str | None
    port: int
    listen: list[str]
    auth: bool
    policy: str
    sticky_seconds: int
    filters: dict
    enabled: bool
    instance: str | None
    revision: int
    state: Literal["serving", "error", "not running", "unassigned"]
    error: str | None
    pool: int | None
    connections: int | None
    active: int | None
    upstream_failures: int | None
    bytes_up: int | None
    bytes_down: int | None


class RotatorList(BaseModel):
    """Every rotator by port; counters are since each listener started, None when it publishes none."""

    total: int
    serving: int
    rotators: list[RotatorView]


class BeatSchedule(BaseModel):
    entries: int | None
    bootstrapped: bool
    last_tick_age_s: float | None


class InstanceView(BaseModel):
    """One live instance's heartbeat record (``magpie instances``); times UTC, ages and TTL in s."""

    id: str
    role: str
    host: str | None
    pid: int | None
    version: str | None
    queues: list[str]
    checks_in_flight: int | None
    check_slots: int | None
    check_processes: int | None
    rotators: list[str] | None
    connections: int | None
    schedule: BeatSchedule | None
    cache_revisions: dict[str, str]
    started_at: datetime | None
    refreshed_at: datetime | None
    heartbeat_age_s: float | None
    ttl_s: float | None


class InstanceList(BaseModel):
    """Live instances (of ``role`` when asked); ``by_role`` counts every live instance."""

    total: int
    by_role: dict[str, int]
    instances: list[InstanceView]


class Done(BaseModel):
    ok: Literal[True] = True
    result: str | int | dict


class Refused(BaseModel):
    ok: Literal[False] = False
    refused: str
    detail: str
    member: str | None = None


class Missing(BaseModel):
    detail: str


REFUSALS = {401: {"model": Refused, "description": "No token, or the wrong one"},
            403: {"model": Refused, "description": "Actions disabled: MAGPIE_WEB_TOKEN is not set"},
            409: {"model": Refused, "description": "The schedule refused the action"}}
UNAVAILABLE = {503: {"model": Missing, "description": "Redis or PostgreSQL unreachable or not migrated"}}

router = APIRouter(prefix="/api", responses=UNAVAILABLE)


def dash(request: Request):
    """The app's :class:`magpie.web.service.Dashboard`."""
    return request.app.state.dashboard


Dash = Annotated[Dashboard, Depends(dash)]
"""The app's dashboard, as a parameter of every operation."""


def action_token(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    """Dependency of every action: the bearer token must match ``MAGPIE_WEB_TOKEN`` or be an admin API
    token (a weaker API token is refused with 403)."""
    p = getattr(request.state, "principal", None)
    if p is not None:
        if p.role == "admin":
            return
        raise AuthRefused(403, "forbidden", f"a {p.role} token cannot do this: it needs role admin")
    require_action_token(request.app.state.dashboard.settings.web_token, bearer(authorization))


def dashboard_scope(request: Request) -> None:
    """Dependency of the dashboard's own endpoints, which span every workspace: an API token below admin
    is refused with 403 (requests without one follow the dashboard's rule)."""
    p = getattr(request.state, "principal", None)
    if p is not None and p.role != "admin":
        raise AuthRefused(403, "forbidden", f"a {p.role} token cannot read this: it spans every workspace "
                                            "(needs role admin)")


@router.get("/status", response_model=Status, summary="Per-shard schedule state")
def api_status(d: Dash):
    return d.status()


@router.get("/series", response_model=Series, summary="Throughput and lateness over time")
def api_series(d: Dash, limit: Annotated[int | None, Query(ge=1, le=10_000)] = None):
    return {"interval_s": d.settings.web_sample_interval, "points": d.chart_points(limit)}


@router.get("/dead", response_model=DeadList, summary="Dead-lettered routes, oldest first")
def api_dead(d: Dash, limit: Annotated[int, Query(ge=1, le=1000)] = 100):
    rows = d.dead_letters(limit)
    return {"total": d.dead_count(), "dead": rows}


@router.get("/workspaces", response_model=list[str], summary="Workspace names")
def api_workspaces(d: Dash):
    return data.workspaces(d.engine)


@router.get("/incidents", response_model=list[Incident], summary="Alert incidents, newest first")
def api_incidents(d: Dash, status: Literal["open", "all"] = "open",
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100):
    return data.incidents(d.engine, open_only=status == "open", limit=limit)


@router.get("/deliveries", response_model=list[Delivery], summary="Recent webhook deliveries, newest first")
def api_deliveries(d: Dash, limit: Annotated[int, Query(ge=1, le=1000)] = 50):
    return data.deliveries(d.engine, limit)


@router.get("/rotators", response_model=RotatorList, summary="Rotators with their listener state")
def api_rotators(d: Dash):
    rows = d.rotators()
    return {"total": len(rows), "serving": sum(r["state"] == "serving" for r in rows), "rotators": rows}


@router.get("/instances", response_model=InstanceList, summary="Live instances (heartbeat records)")
def api_instances(d: Dash, role: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_.-]*$",
                                                             description="Only this role")] = None):
    return d.instances(role or None)


@router.get("/health", response_model=Health, summary="Readiness probes (as magpie health)")
def api_health(d: Dash):
    return d.health()


@router.post("/actions/pause", response_model=Done, responses=REFUSALS, summary="Pause all claiming",
             dependencies=[Depends(action_token)])
def api_pause(d: Dash):
    return {"result": d.pause()}


@router.post("/actions/resume", response_model=Done, responses=REFUSALS, summary="Resume claiming",
             dependencies=[Depends(action_token)])
def api_resume(d: Dash):
    return {"result": d.resume()}


@router.post("/routes/{route_hash}/reprocess", response_model=Done, responses=REFUSALS,
             summary="Put a dead-lettered route back, due now", dependencies=[Depends(action_token)])
def api_reprocess(route_hash: HASH, d: Dash):
    return {"result": {"due_ms": d.reprocess(route_hash)}}


@router.post("/routes/{route_hash}/check-now", response_model=Done, responses=REFUSALS,
             summary="Check a route now (or after delay_s seconds)", dependencies=[Depends(action_token)])
def api_check_now(route_hash: HASH, d: Dash,
                  delay_s: Annotated[float, Query(ge=0, le=365 * 86400, allow_inf_nan=False)] = 0.0):
    return {"result": {"due_ms": d.check_now(route_hash, int(delay_s * 1000))}}


__all__ = ["action_token", "dashboard_scope", "router"]
