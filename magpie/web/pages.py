"""The dashboard's server-rendered pages (Jinja2 templates in ``templates/``) and their action forms.

Pages: ``/`` (schedule per shard, charts, pause/resume), ``/dead`` (dead letters, reprocess), ``/routes``
(filters, paging), ``/routes/<hash>`` (health, schedule entry, recent history, check now), ``/alerts``
(open incidents, recent deliveries), ``/rotators`` (rotators and their listener state), ``/instances``
(live instances by role), ``/health`` (readiness). An action form posts to
``/ui/actions/<name>`` with the token in its ``token`` field and comes back to its page with a message.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from datetime import UTC, datetime
from importlib import resources
from typing import Annotated
from urllib.parse import parse_qs, urlencode

import redis
from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from sqlalchemy import exc as sa_exc
from starlette.concurrency import run_in_threadpool

from magpie.errors import MagpieError, RefusedError
from magpie.web import data, fleet
from magpie.web.auth import COOKIE, AuthRefused, is_loopback, require_action_token, token_matches
from magpie.web.charts import line_chart

log = logging.getLogger(__name__)
templates = Jinja2Templates(directory=str(resources.files("magpie.web") / "templates"))


def _when(value) -> str:
    """A datetime or Unix ms as ``YYYY-MM-DD HH:MM:SS`` UTC; ``-`` for None."""
    if value is None or value == "":
        return "-"
    if isinstance(value, (int, float)):
        value = datetime.fromtimestamp(value / 1000, tz=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _num(value, digits: int = 0) -> str:
    """A number with thousands separators (``-`` for None)."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _bytes(value) -> str:
    """A byte count as ``512 B``, ``1.5 KiB``, ``3.2 MiB``... (``-`` for None)."""
    if value is None:
        return "-"
    size, unit = float(value), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"


templates.env.filters["when"] = _when
templates.env.filters["bytes"] = _bytes
templates.env.filters["num"] = _num

router = APIRouter(include_in_schema=False)


_FLASH_KEY = secrets.token_bytes(32)
"""Signs the messages an action hands to the page it redirects to (per process)."""


def _flash_sig(message: str, ok: str) -> str:
    return hmac.new(_FLASH_KEY, f"{ok}\n{message}".encode(), hashlib.sha256).hexdigest()[:32]


def _flash(request: Request) -> tuple[str | None, str | None]:
    """The banner message and its ``ok`` flag from the URL, only when this process signed them."""
    q = request.query_params
    message, ok, sig = q.get("flash"), q.get("ok", ""), q.get("sig", "")
    if message is None or not hmac.compare_digest(sig.encode(), _flash_sig(message, ok).encode()):
        return None, None
    return message, ok


def _page(request: Request, name: str, title: str, status_code: int = 200, **ctx) -> HTMLResponse:
    d = request.app.state.dashboard
    flash, ok = _flash(request)
    ctx.update(title=title, flash=flash, ok=ok, signed_in=bool(request.cookies.get(COOKIE)),
               actions_enabled=bool(d.settings.web_token), path=request.url.path,
               here=str(request.url.path) + (f"?{request.url.query}" if request.url.query else ""))
    return templates.TemplateResponse(request, name, ctx, status_code=status_code)


@router.get("/", response_class=HTMLResponse)
def overview(request: Request, refresh: Annotated[int | None, Query(ge=2, le=3600)] = None):
    d = request.app.state.dashboard
    st = d.status()
    points = d.stored_points()
    stored = bool(points)
    if not stored:
        points = d.chart_points()
    ts = [p["t_ms"] for p in points]

    def pick(key):
        return list(zip(ts, (p[key] for p in points)))

    charts = [
        line_chart({"checks/s": pick("checks_per_s")}, title="Throughput", unit="/s"),
        line_chart({"p50": pick("lateness_p50_s"), "p99": pick("lateness_p99_s"),
                    "mean": pick("lateness_mean_s")}, title="Check lateness", unit=" s"),
        line_chart({"due now": pick("due_now"), "leased": pick("leased")}, title="Due and leased"),
        line_chart({"oldest lateness": pick("oldest_lateness_s")}, title="Oldest due route", unit=" s"),
    ]
    return _page(request, "overview.html", "Schedule", st=st, charts=charts, refresh=refresh,
                 interval=d.settings.web_sample_interval, samples=len(points), stored=stored,
                 fleet=_fleet_counts(d))


