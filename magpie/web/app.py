"""The dashboard application: :func:`create_app` builds the FastAPI app that ``magpie web`` serves.

Everything the browser loads comes from the app itself (templates, ``/static``, charts as inline SVG);
the interactive OpenAPI pages, which would load scripts from elsewhere, are off: the document itself is
at ``/api/openapi.json``.
"""

from __future__ import annotations

import logging
import math
import socket
from contextlib import asynccontextmanager

import redis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy import exc as sa_exc
from starlette.concurrency import run_in_threadpool
from starlette.middleware.trustedhost import TrustedHostMiddleware

from magpie.apitokens.ratelimit import take
from magpie.apitokens.store import SECRET_PREFIX, WEB_ADMIN, authenticate
from magpie.apitokens.store import Refused as TokenRefused
from magpie.errors import MagpieError, RefusedError
from magpie.coordination.throttle import FailureLog, FailureThrottle
from magpie.web import api, bulk, pages, program
from magpie.web.auth import COOKIE, AuthRefused, Sessions, allowed_hosts, bearer, is_loopback, token_matches
from magpie.web.service import Dashboard

log = logging.getLogger(__name__)

_OPEN_PATHS = ("/login", "/logout", "/static/")


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def _unavailable(request: Request, message: str):
    if _wants_json(request):
        return JSONResponse({"detail": message}, status_code=503)
    return pages.templates.TemplateResponse(request, "error.html", {
        "title": "Unavailable", "message": message, "flash": None, "ok": None, "actions_enabled": False,
        "path": request.url.path, "here": request.url.path}, status_code=503)


