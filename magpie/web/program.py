"""The program API under ``/api``: route reads with keyset paging, a route's check history, and imports.

Who may call what (:class:`magpie.apitokens.store.Principal`, resolved by the app's guard from
``Authorization: Bearer <token>`` before any route runs):

- an API token (``magpie tokens create``) of role ``read`` reads its own workspace's routes and import
  jobs; ``operate`` also imports into it; ``admin`` does everything in every workspace, the dashboard's
  own endpoints and actions included. ``MAGPIE_WEB_TOKEN`` is an admin token.
- without a token, reads follow the dashboard's rule (open on a loopback bind, which shows every
  workspace, as its pages do; refused elsewhere); imports always need a token.

Refusals are one JSON line ``{"ok": false, "refused": <code>, "detail": <one line>, "member": null}``:
401 (``token_required``, ``bad_token``, ``revoked``, ``expired``), 403 (``forbidden``: the token's role or
workspace does not cover the request), 429 (``rate_limited``, with ``Retry-After``). A route or job of
another workspace answers 404, as an unknown one does.

:func:`need` and :func:`stream_lines` are what a new endpoint needs: a streamed export is a dependency on
``need("read")``, :func:`scoped_workspace`, and a generator of lines.
"""

from __future__ import annotations

import io
import json
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool

from magpie.apitokens.store import Principal
from magpie.base.protocols import PROTOCOLS, ProtocolName
from magpie.web import data
from magpie.web.api import TEXT, UNAVAILABLE, Dash, HistoryRow, Missing, Refused, RouteDetail, RouteHealth
from magpie.web.auth import AuthRefused

HASH = Annotated[str, Path(pattern=r"^[0-9a-f]{24}$", description="Route hash (24 hex characters).")]
JOB_ID = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="Import job id (32 hex characters).")]
JOB_TTL_S = 7 * 86400
"""Seconds an import job's record (status and report) is kept in Redis."""

AUTH_REFUSALS = {401: {"model": Refused, "description": "No token, or a bad, revoked or expired one"},
                 403: {"model": Refused, "description": "The token's role or workspace does not cover this"},
                 429: {"model": Refused, "description": "Rate limited: retry after Retry-After seconds"}}
NOT_FOUND = {404: {"model": Missing, "description": "Unknown (or another workspace's)"}}

router = APIRouter(prefix="/api", responses={**UNAVAILABLE, **AUTH_REFUSALS}, tags=["program"])


# -- authorization --------------------------------------------------------------------------------------
def principal(request: Request) -> Principal | None:
    """The request's principal as the guard resolved it (None: no token presented)."""
    return getattr(request.state, "principal", None)


def need(role: str, *, token: bool = False):
    """A dependency returning the request's :class:`Principal` when its role covers ``role``.

    Args:
        role: ``read``, ``operate`` or ``admin``.
        token: a token is required even where the dashboard's reads are open.
    Raises (as the dependency runs) :class:`magpie.web.auth.AuthRefused`: 401 ``token_required`` with no
    token when one is needed; 403 ``forbidden`` for a weaker role. Returns None for an open read.
    """

    def dependency(request: Request) -> Principal | None:
        p = principal(request)
        if p is None:
            if token or role != "read":
                raise AuthRefused(401, "token_required", f"this request needs an API token of role {role} or "
                                                         "stronger (Authorization: Bearer <token>)")
            return None
        if not p.allows(role):
            raise AuthRefused(403, "forbidden", f"a {p.role} token cannot do this: it needs role {role}")
        return p

    return dependency


def scoped_workspace(p: Principal | None, workspace: str | None) -> str | None:
    """The workspace a request acts on: the one named (which a non-admin token must own), else the token's.

    Returns None for "every workspace" (an admin or open read naming none). Raises
    :class:`AuthRefused` 403 when a non-admin token names another workspace."""
    if p is None or p.role == "admin":
        return workspace
    if workspace and workspace != p.workspace:
        raise AuthRefused(403, "forbidden", f"this token is scoped to workspace {p.workspace!r}")
    return p.workspace