def _fleet_counts(d) -> dict:
    """Rotators serving / total and live instances by role; a part that cannot be read is None (the
    schedule figures stay visible when PostgreSQL is down)."""
    out: dict = {"rotators": None, "instances": None}
    try:
        out["rotators"] = fleet.rotator_counts(d.rotators())
    except (MagpieError, sa_exc.SQLAlchemyError):
        log.warning("overview: rotators unavailable", exc_info=True)
    try:
        out["instances"] = d.instances()["by_role"]
    except redis.RedisError:
        log.warning("overview: instances unavailable", exc_info=True)
    return out


@router.get("/dead", response_class=HTMLResponse)
def dead(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 100):
    d = request.app.state.dashboard
    rows = d.dead_letters(limit)
    return _page(request, "dead.html", "Dead letters", rows=rows, total=d.dead_count())


@router.get("/routes", response_class=HTMLResponse)
def routes(request: Request, workspace: str = "", protocol: str = "", alive: str = "", anonymity: str = "",
           min_latency_ms: str = "", max_latency_ms: str = "", q: str = "",
           offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0):
    d = request.app.state.dashboard

    def number(text: str) -> float | None:
        try:
            v = float(text)
        except ValueError:
            return None
        return v if 0 <= v <= 1e7 else None

    flt = data.RouteFilter(
        workspace.replace("\x00", "") or None, protocol if protocol in data.PROTOCOLS else None,
        alive if alive in data.ALIVE else None, anonymity if anonymity in data.ANONYMITY else None,
        number(min_latency_ms), number(max_latency_ms), q.replace("\x00", "")[:200] or None)
    size = d.settings.web_page_size
    page = data.list_routes(d.engine, flt, limit=size, offset=offset)
    given = {"workspace": workspace, "protocol": protocol, "alive": alive, "anonymity": anonymity,
             "min_latency_ms": min_latency_ms, "max_latency_ms": max_latency_ms, "q": q}
    args = {k: v for k, v in given.items() if v}
    prev_url = f"/routes?{urlencode(dict(args, offset=max(0, offset - size)))}" if offset > 0 else None
    next_url = (f"/routes?{urlencode(dict(args, offset=offset + size))}"
                if offset + size < page["total"] else None)
    return _page(request, "routes.html", "Routes", page=page, f=args, offset=offset, size=size,
                 workspaces=data.workspaces(d.engine), protocols=data.PROTOCOLS, alives=data.ALIVE,
                 anonymities=data.ANONYMITY, prev_url=prev_url, next_url=next_url)


@router.get("/routes/{route_hash}", response_class=HTMLResponse)
def route(request: Request, route_hash: Annotated[str, Path(pattern=r"^[0-9a-f]{24}$")]):
    d = request.app.state.dashboard
    got = d.route(route_hash)
    if got is None:
        return _page(request, "error.html", "Unknown route", status_code=404,
                     message=f"no route {route_hash}")
    hist = list(reversed(got["history"]))
    chart = line_chart({"latency ms": [(h["checked_at"].timestamp() * 1000, h["latency_ms"]) for h in hist]},
                       title="Latency of recent checks", unit=" ms")
    return _page(request, "route.html", f"Route {route_hash}", h=route_hash, chart=chart, **got)


@router.get("/alerts", response_class=HTMLResponse)
def alerts(request: Request):
    d = request.app.state.dashboard
    return _page(request, "alerts.html", "Alerts", incidents=data.incidents(d.engine, open_only=True),
                 deliveries=data.deliveries(d.engine, 50))


@router.get("/rotators", response_class=HTMLResponse)
def rotators(request: Request):
    rows = request.app.state.dashboard.rotators()
    return _page(request, "rotators.html", "Rotators", rows=rows, counts=fleet.rotator_counts(rows))


