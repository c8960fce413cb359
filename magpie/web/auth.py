"""The dashboard's one credential: ``MAGPIE_WEB_TOKEN``, compared in constant time.

Operator actions need the token, always, given explicitly with each request (``Authorization: Bearer``
or the ``token`` field of an action form), never taken from a cookie, so a page of another site cannot
make a browser act (no cross-site request forgery). With no token configured every action is refused
with :data:`ACTIONS_OFF`. Reads are open on a loopback bind; on any other bind they need the token too
(a header, or the ``magpie_web_token`` cookie that the sign-in form sets).
"""

from __future__ import annotations

import hmac
import ipaddress

from magpie.errors import MagpieError

COOKIE = "magpie_web_token"
"""Cookie holding the token for reads on a non-loopback bind (HttpOnly, SameSite=Strict)."""

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


__all__ = ["ACTIONS_OFF", "COOKIE", "AuthRefused", "bearer", "is_loopback", "require_action_token",
           "token_matches"]
