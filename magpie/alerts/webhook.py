"""Webhook targets and one signed POST.

Target policy: a webhook URL must be ``http`` or ``https`` with a host and no credentials. Its host is
resolved (an IP literal is taken as is) and *every* resolved address is checked by the shared egress guard
(:class:`magpie.base.egress.EgressPolicy`, the one checks use): loopback, private, shared/CGNAT, link-local,
reserved, IPv6 unique-local and link-local addresses, and IPv6 forms embedding such an IPv4 address
(mapped, compatible, 6to4, NAT64, Teredo), are refused unless ``MAGPIE_WEBHOOK_ALLOW_PRIVATE`` allows them
(``true`` for all, or CIDRs such as ``10.0.0.0/8,::1``); multicast and unspecified are refused always.
The check runs when a channel is created and again before every send, and the POST connects to an address
that passed the check (no second resolution an attacker's DNS could answer differently), with ``Host`` and
TLS server name set to the URL's host.

Request: ``POST`` with the JSON body; headers ``Content-Type: application/json``,
``X-Magpie-Delivery-ID`` (stable across retries of one delivery), ``X-Magpie-Event``,
``X-Magpie-Attempt`` and ``X-Magpie-Signature: sha256=<hex>`` = HMAC-SHA256 of the exact body bytes with
the channel's secret. Any 2xx reply is success; redirects are not followed (a 3xx counts as failure).

Receivers must deduplicate by ``X-Magpie-Delivery-ID``: a delivery is at least once. If the receiver
accepts the body and the reply is lost (crash, dropped connection, timeout), magpie cannot tell and sends
the same delivery again with the same id and body.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import certifi
import urllib3

from magpie.base.egress import EgressPolicy
from magpie.errors import MagpieError

SIGNATURE_HEADER = "X-Magpie-Signature"
DELIVERY_ID_HEADER = "X-Magpie-Delivery-ID"
USER_AGENT = "magpie-webhook/1"


class WebhookRefused(MagpieError, ValueError):
    """The webhook URL is malformed or resolves to an address the policy refuses."""


def sign(secret: str, body: bytes) -> str:
    """Signature header value for ``body``: ``"sha256=" + hex(HMAC-SHA256(secret, body))``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, header: str) -> bool:
    """Constant-time check of a received signature header (for receivers and tests)."""
    return hmac.compare_digest(sign(secret, body), header or "")


AllowPrivate = bool | str | EgressPolicy
"""``MAGPIE_WEBHOOK_ALLOW_PRIVATE`` as a bool, its text (``true``/``false``/CIDRs) or a ready policy."""


@functools.lru_cache(maxsize=32)
def _policy_for(allow: bool | str) -> EgressPolicy:
    try:
        return EgressPolicy(allow, "MAGPIE_WEBHOOK_ALLOW_PRIVATE")
    except ValueError as exc:
        raise WebhookRefused(f"MAGPIE_WEBHOOK_ALLOW_PRIVATE: {exc}") from None


def webhook_policy(allow_private: AllowPrivate) -> EgressPolicy:
    """The egress policy for webhook targets (refusals name ``MAGPIE_WEBHOOK_ALLOW_PRIVATE``).

    Raises :class:`WebhookRefused` for a malformed allow-list.
    """
    if isinstance(allow_private, EgressPolicy):
        return allow_private
    return _policy_for(allow_private if isinstance(allow_private, bool) else str(allow_private).strip())


def _literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Target:
    """A checked webhook target: ``addresses`` are the resolved IPs (all allowed), in resolver order."""

    scheme: str
    host: str
    port: int
    path: str
    addresses: tuple[str, ...]

    @property
    def host_header(self) -> str:
        """``Host`` header value: the host (IPv6 in brackets) plus ``:port`` unless it is the default."""
        h = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return h if self.port == default else f"{h}:{self.port}"