def stream_lines(lines: Iterable[str | bytes], media_type: str = "application/x-ndjson",
                 filename: str | None = None) -> StreamingResponse:
    """A streamed response of ``lines`` (each sent as produced, newline added when missing).

    A sync iterable is run in the thread pool, so a generator reading PostgreSQL with a server-side cursor
    does not block the event loop. ``filename`` sets ``Content-Disposition: attachment``."""

    def encoded() -> Iterator[bytes]:
        for line in lines:
            b = line.encode("utf-8") if isinstance(line, str) else line
            yield b if b.endswith(b"\n") else b + b"\n"

    headers = {"Content-Disposition": f'attachment; filename="{filename}"'} if filename else None
    return StreamingResponse(encoded(), media_type=media_type, headers=headers)


Reader = Annotated[Principal | None, Depends(need("read"))]


# -- routes ---------------------------------------------------------------------------------------------
class RoutePage(BaseModel):
    """One page of routes. Offset paging (``offset``) counts ``total``; keyset paging (``after``: a route
    id, 0 for the first page) does not (``total`` null) and gives ``next_after`` while more may follow."""

    total: int | None
    limit: int
    offset: int
    after: int | None = None
    next_after: int | None = None
    routes: list[RouteHealth]


class HistoryPage(BaseModel):
    """A route's check results, newest first; pass ``next_cursor`` as ``cursor`` for the older ones."""

    route_hash: str
    history: list[HistoryRow]
    next_cursor: str | None


@router.get("/routes", response_model=RoutePage, summary="Routes with their latest health, filtered")
def api_routes(
    d: Dash,
    p: Reader,
    workspace: Annotated[str | None, Query(max_length=200, pattern=TEXT,
                                           description="Only this workspace (a scoped token's by default)")] = None,
    protocol: ProtocolName | None = None,
    alive: Literal["yes", "no", "unknown"] | None = None,
    anonymity: Literal["transparent", "anonymous", "elite"] | None = None,
    min_latency_ms: Annotated[float | None, Query(ge=0, le=1e7, allow_inf_nan=False)] = None,
    max_latency_ms: Annotated[float | None, Query(ge=0, le=1e7, allow_inf_nan=False)] = None,
    q: Annotated[str | None, Query(max_length=200, pattern=TEXT,
                                   description="Host or hash substring")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000, description="Rows skipped (offset paging)")] = 0,
    after: Annotated[int | None, Query(ge=0, le=2**63 - 1,
                                       description="Keyset paging: routes with a greater id (0: first page)")] = None,
):
    ws = scoped_workspace(p, workspace or None)
    flt = data.RouteFilter(ws, protocol, alive, anonymity, min_latency_ms, max_latency_ms, q or None)
    if after is not None:
        rows = data.list_routes_after(d.engine, flt, limit=limit, after=after)
        nxt = rows[-1]["route_id"] if len(rows) == limit else None
        return {"total": None, "limit": limit, "offset": 0, "after": after, "next_after": nxt, "routes": rows}
    page = data.list_routes(d.engine, flt, limit=limit, offset=offset)
    return {"total": page["total"], "limit": limit, "offset": offset, "routes": page["routes"]}


def _visible_route(d, p: Principal | None, route_hash: str) -> dict | None:
    """The stored route if ``p`` may see it (None: unknown, or of another workspace)."""
    row = data.route_by_hash(d.engine, route_hash)
    if row is None or p is None or p.role == "admin" or p.workspace in row["workspaces"]:
        return row
    return None


@router.get("/routes/{route_hash}", response_model=RouteDetail, summary="One route and its recent history",
            responses=NOT_FOUND)
def api_route(route_hash: HASH, d: Dash, p: Reader, history: Annotated[int, Query(ge=1, le=500)] = 50):
    if p is not None and p.role != "admin":
        if _visible_route(d, p, route_hash) is None:
            raise HTTPException(404, f"no route {route_hash}")
    got = d.route(route_hash, history)
    if got is None:
        raise HTTPException(404, f"no route {route_hash}")
    return got


