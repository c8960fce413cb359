"""The dashboard's one credential: ``MAGPIE_WEB_TOKEN``, compared in constant time.

Operator actions need the token, always, given explicitly with each request (``Authorization: Bearer``
or the ``token`` field of an action form), never taken from a cookie, so a page of another site cannot
make a browser act (no cross-site request forgery). With no token configured every action is refused
with :data:`ACTIONS_OFF`. Reads are open on a loopback bind; on any other bind they need the token too
(a header, or a session: the sign-in form checks the token and sets the :data:`COOKIE` session cookie,
which holds a random session id, never the token; :class:`Sessions` keeps them in Redis with a lifetime).

Every request's ``Host`` header must name the dashboard (:func:`allowed_hosts`), so a page whose own name
was rebound to a loopback address cannot read it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

from magpie.errors import MagpieError

COOKIE = "magpie_web_session"
"""Session cookie for reads on a non-loopback bind: a random id (HttpOnly, SameSite=Strict, Secure unless
``MAGPIE_WEB_COOKIE_SECURE`` is false, ``Max-Age`` ``MAGPIE_WEB_SESSION_TTL``)."""

ACTIONS_OFF = ("operator actions are disabled: set MAGPIE_WEB_TOKEN (16 or more characters) and restart "
               "magpie web")


class AuthRefused(MagpieError):
    """A request without the right token.

    Attributes:
        status: HTTP status (401: no or wrong token; 403: actions disabled). code: ``token_required``,
        ``bad_token`` or ``actions_disabled``. detail: one line for the user.
    """

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


def token_matches(configured: str | None, presented: str | None) -> bool:
    """True when ``presented`` equals ``configured`` (constant-time compare); False if either is empty."""
    if not configured or not presented:
        return False
    return hmac.compare_digest(configured.encode("utf-8"), presented.encode("utf-8"))


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, or None."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return (value.strip() or None) if scheme.lower() == "bearer" else None


def require_action_token(configured: str | None, presented: str | None) -> None:
    """Allow an operator action, or raise :class:`AuthRefused` (403 when no token is configured, 401 when
    ``presented`` is missing or wrong)."""
    if not configured:
        raise AuthRefused(403, "actions_disabled", ACTIONS_OFF)
    if not presented:
        raise AuthRefused(401, "token_required", "this action needs the MAGPIE_WEB_TOKEN token")
    if not token_matches(configured, presented):
        raise AuthRefused(401, "bad_token", "the token does not match MAGPIE_WEB_TOKEN")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ``::1``."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(settings) -> list[str]:
    """``Host`` names the dashboard answers: ``MAGPIE_WEB_ALLOWED_HOSTS`` when set, else the bound address
    (bracketed when IPv6) and ``localhost``; ``["*"]`` (any) on a wildcard bind, where reads need the
    token anyway."""
    if settings.web_allowed_hosts:
        return [h.strip().lower() for h in settings.web_allowed_hosts.split(",") if h.strip()]
    host = settings.web_host.strip().strip("[]").lower()
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return [host, "localhost"]
    if ip.is_unspecified:
        return ["*"]
    return [f"[{ip}]" if ip.version == 6 else str(ip), "localhost"]


class Sessions:
    """Dashboard sign-ins, kept in Redis as ``<prefix>web:session:<sha256 of the id>`` with a TTL.

    A session is bound to the token it was opened with: changing ``MAGPIE_WEB_TOKEN`` ends every session.

    Args:
        redis: a redis-py client. prefix: ``MAGPIE_REDIS_PREFIX``. ttl_s: lifetime, seconds.
        token: ``MAGPIE_WEB_TOKEN`` (None: no session is ever valid).
    Methods raise ``redis.RedisError`` when Redis is away.
    """

    def __init__(self, redis, prefix: str, ttl_s: float, token: str | None):
        self.redis, self.prefix, self.ttl_s = redis, prefix, float(ttl_s)
        self._mark = (hmac.new(token.encode(), b"magpie web session", hashlib.sha256).hexdigest()
                      if token else None)

    def _key(self, sid: str) -> str:
        return f"{self.prefix}web:session:{hashlib.sha256(sid.encode()).hexdigest()}"

    def create(self) -> str:
        """Open a session; returns its id (the cookie value, 43 URL-safe characters)."""
        sid = secrets.token_urlsafe(32)
        self.redis.set(self._key(sid), self._mark or "", px=int(self.ttl_s * 1000))
        return sid

    def valid(self, sid: str | None) -> bool:
        """True when ``sid`` is an open, unexpired session of the current token."""
        if not sid or self._mark is None or len(sid) > 100:
            return False
        got = self.redis.get(self._key(sid))
        if got is None:
            return False
        got = got.decode() if isinstance(got, bytes) else got
        return hmac.compare_digest(got, self._mark)

    def revoke(self, sid: str | None) -> None:
        """End session ``sid`` (no error when there is none)."""
        if sid and len(sid) <= 100:
            self.redis.delete(self._key(sid))


__all__ = ["ACTIONS_OFF", "COOKIE", "AuthRefused", "Sessions", "allowed_hosts", "bearer", "is_loopback",
           "require_action_token", "token_matches"]