def create_app(settings, *, dashboard: Dashboard | None = None, reads_need_token: bool | None = None,
               sample: bool = True) -> FastAPI:
    """Build the dashboard app.

    Args:
        settings: :class:`magpie.config.Settings` (``MAGPIE_WEB_*``, Redis, PostgreSQL).
        dashboard: the clients to use (default a :class:`Dashboard` of ``settings``).
        reads_need_token: pages and reads need the token too (default: when ``MAGPIE_WEB_HOST`` is not
            a loopback address).
        sample: run the chart sampler (:class:`magpie.observability.samples.Sampler`) while the app serves.
    Returns:
        The FastAPI app; ``app.state.dashboard`` is the :class:`Dashboard`, ``app.state.sessions`` the
        :class:`magpie.web.auth.Sessions`, ``app.state.login_throttle`` the per-address backoff of failed
        sign-ins. Requests whose ``Host`` is not in :func:`magpie.web.auth.allowed_hosts` get 400.
    """
    dash = dashboard or Dashboard(settings)
    need = (not is_loopback(settings.web_host)) if reads_need_token is None else reads_need_token

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sampler = None
        if sample:
            from magpie.observability.samples import Sampler

            sampler = Sampler(dash.redis, settings.redis_prefix, dash.queue,
                              interval_s=settings.web_sample_interval, keep=settings.web_sample_keep).start()
        try:
            yield
        finally:
            if sampler is not None:
                sampler.stop()

    app = FastAPI(title="magpie dashboard", version="1", lifespan=lifespan, openapi_url="/api/openapi.json",
                  docs_url=None, redoc_url=None,
                  description="The schedule, its results, operator actions and the program API. Actions "
                              "need `Authorization: Bearer <MAGPIE_WEB_TOKEN>` or an admin API token; "
                              "API tokens (`magpie tokens create`) are scoped to a workspace and a role.")
    app.state.dashboard = dash
    app.state.reads_need_token = need
    app.state.sessions = Sessions(dash.redis, settings.redis_prefix, settings.web_session_ttl, settings.web_token)
    app.state.login_throttle = FailureThrottle()
    app.state.login_log = FailureLog(log, "dashboard: failed sign-ins")
    app.state.resolve = socket.getaddrinfo  # name resolution of import URLs (tests give a stub)
    app.include_router(program.router)
    limited = {429: program.AUTH_REFUSALS[429]}  # any bearer token is rate limited, MAGPIE_WEB_TOKEN too
    app.include_router(api.router, dependencies=[Depends(api.dashboard_scope)], responses=limited)
    app.include_router(bulk.router, dependencies=[Depends(api.dashboard_scope)], responses=limited)
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(packages=[("magpie.web", "static")]), name="static")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        request.state.principal = None
        if _wants_json(request):
            try:
                answer = await _api_principal(request)
            except (redis.RedisError, sa_exc.SQLAlchemyError) as exc:
                return await storage(request, exc)
            except MagpieError as exc:  # e.g. another PROXY_ENCRYPTION_KEY than the database's
                return _unavailable(request, str(exc))
            if answer is not None:
                return answer
        if need and not path.startswith(_OPEN_PATHS):
            ok = request.state.principal is not None or \
                token_matches(settings.web_token, bearer(request.headers.get("authorization")))
            if not ok and request.cookies.get(COOKIE):
                try:
                    ok = await run_in_threadpool(app.state.sessions.valid, request.cookies.get(COOKIE))
                except redis.RedisError as exc:
                    return await storage(request, exc)
            if not ok:
                if _wants_json(request):
                    return JSONResponse({"ok": False, "refused": "token_required", "member": None,
                                         "detail": "reads need a token on this address (MAGPIE_WEB_TOKEN or an API token)"},
                                        status_code=401)
                return RedirectResponse("/login", status_code=303)
        response = await call_next(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        response.headers.setdefault("Content-Security-Policy",
                                    "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                    "frame-ancestors 'none'; form-action 'self'")
        return response

    async def _api_principal(request: Request):
        """Resolve ``Authorization: Bearer`` on an ``/api`` request into ``request.state.principal`` and
        take one request from its rate limit; returns the refusal to send (401, 429), or None."""
        presented = bearer(request.headers.get("authorization"))
        if presented is None:
            return None
        d = request.app.state.dashboard
        conf = d.settings
        if token_matches(settings.web_token, presented):
            principal = WEB_ADMIN
        elif presented.startswith(SECRET_PREFIX):
            try:
                principal = await run_in_threadpool(authenticate, d.engine, presented)
            except TokenRefused as exc:
                return JSONResponse({"ok": False, "refused": exc.code, "detail": exc.detail, "member": None},
                                    status_code=401)
        else:
            return None  # not an API token: the dashboard's own token checks answer
        wait = await run_in_threadpool(take, d.redis, conf.redis_prefix, principal.key, principal.role,
                                       rate=conf.api_rate, burst=conf.api_burst)
        if wait is not None:
            return JSONResponse({"ok": False, "refused": "rate_limited", "member": None,
                                 "detail": f"rate limit of {conf.api_rate:g} requests/s (burst "
                                           f"{conf.api_burst}) reached: retry in {wait:.3f} s"},
                                status_code=429, headers={"Retry-After": str(max(1, math.ceil(wait)))})
        request.state.principal = principal
        return None

    @app.exception_handler(AuthRefused)
    async def auth_refused(request: Request, exc: AuthRefused):
        return JSONResponse({"ok": False, "refused": exc.code, "detail": exc.detail, "member": None},
                            status_code=exc.status)

    @app.exception_handler(RefusedError)
    async def refused(request: Request, exc: RefusedError):
        return JSONResponse({"ok": False, "refused": exc.label, "detail": str(exc),
                             "member": exc.subject or None}, status_code=409)

    @app.exception_handler(MagpieError)
    async def magpie_error(request: Request, exc: MagpieError):
        return _unavailable(request, str(exc))

    async def storage(request: Request, exc: Exception):
        from magpie.errors import storage_error

        message = storage_error(exc)
        if message is None:  # another database error: a bug, logged with its traceback
            log.error("dashboard request failed: %s", request.url.path, exc_info=exc)
            message = "database error (see the magpie web log)"
        return _unavailable(request, message)

    app.add_exception_handler(redis.RedisError, storage)
    app.add_exception_handler(sa_exc.SQLAlchemyError, storage)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(settings))

    return app


__all__ = ["create_app"]