@router.get("/instances", response_class=HTMLResponse)
def instances(request: Request, role: Annotated[str, Query(max_length=64)] = ""):
    got = request.app.state.dashboard.instances(role or None)
    groups: dict[str, list[dict]] = {}
    for v in got["instances"]:
        groups.setdefault(v["role"], []).append(v)
    return _page(request, "instances.html", "Instances", groups=groups, by_role=got["by_role"],
                 role=role, total=sum(got["by_role"].values()))


@router.get("/health", response_class=HTMLResponse)
def health(request: Request):
    return _page(request, "health.html", "Health", rep=request.app.state.dashboard.health())


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request):
    s = request.app.state.dashboard.settings
    plain = (request.url.scheme == "http" and s.web_cookie_secure
             and not is_loopback(request.url.hostname or ""))
    return _page(request, "login.html", "Sign in", plain_http=plain)


async def _form(request: Request) -> dict[str, str]:
    body = (await request.body())[:16_384].decode("utf-8", "replace")
    return {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}


def _back(target: str) -> str:
    """A same-site path to return to (anything else goes to ``/``)."""
    return target if target.startswith("/") and not target.startswith("//") and "\\" not in target else "/"


def _redirect(target: str, message: str, ok: bool) -> RedirectResponse:
    base = _back(target).split("?", 1)
    query = parse_qs(base[1]) if len(base) > 1 else {}
    query = {k: v[0] for k, v in query.items() if k not in ("flash", "ok", "sig")}
    flag = "1" if ok else "0"
    query.update(flash=message, ok=flag, sig=_flash_sig(message, flag))
    return RedirectResponse(f"{base[0]}?{urlencode(query)}", status_code=303)


@router.post("/login")
async def login(request: Request):
    form = await _form(request)
    state = request.app.state
    settings = state.dashboard.settings
    client = request.client.host if request.client else "?"
    wait = state.login_throttle.blocked(client)
    if wait > 0:
        state.login_log.failed(client, blocked=True)
        return _redirect("/login", f"too many failed sign-ins from this address: try again in {wait:.0f} s", False)
    if not token_matches(settings.web_token, form.get("token")):
        state.login_throttle.failed(client)
        state.login_log.failed(client)
        return _redirect("/login", "the token does not match MAGPIE_WEB_TOKEN", False)
    state.login_throttle.succeeded(client)
    sid = await run_in_threadpool(state.sessions.create)
    resp = _redirect("/", "signed in", True)
    resp.set_cookie(COOKIE, sid, max_age=int(settings.web_session_ttl), path="/", httponly=True, samesite="strict",
                    secure=bool(settings.web_cookie_secure))
    return resp


@router.post("/logout")
async def logout(request: Request):
    settings = request.app.state.dashboard.settings
    await run_in_threadpool(request.app.state.sessions.revoke, request.cookies.get(COOKIE))
    resp = _redirect("/login", "signed out", True)
    resp.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict", secure=bool(settings.web_cookie_secure))
    return resp


ACTIONS = ("pause", "resume", "reprocess", "check-now")


@router.post("/ui/actions/{name}")
async def ui_action(request: Request, name: str):
    form = await _form(request)
    d = request.app.state.dashboard
    back = form.get("next", "/")
    member = form.get("member", "")
    try:
        if name not in ACTIONS:
            return _redirect(back, f"unknown action {name[:40]!r}", False)
        require_action_token(d.settings.web_token, form.get("token"))
        if name in ("reprocess", "check-now") and not data.is_route_hash(member):
            return _redirect(back, "no route hash given", False)
        if name == "pause":
            message = d.pause()
        elif name == "resume":
            message = d.resume()
        elif name == "reprocess":
            message = f"route {member} reprocessed, due {_when(d.reprocess(member))} UTC"
        else:
            message = f"route {member} due {_when(d.check_now(member))} UTC"
    except AuthRefused as exc:
        return _redirect(back, f"refused: {exc.detail}", False)
    except RefusedError as exc:
        return _redirect(back, f"refused: {exc}", False)
    return _redirect(back, message, True)


__all__ = ["router", "templates"]
