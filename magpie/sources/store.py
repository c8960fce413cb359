"""The operator's records of proxy-list sources: add, list, remove, and the redacted form of a URL.

A source is an ``http(s)`` URL, one workspace, an import ``format`` and a period (``--every``). The URL is
stored encrypted (it may carry ``user:password@`` or a token in its query); everything printed uses
:func:`shown_url`, which masks the user information and the values of query parameters that look like
secrets.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.errors import MagpieError

MIN_EVERY = 60
MAX_EVERY = 30 * 86400
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", re.IGNORECASE)
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SECRET_PARAM = re.compile(r"token|key|secret|pass|auth|sig|session|credential", re.IGNORECASE)
MASK = "***"


class SourceError(MagpieError, ValueError):
    """A source cannot be added, found or changed; the message says why in one line (never a secret)."""


def parse_every(text: str) -> int:
    """Seconds of a period such as ``6h``, ``30m``, ``1d``, ``90s`` or ``3600``.

    Raises :class:`SourceError` for another form, or outside 60 s .. 30 days."""
    m = _DURATION.fullmatch(text or "")
    if not m:
        raise SourceError(f"bad period {text!r}: a number with an optional unit s, m, h, d or w (e.g. 6h)")
    seconds = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if not MIN_EVERY <= seconds <= MAX_EVERY:
        raise SourceError(f"period {text!r} is outside 1m .. 30d")
    return seconds


def format_every(seconds: int) -> str:
    """The shortest exact spelling of a period in seconds (``21600`` -> ``6h``)."""
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def shown_url(url: str) -> str:
    """``url`` as it may be printed: user information replaced by ``***@`` and the values of query
    parameters whose names suggest a secret (``token``, ``api_key``, ``password``, ``sig``...) by ``***``.
    A URL that does not parse is shown as ``<unparsable URL>``."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparsable URL>"
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    if parts.username is not None or parts.password is not None:
        netloc = f"{MASK}@{netloc}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_SECRET_PARAM.search(k) for k, _ in pairs):
            query = urlencode([(k, MASK if _SECRET_PARAM.search(k) else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def check_url(url: str, settings=None) -> str:
    """Validate a source URL: ``http``/``https`` with a host and a valid port; when ``settings`` is given an
    IP-literal or ``localhost`` host is checked against ``MAGPIE_SOURCE_ALLOW_PRIVATE`` now. Returns the URL
    without a fragment. Raises :class:`SourceError`, or :class:`magpie.base.egress.EgressRefused`."""
    url = (url or "").strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a bad port
    except ValueError as exc:
        raise SourceError(f"malformed URL {shown_url(url)}: {exc}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise SourceError("a source URL must start with http:// or https://")
    if not parts.hostname:
        raise SourceError("the source URL has no host")
    if any(ord(ch) < 33 for ch in url):
        raise SourceError("the source URL must not hold spaces or control characters")
    if settings is not None:
        from magpie.base.egress import EgressPolicy

        EgressPolicy(settings.source_allow_private, "MAGPIE_SOURCE_ALLOW_PRIVATE").check_host(parts.hostname)
    return urlunsplit((parts.scheme.lower(), parts.netloc, parts.path, parts.query, ""))


def url_key(url: str, secret: str) -> str:
    """Keyed hash of a URL (HMAC-SHA256 under ``PROXY_ENCRYPTION_KEY``, hex): equal URLs, equal keys."""
    return hmac.new(secret.encode(), b"list-source-url:" + url.encode(), hashlib.sha256).hexdigest()


_COLUMNS = """s.id, w.name AS workspace, s.url_shown AS url, s.format, s.protocol, s.every_s, s.browser,
    s.ignore_robots, s.last_fetch_at, s.last_status, s.last_error, s.last_bytes, s.last_valid,
    s.last_imported, s.last_invalid, s.last_ok_at, s.consecutive_failures, s.dead_lettered, s.dead_lettered_at,
    s.etag IS NOT NULL OR s.last_modified IS NOT NULL AS conditional"""


def add_source(engine: Engine, settings, url: str, workspace: str, every_s: int, *, fmt: str = "auto",
               protocol: str = "http", browser: bool = False, ignore_robots: bool = False) -> dict:
    """Add a source (the workspace is created when missing). The same URL in the same workspace is not
    added twice: its options are updated and it is taken off the dead-letter list.

    Args:
        url: ``http(s)`` URL, may carry ``user:password@`` (sent as Basic authentication).
        every_s: period in seconds (:func:`parse_every`).
        fmt: :data:`magpie.importer.formats.FORMATS`. protocol: scheme of lines without one.
    Returns:
        the source as :func:`list_sources` gives it.
    Raises:
        SourceError: bad URL, workspace, format, protocol or period. :class:`magpie.base.egress.EgressRefused`.
    """
    from magpie.base.crypto import get_keyring
    from magpie.base.protocols import PROTOCOLS
    from magpie.importer.formats import FORMATS

    url = check_url(url, settings)
    if fmt not in FORMATS:
        raise SourceError(f"format must be one of {', '.join(FORMATS)}")
    if protocol not in PROTOCOLS:
        raise SourceError(f"protocol must be one of {', '.join(PROTOCOLS)}")
    if not MIN_EVERY <= int(every_s) <= MAX_EVERY:
        raise SourceError("period must be within 1m .. 30d")
    workspace = (workspace or "").strip()
    if not workspace or any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in workspace):
        raise SourceError("workspace name must not be empty nor hold control characters")
    keyring = get_keyring(settings.encryption_key)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO workspaces (name) VALUES (:w) ON CONFLICT (name) DO NOTHING"),
                     {"w": workspace})
        wid = conn.execute(sa.text("SELECT id FROM workspaces WHERE name = :w"), {"w": workspace}).scalar_one()
        sid = conn.execute(sa.text(
            "INSERT INTO list_sources (workspace_id, url_enc, url_shown, url_key, format, protocol, every_s, "
            "browser, ignore_robots) VALUES (:w, :enc, :shown, :key, :f, :p, :e, :b, :i) "
            "ON CONFLICT (workspace_id, url_key) DO UPDATE SET format = EXCLUDED.format, "
            "protocol = EXCLUDED.protocol, every_s = EXCLUDED.every_s, browser = EXCLUDED.browser, "
            "ignore_robots = EXCLUDED.ignore_robots, dead_lettered = false, dead_lettered_at = NULL, "
            "consecutive_failures = 0 RETURNING id"),
            {"w": wid, "enc": keyring.encrypt(url), "shown": shown_url(url),
             "key": url_key(url, settings.encryption_key), "f": fmt, "p": protocol, "e": int(every_s),
             "b": bool(browser), "i": bool(ignore_robots)}).scalar_one()
    return get_source(engine, sid)


def list_sources(engine: Engine, workspace: str | None = None) -> list[dict]:
    """Every source (of ``workspace`` when given), by id: ``id``, ``workspace``, ``url`` (redacted),
    ``format``, ``protocol``, ``every`` (``6h``), ``every_s``, ``browser``, ``ignore_robots``, the last
    fetch (``last_fetch_at``, ``last_status``: ``ok``/``not_modified``/``error``, ``last_error``,
    ``last_bytes``, ``last_valid``, ``last_imported``, ``last_invalid``, ``last_ok_at``),
    ``consecutive_failures``, ``dead_lettered``, ``dead_lettered_at``, ``conditional`` (validators kept)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            f"SELECT {_COLUMNS} FROM list_sources s JOIN workspaces w ON w.id = s.workspace_id "
            "WHERE CAST(:w AS text) IS NULL OR w.name = :w ORDER BY s.id"), {"w": workspace}).mappings().all()
    return [dict(r, every=format_every(r["every_s"])) for r in rows]


def get_source(engine: Engine, source_id: int) -> dict:
    """One source as :func:`list_sources` gives it; raises :class:`SourceError` when there is none."""
    with engine.connect() as conn:
        row = conn.execute(sa.text(
            f"SELECT {_COLUMNS} FROM list_sources s JOIN workspaces w ON w.id = s.workspace_id "
            "WHERE s.id = :i"), {"i": int(source_id)}).mappings().first()
    if row is None:
        raise SourceError(f"no source {source_id}")
    return dict(row, every=format_every(row["every_s"]))


def remove_source(engine: Engine, source_id: int) -> bool:
    """Delete source ``source_id`` and its route links (the routes stay in their workspace); True when it
    existed. Its schedule entry goes at the next sync (:func:`magpie.sources.runner.sync_schedule`)."""
    with engine.begin() as conn:
        return conn.execute(sa.text("DELETE FROM list_sources WHERE id = :i"), {"i": int(source_id)}).rowcount > 0


def source_stats(engine: Engine, workspace: str | None = None) -> list[dict]:
    """Per source, live: ``id``, ``workspace``, ``url`` (redacted), ``routes`` (linked routes still in the
    source's workspace), ``alive`` (of those, alive at their latest check), ``checked``, ``alive_pct``
    (0-100 of ``routes``, None without routes), ``last_status``, ``dead_lettered``."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text("""
            SELECT s.id, w.name AS workspace, s.url_shown AS url, count(rw.route_id) AS routes,
                   count(*) FILTER (WHERE h.alive) AS alive, count(h.last_checked_at) AS checked,
                   s.last_status, s.dead_lettered
            FROM list_sources s JOIN workspaces w ON w.id = s.workspace_id
            LEFT JOIN list_source_routes l ON l.source_id = s.id
            LEFT JOIN route_workspaces rw ON rw.route_id = l.route_id AND rw.workspace_id = s.workspace_id
            LEFT JOIN route_health h ON h.route_id = rw.route_id
            WHERE CAST(:w AS text) IS NULL OR w.name = :w
            GROUP BY s.id, w.name ORDER BY s.id"""), {"w": workspace}).mappings().all()
    out = []
    for r in rows:
        d = dict(r)
        d["alive_pct"] = round(100.0 * d["alive"] / d["routes"], 1) if d["routes"] else None
        out.append(d)
    return out


__all__ = ["SourceError", "add_source", "check_url", "format_every", "get_source", "list_sources",
           "parse_every", "remove_source", "shown_url", "source_stats", "url_key"]