def check_target(url: str, *, allow_private: AllowPrivate, resolve=socket.getaddrinfo) -> Target:
    """Parse ``url``, resolve its host and check every address against the policy.

    Args:
        url: ``http(s)://host[:port]/path?query``.
        allow_private: ``MAGPIE_WEBHOOK_ALLOW_PRIVATE`` (see :func:`webhook_policy`).
        resolve: ``getaddrinfo``-compatible resolver (injectable for tests); not called for an IP literal.
    Returns:
        A :class:`Target`.
    Raises:
        WebhookRefused: bad scheme/host/port, credentials in the URL, a resolution failure, or any
        resolved address the policy refuses (the message names it).
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise WebhookRefused(f"malformed webhook URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise WebhookRefused("webhook URL must be http:// or https://")
    if not parts.hostname:
        raise WebhookRefused("webhook URL has no host")
    if parts.username is not None or parts.password is not None:
        raise WebhookRefused("webhook URL must not carry credentials")
    host = parts.hostname
    port = port or (443 if parts.scheme == "https" else 80)
    policy = webhook_policy(allow_private)
    literal = _literal(host)
    if literal is not None:
        resolved = [literal]
    else:
        try:
            resolved = [info[4][0] for info in resolve(host, port, type=socket.SOCK_STREAM)]
        except (OSError, UnicodeError) as exc:
            raise WebhookRefused(f"cannot resolve webhook host {host!r}: {exc}") from None
    addrs: list[str] = []
    for raw in resolved:
        ip = str(ipaddress.ip_address(raw.split("%", 1)[0]))
        why = policy.refusal(ip)
        if why:
            where = "webhook target refused" if literal else f"webhook host {host!r} resolves to a refused address"
            raise WebhookRefused(f"{where}: {why}")
        if ip not in addrs:
            addrs.append(ip)
    if not addrs:
        raise WebhookRefused(f"webhook host {host!r} resolves to no address")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, host, port, path, tuple(addrs))


@dataclass(frozen=True, slots=True)
class PostResult:
    """Outcome of one POST: ``ok`` (2xx), the HTTP ``status`` if a reply arrived, and an ``error`` text."""

    ok: bool
    status: int | None = None
    error: str | None = None


def post(url: str, body: bytes, headers: dict[str, str], *, timeout: float, allow_private: AllowPrivate,
         resolve=socket.getaddrinfo) -> PostResult:
    """POST ``body`` to ``url`` after :func:`check_target`, connecting to the checked address.

    Args:
        url: the channel URL. body: exact bytes to send. headers: extra headers (delivery id, signature...).
        timeout: seconds, for connecting and for reading the reply.
        allow_private: see :func:`check_target`.
    Returns:
        :class:`PostResult`; network errors are returned, not raised.
    Raises:
        WebhookRefused: the target fails the policy now (the caller fails the delivery).
    """
    target = check_target(url, allow_private=allow_private, resolve=resolve)
    ip = target.addresses[0]
    tmo = urllib3.Timeout(connect=timeout, read=timeout)
    if target.scheme == "https":
        pool = urllib3.HTTPSConnectionPool(ip, target.port, timeout=tmo, retries=False, maxsize=1,
                                           cert_reqs="CERT_REQUIRED", ca_certs=certifi.where(),
                                           server_hostname=target.host, assert_hostname=target.host)
    else:
        pool = urllib3.HTTPConnectionPool(ip, target.port, timeout=tmo, retries=False, maxsize=1)
    hdrs = {"Host": target.host_header, "Content-Type": "application/json", "User-Agent": USER_AGENT,
            "Connection": "close", **headers}
    try:
        resp = pool.urlopen("POST", target.path, body=body, headers=hdrs, redirect=False, retries=False,
                            preload_content=False, assert_same_host=False)
        try:
            resp.read(4096)
        except (urllib3.exceptions.HTTPError, OSError):
            pass
        finally:
            resp.release_conn()
        status = resp.status
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        return PostResult(False, None, f"{exc.__class__.__name__}: {exc}"[:500])
    finally:
        pool.close()
    if 200 <= status < 300:
        return PostResult(True, status)
    return PostResult(False, status, f"HTTP {status}")


def encode_payload(payload: dict) -> str:
    """Canonical JSON text of a webhook payload (sorted keys, compact); stored and signed as is."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