def _cursor(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    us, _, rid = text.partition(":")  # the query pattern checked the form
    return int(us), int(rid)


@router.get("/routes/{route_hash}/history", response_model=HistoryPage, responses=NOT_FOUND,
            summary="A route's check history (check_history), newest first, a page at a time")
def api_route_history(route_hash: HASH, d: Dash, p: Reader,
                      limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                      cursor: Annotated[str | None, Query(max_length=40, pattern=r"^[0-9]{1,18}:[0-9]{1,18}$",
                                                          description="next_cursor of the previous page")] = None):
    before = _cursor(cursor)
    row = _visible_route(d, p, route_hash)
    if row is None:
        raise HTTPException(404, f"no route {route_hash}")
    rows = data.history_page(d.engine, row["route_id"], limit=limit, before=before)
    nxt = None
    if len(rows) == limit:
        last = rows[-1]
        nxt = f"{last.pop('_us')}:{last.pop('_id')}"
    for r in rows:
        r.pop("_us", None), r.pop("_id", None)
    return {"route_hash": route_hash, "history": rows, "next_cursor": nxt}


# -- imports --------------------------------------------------------------------------------------------
class Problem(BaseModel):
    """A request the API could not carry out: ``detail`` (one line, or the validation errors) and, when
    an import job was recorded, its ``job`` id."""

    detail: str | list
    job: str | None = None


class ImportFromUrl(BaseModel):
    """Fetch the list from ``source_url`` (http or https, no credentials) through the egress guard."""

    model_config = ConfigDict(strict=True, extra="forbid")
    source_url: str = Field(min_length=8, max_length=2000, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^\x00]+$")


class ImportReport(BaseModel):
    """What the importer did (``magpie import --json``): counts and ``invalid`` lines with reasons."""

    valid: int
    imported: int
    duplicates: int
    skipped: int
    invalid: list[dict]
    refused: int
    blacklisted: int
    flagged: int
    enriched: int
    stored: int
    scheduled: int
    schedule_error: str | None


class ImportJob(BaseModel):
    """An import job: ``running``, ``done``, ``incomplete`` (stored, not all scheduled: re-run it) or
    ``failed`` (``error`` says why; nothing stored)."""

    id: str
    status: Literal["running", "done", "incomplete", "failed"]
    workspace: str
    source: str
    dry_run: bool
    created_at: datetime
    finished_at: datetime | None
    report: ImportReport | None
    error: str | None
    seconds: float | None = None


_BODY = {"required": True, "content": {
    "text/plain": {"schema": {"type": "string", "description": "The proxy list itself"}},
    "application/json": {"schema": {"$ref": "#/components/schemas/ImportFromUrl"}}}}


def _job_key(settings, job_id: str) -> str:
    return f"{settings.redis_prefix}{{api}}:import:{job_id}"


def _save_job(d, job: dict) -> None:
    d.redis.set(_job_key(d.settings, job["id"]), json.dumps(job, default=str), ex=JOB_TTL_S)


class _Named(io.BytesIO):
    """The list's bytes, with the source name the importer records (``route_sources``)."""

    def __init__(self, body: bytes, name: str):
        super().__init__(body)
        self.name = name


def _source_name(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    tail = parts.path.rstrip("/").rsplit("/", 1)[-1]
    return tail or (parts.hostname or "-")


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise HTTPException(413, f"the list is larger than {limit} bytes (MAGPIE_API_IMPORT_MAX_BYTES)")
        chunks.append(chunk)
    return b"".join(chunks)


def _fetch(settings, url: str, resolve) -> bytes:
    from magpie.base.egress import EgressPolicy
    from magpie.enrich.fetch import FetchError, get

    policy = EgressPolicy(settings.api_fetch_allow_private, "MAGPIE_API_FETCH_ALLOW_PRIVATE")
    try:
        reply = get(url, policy=policy, timeout=settings.api_fetch_timeout, max_bytes=settings.api_import_max_bytes,
                    resolve=resolve, total_timeout=settings.api_fetch_timeout)
    except FetchError as exc:
        raise _FetchFailed(str(exc)) from None
    if not 200 <= reply.status < 300:
        raise _FetchFailed(f"HTTP {reply.status} from source_url")
    return reply.body


class _FetchFailed(Exception):
    pass


@router.post("/imports", response_model=ImportJob, status_code=201, summary="Import a proxy list",
             openapi_extra={"requestBody": _BODY},
             responses={413: {"model": Problem, "description": "The list is over MAGPIE_API_IMPORT_MAX_BYTES"},
                        422: {"model": Problem, "description": "Bad parameters, or source_url failed"}})
async def api_import(
    request: Request,
    d: Dash,
    p: Annotated[Principal | None, Depends(need("operate"))],
    workspace: Annotated[str | None, Query(min_length=1, max_length=200, pattern=TEXT,
                                           description="Workspace to import into (a scoped token's by default)")] = None,
    protocol: ProtocolName = "http",
    format: Literal["auto", "ip:port:user:pass", "ip:port:country:anonymity"] = "auto",
    dry_run: bool = False,
):
    """The body is the list itself (any content type but JSON), or JSON ``{"source_url": ...}``. Runs the
    importer (``magpie import``) and answers with the job and its per-line report."""
    from magpie.importer.service import ImportIncomplete, import_file

    settings = d.settings
    ws = scoped_workspace(p, workspace) or (p.workspace if p is not None else None)
    if not ws:
        raise HTTPException(422, "workspace is required (this token has none of its own)")
    body = await _read_body(request, settings.api_import_max_bytes)
    if not body:
        raise HTTPException(422, 'the body must be the proxy list, or JSON {"source_url": "http(s)://..."}')
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    source_url = None
    if ctype == "application/json":
        try:
            source_url = ImportFromUrl.model_validate_json(body).source_url
        except ValueError:
            raise HTTPException(422, 'a JSON body must be {"source_url": "http(s)://..."}') from None
    job = {"id": uuid.uuid4().hex, "status": "running", "workspace": ws,
           "source": (_source_name(source_url) if source_url else "<api upload>"), "dry_run": dry_run,
           "created_at": datetime.now(timezone.utc), "finished_at": None, "report": None, "error": None}
    await run_in_threadpool(_save_job, d, job)

    def run():
        raw = body
        if source_url is not None:
            raw = _fetch(settings, source_url, getattr(request.app.state, "resolve", socket.getaddrinfo))
        src = _Named(raw, job["source"])
        try:
            report = import_file(src, ws, settings, protocol=protocol, dry_run=dry_run, fmt=format,
                                 queue=None if dry_run else d.queue, engine=None if dry_run else d.engine)
            return "done", report.as_json(), None
        except ImportIncomplete as exc:
            if exc.report is None:
                raise
            return "incomplete", exc.report.as_json(), str(exc)

    started = time.monotonic()
    try:
        status, report, error = await run_in_threadpool(run)
    except (_FetchFailed, ValueError) as exc:
        job.update(status="failed", error=str(exc).splitlines()[0] if str(exc) else "failed",
                   finished_at=datetime.now(timezone.utc))
        await run_in_threadpool(_save_job, d, job)
        return JSONResponse({"detail": job["error"], "job": job["id"]}, status_code=422)
    except Exception:  # storage failures answer 503 through the app's handlers, the job says failed
        job.update(status="failed", error="the import failed (see the magpie web log)",
                   finished_at=datetime.now(timezone.utc))
        await run_in_threadpool(_save_job, d, job)
        raise
    job.update(status=status, report=report, error=error, finished_at=datetime.now(timezone.utc))
    job["seconds"] = round(time.monotonic() - started, 3)
    await run_in_threadpool(_save_job, d, job)
    return job


@router.get("/imports/{job_id}", response_model=ImportJob, responses=NOT_FOUND,
            summary="An import job's status and report")
def api_import_job(job_id: JOB_ID, d: Dash, p: Reader):
    raw = d.redis.get(_job_key(d.settings, job_id))
    if raw is None:
        raise HTTPException(404, f"no import job {job_id} (jobs are kept {JOB_TTL_S // 86400} days)")
    job = json.loads(raw)
    if p is not None and not p.sees(job["workspace"]):
        raise HTTPException(404, f"no import job {job_id} (jobs are kept {JOB_TTL_S // 86400} days)")
    return job


__all__ = ["AUTH_REFUSALS", "need", "principal", "router", "scoped_workspace", "stream_lines"]


def _one_or_more(item: str) -> str:
    """A pattern for a comma-separated list of ``item`` (a regular expression)."""
    return f"^({item})(,({item}))*$"


_EXPORT_MEDIA = {"txt": "text/plain", "url": "text/plain", "csv": "text/csv", "json": "application/json",
                 "jsonl": "application/x-ndjson"}


@router.get("/export", summary="Stream a workspace's routes with their current health (magpie export)",
            responses={200: {"content": {m: {} for m in set(_EXPORT_MEDIA.values())},
                             "description": "The routes, streamed in the format asked for"},
                       422: {"model": Problem, "description": "Bad filter or format, or unknown workspace"}})
def api_export(
    d: Dash,
    p: Reader,
    workspace: Annotated[str | None, Query(max_length=200, pattern=TEXT,
                                           description="The workspace (a scoped token's by default)")] = None,
    format: Literal["txt", "url", "csv", "json", "jsonl"] = "txt",
    alive: bool | None = None,
    protocol: Annotated[str | None, Query(max_length=100, pattern=_one_or_more("|".join(PROTOCOLS)),
                                          description="comma-separated: " + ", ".join(PROTOCOLS))] = None,
    anonymity: Annotated[str | None, Query(max_length=100, pattern=_one_or_more("transparent|anonymous|elite"),
                                           description="comma-separated: transparent, anonymous, elite")] = None,
    country: Annotated[str | None, Query(max_length=200, pattern=_one_or_more("[A-Za-z]{2}"),
                                         description="entry GeoIP countries, e.g. DE,NL")] = None,
    exit_country: Annotated[str | None, Query(max_length=200, pattern=_one_or_more("[A-Za-z]{2}"),
                                              description="exit address countries, e.g. DE,NL")] = None,
    max_latency_ms: Annotated[float | None, Query(gt=0, le=1e9)] = None,
    min_score: Annotated[float | None, Query(ge=0, le=100)] = None,
    with_credentials: bool = False,
):
    """The same filters and formats as ``magpie export`` (docs/export.md). Credentials only with
    ``with_credentials=true`` and a token of role operate or admin (audit-logged)."""
    from magpie.admin.export import ExportError, ExportFilter, stream_export

    if with_credentials and (p is None or p.role == "read"):
        raise AuthRefused(403 if p else 401, "forbidden" if p else "token_required",
                          "exporting credentials needs an API token of role operate or admin")
    ws = scoped_workspace(p, workspace)
    if not ws:
        raise HTTPException(422, "workspace: name the workspace to export")
    flt = ExportFilter(ws, alive=alive, protocol=protocol, anonymity=anonymity, country=country,
                       max_latency_ms=max_latency_ms, min_score=min_score, exit_country=exit_country)
    try:
        chunks = stream_export(d.settings, flt, format, with_credentials=with_credentials)
    except ExportError as exc:
        raise HTTPException(422, str(exc)) from None
    return StreamingResponse(iterate_in_threadpool(chunk.encode("utf-8") for chunk in chunks),
                             media_type=_EXPORT_MEDIA[format],
                             headers={"Content-Disposition": f'attachment; filename="{ws}.{format}"'})
