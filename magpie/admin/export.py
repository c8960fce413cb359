"""Export a workspace's routes with their current health, streamed from PostgreSQL.

:func:`stream_export` reads the routes of one workspace that pass an :class:`ExportFilter` through a
server-side cursor (a psycopg2 named cursor, :data:`FETCH_ROWS` rows a round trip), so memory stays flat
however many routes match, and yields text chunks, each one or more whole lines:

* ``txt``: ``host:port`` (``user:pass@host:port`` with credentials, percent-encoded);
* ``url``: ``scheme://[user:pass@]host:port`` (credentials percent-encoded);
* ``csv``: a header line, then one row a route (:data:`COLUMNS`, ``username``/``password`` after
  ``port`` with credentials);
* ``jsonl``: one JSON object a line (the :data:`COLUMNS` keys, plus ``url``);
* ``json``: one JSON array of those objects, streamed (``[`` first, ``]`` last).

Every format re-imports with ``magpie import``. What a row holds comes from ``route_health`` (newest check:
``alive``, ``latency_ms``, ``anonymity``, ``last_checked_at``, the exit address ``exit_ip`` and its
``exit_country``), ``route_enrichment`` (``country`` of the entry address) and ``route_reputation``
(``score``, 0-100). Rows come in route id order.

Credentials are stored encrypted (:meth:`magpie.base.crypto.Keyring.encrypt`) and left out unless asked for;
asking writes an audit line on the ``magpie.audit`` logger when the stream starts and when it ends, naming
the workspace, the format and how many routes went out with credentials (never a secret). A route whose
credentials do not decrypt under this ``PROXY_ENCRYPTION_KEY`` is left out of such an export (counted in
the closing line).
"""

from __future__ import annotations

import csv
import io
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from datetime import datetime
from json.encoder import encode_basestring_ascii as _quote
from urllib.parse import quote

from magpie.errors import MagpieError
from magpie.base.protocols import PROTOCOLS

log = logging.getLogger(__name__)
audit = logging.getLogger("magpie.audit")

FORMATS = ("txt", "url", "csv", "json", "jsonl")
"""Export formats."""

ANONYMITY = ("transparent", "anonymous", "elite")

COLUMNS = ("protocol", "host", "port", "alive", "latency_ms", "anonymity", "country", "exit_ip", "exit_country",
           "score", "last_checked_at")
"""Columns of the ``csv`` format and keys of the ``json``/``jsonl`` objects (credentials aside)."""

FETCH_ROWS = 5000
"""Rows fetched from the server-side cursor per round trip (one chunk is yielded per fetch)."""

_COUNTRY = re.compile(r"[A-Za-z]{2}")


class ExportError(MagpieError, ValueError):
    """A bad export request (unknown workspace or format, a filter value out of range); the message is one
    line naming what was wrong."""


def _items(name: str, value: str | None, allowed=None, upper=False) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = tuple(v.strip().lower() for v in str(value).split(",") if v.strip())
    if not items:
        raise ExportError(f"{name}: expected a value, got {value!r}")
    if allowed is not None:
        bad = [v for v in items if v not in allowed]
        if bad:
            raise ExportError(f"{name}: expected one or more of {', '.join(allowed)}, got {bad[0]!r}")
    if upper:
        bad = [v for v in items if not _COUNTRY.fullmatch(v)]
        if bad:
            raise ExportError(f"{name}: expected two-letter country codes such as DE,NL, got {bad[0]!r}")
        items = tuple(v.upper() for v in items)
    return items


@dataclass(frozen=True)
class ExportFilter:
    """Which routes of a workspace to export; every condition given must hold (None: no condition).

    Attributes:
        workspace: the workspace's name.
        alive: True: the newest check was alive; False: the newest check failed (never-checked routes pass
            neither).
        protocol: route protocol(s), comma-separated names of :data:`magpie.base.protocols.PROTOCOLS`.
        anonymity: level(s) of the newest check, comma-separated: transparent, anonymous, elite.
        country: two-letter code(s) of the entry address's country (GeoIP enrichment), comma-separated.
        max_latency_ms: newest latency at most this many milliseconds (> 0; routes without one fail).
        min_score: reputation score at least this (0-100; routes without a score fail).
        exit_country: two-letter code(s) of the country of the exit address the judge saw.

    Values are checked by :meth:`validate` (raises :class:`ExportError`).
    """

    workspace: str
    alive: bool | None = None
    protocol: str | None = None
    anonymity: str | None = None
    country: str | None = None
    max_latency_ms: float | None = None
    min_score: float | None = None
    exit_country: str | None = None

    def validate(self) -> dict:
        """The filter as SQL parameters, checked. Raises :class:`ExportError` naming the bad field."""
        if not isinstance(self.workspace, str) or not self.workspace.strip():
            raise ExportError("workspace: expected a workspace name")
        if self.alive not in (None, True, False):
            raise ExportError(f"alive: expected true, false or nothing, got {self.alive!r}")
        out: dict = {
            "protocol": _items("protocol", self.protocol, PROTOCOLS),
            "anonymity": _items("anonymity", self.anonymity, ANONYMITY),
            "country": _items("country", self.country, upper=True),
            "exit_country": _items("exit_country", self.exit_country, upper=True),
        }
        for name, lo, hi in (("max_latency_ms", 0.0, 1e9), ("min_score", 0.0, 100.0)):
            v = getattr(self, name)
            if v is None:
                continue
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise ExportError(f"{name}: expected a number, got {v!r}") from None
            ok = math.isfinite(v) and (lo < v <= hi if name == "max_latency_ms" else lo <= v <= hi)
            if not ok:
                rng = "0 < ms <= 1e9" if name == "max_latency_ms" else "0 to 100"
                raise ExportError(f"{name}: expected {rng}, got {getattr(self, name)!r}")
            out[name] = v
        return out


def _where(params: dict, alive: bool | None) -> str:
    cond = []
    if alive is True:
        cond.append("h.alive IS TRUE")
    elif alive is False:
        cond.append("h.alive IS FALSE")
    if params.get("protocol"):
        cond.append("r.protocol = ANY(%(protocol)s)")
    if params.get("anonymity"):
        cond.append("h.anonymity = ANY(%(anonymity)s)")
    if params.get("country"):
        cond.append("e.country = ANY(%(country)s)")
    if params.get("exit_country"):
        cond.append("h.exit_country = ANY(%(exit_country)s)")
    if params.get("max_latency_ms") is not None:
        cond.append("h.latency_ms <= %(max_latency_ms)s")
    if params.get("min_score") is not None:
        cond.append("rr.score >= %(min_score)s")
    return "".join(f" AND {c}" for c in cond)


def export_sql(params: dict, alive: bool | None, with_credentials: bool, full: bool = True) -> str:
    """The export query (psycopg2 ``%(name)s`` parameters: ``wid`` and the filter's); columns: those of
    :data:`COLUMNS` in order (``last_checked_at`` as ISO 8601 text), or only ``protocol, host, port`` when
    not ``full``, then ``username_enc``, ``password_enc`` when ``with_credentials``. Unused joins are
    removed by PostgreSQL's planner (each joins on a unique key)."""
    creds = ", r.username_enc, r.password_enc" if with_credentials else ""
    cols = ("r.protocol, r.host, r.port, h.alive, h.latency_ms, h.anonymity, e.country, h.exit_ip, "
            "h.exit_country, rr.score, to_json(h.last_checked_at) #>> '{}'") if full else "r.protocol, r.host, r.port"
    return (f"SELECT {cols}{creds} "
            "FROM route_workspaces rw JOIN routes r ON r.id = rw.route_id "
            "LEFT JOIN route_health h ON h.route_id = r.id "
            "LEFT JOIN route_enrichment e ON e.route_id = r.id "
            "LEFT JOIN route_reputation rr ON rr.route_id = r.id "
            f"WHERE rw.workspace_id = %(wid)s{_where(params, alive)} ORDER BY rw.route_id")


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _auth(user: str | None, pw: str | None) -> str:
    if user is None:
        return ""
    out = quote(user, safe="")
    if pw is not None:
        out += ":" + quote(pw, safe="")
    return out + "@"


def _iso(t: datetime | str | None) -> str | None:
    return t.isoformat() if isinstance(t, datetime) else t


def _num(v) -> float | None:
    return None if v is None else round(float(v), 3)


def _q(v) -> str:
    return "null" if v is None else _quote(v)


def _n(v) -> str:
    return "null" if v is None else repr(round(float(v), 3))


_BOOL = {True: "true", False: "false", None: "null"}


def _json_line(r, cred) -> str:
    """One route as a JSON object (keys as :data:`COLUMNS`, credentials after ``port``, then ``url``)."""
    proto, host, port = r[0], r[1], r[2]
    hp = _hostport(host, port)
    auth = ""
    mid = ""
    if cred is not None:
        auth = _auth(*cred)
        mid = f',"username":{_q(cred[0])},"password":{_q(cred[1])}'
    return (f'{{"protocol":{_quote(proto)},"host":{_quote(host)},"port":{int(port)}{mid},"alive":{_BOOL[r[3]]},'
            f'"latency_ms":{_n(r[4])},"anonymity":{_q(r[5])},"country":{_q(r[6])},"exit_ip":{_q(r[7])},'
            f'"exit_country":{_q(r[8])},"score":{_n(r[9])},"last_checked_at":{_q(_iso(r[10]))},'
            f'"url":{_quote(f"{proto}://{auth}{hp}")}}}')


class _Formatter:
    """Turns fetched rows into one text chunk for one format."""

    def __init__(self, fmt: str, with_credentials: bool):
        self.fmt = fmt
        self.first = True
        self.header = list(COLUMNS)
        if with_credentials:
            self.header[3:3] = ["username", "password"]

    def head(self) -> str:
        if self.fmt == "csv":
            return self._csv([self.header])
        return "[" if self.fmt == "json" else ""

    def tail(self) -> str:
        if self.fmt == "json":
            return "\n]\n" if not self.first else "]\n"
        return ""

    @staticmethod
    def _csv(rows) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        return buf.getvalue()

    def chunk(self, rows: list[tuple], creds: list | None) -> str:
        """One chunk for ``rows`` (``creds[i]``: ``(username, password)`` of row i, when exporting them)."""
        fmt = self.fmt
        if fmt == "txt":
            if creds is None:
                return "".join(f"{_hostport(r[1], r[2])}\n" for r in rows)
            return "".join(f"{_auth(*c)}{_hostport(r[1], r[2])}\n" for r, c in zip(rows, creds))
        if fmt == "url":
            if creds is None:
                return "".join(f"{r[0]}://{_hostport(r[1], r[2])}\n" for r in rows)
            return "".join(f"{r[0]}://{_auth(*c)}{_hostport(r[1], r[2])}\n" for r, c in zip(rows, creds))
        if fmt == "csv":
            out = []
            for i, r in enumerate(rows):
                row = [r[0], r[1], r[2], "" if r[3] is None else ("true" if r[3] else "false"),
                       "" if r[4] is None else _num(r[4]), r[5], r[6], r[7], r[8],
                       "" if r[9] is None else _num(r[9]), _iso(r[10])]
                if creds is not None:
                    row[3:3] = list(creds[i])
                out.append(row)
            return self._csv(out)
        if creds is None:
            lines = [_json_line(r, None) for r in rows]
        else:
            lines = [_json_line(r, c) for r, c in zip(rows, creds)]
        if fmt == "jsonl":
            return "\n".join(lines) + "\n" if lines else ""
        text = ",\n".join(lines)
        if not lines:
            return ""
        if self.first:
            self.first = False
            return "\n" + text
        return ",\n" + text


def _workspace_id(engine, name: str) -> int:
    import sqlalchemy as sa

    with engine.connect() as conn:
        wid = conn.execute(sa.text("SELECT id FROM workspaces WHERE name = :n"), {"n": name}).scalar()
    if wid is None:
        raise ExportError(f"no workspace named {name!r}")
    return int(wid)


def stream_export(settings, flt: ExportFilter, fmt: str, with_credentials: bool = False) -> Iterator[str]:
    """Stream the routes of ``flt.workspace`` that pass ``flt``, formatted as ``fmt`` (module docstring).

    The request is checked before anything is streamed: this call raises, the iterator it returns does
    not (but for database failures while streaming). Closing the iterator early releases the cursor.

    Args:
        settings: :class:`magpie.config.Settings` (``database_url``; ``encryption_key`` when credentials
            are exported).
        flt: which routes (:class:`ExportFilter`).
        fmt: one of :data:`FORMATS`.
        with_credentials: include usernames and passwords (decrypted); audit-logged.
    Returns:
        An iterator of text chunks, each one or more whole lines (``json``: together one JSON array).
    Raises:
        ExportError: unknown format or workspace, bad filter value.
        sqlalchemy.exc.DBAPIError: PostgreSQL unreachable or not migrated.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: expected one of {', '.join(FORMATS)}")
    params = flt.validate()
    from magpie.db.session import get_engine

    engine = get_engine(settings.database_url)
    params["wid"] = _workspace_id(engine, flt.workspace)
    keyring = None
    if with_credentials:
        from magpie.base.crypto import get_keyring

        keyring = get_keyring(settings.encryption_key)
        conditions = {f.name: getattr(flt, f.name) for f in fields(flt)
                      if f.name != "workspace" and getattr(flt, f.name) is not None}
        audit.info("export with credentials requested: workspace %r, format %s, filter %s", flt.workspace, fmt,
                   conditions or "none")
    params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in params.items()}
    sql = export_sql(params, flt.alive, with_credentials, full=fmt not in ("txt", "url"))
    return _stream(engine, sql, params, _Formatter(fmt, with_credentials), keyring, flt.workspace, fmt)


def _stream(engine, sql: str, params: dict, out: _Formatter, keyring, workspace: str, fmt: str) -> Iterator[str]:
    exported = skipped = 0
    complete = False
    raw = engine.raw_connection()
    try:
        cur = raw.cursor(name="magpie_export")  # server-side: rows stay in PostgreSQL until fetched
        cur.itersize = FETCH_ROWS
        cur.execute(sql, params)
        head = out.head()
        if head:
            yield head
        while True:
            rows = cur.fetchmany(FETCH_ROWS)
            if not rows:
                break
            creds = None
            if keyring is not None:
                rows, creds, bad = _decrypt(rows, keyring)
                skipped += bad
            exported += len(rows)
            if rows:
                yield out.chunk(rows, creds)
        tail = out.tail()
        if tail:
            yield tail
        cur.close()
        complete = True
    finally:
        try:
            raw.rollback()  # ends the read transaction (a named cursor lives in one)
        finally:
            raw.close()
        if keyring is not None:
            audit.info("export with credentials %s: workspace %r, format %s, %d routes exported%s",
                       "done" if complete else "stopped early", workspace, fmt, exported,
                       f", {skipped} left out (credentials do not decrypt under this key)" if skipped else "")
        elif skipped:  # pragma: no cover - only credential exports skip
            log.warning("export: %d routes left out", skipped)


def _decrypt(rows: list[tuple], keyring) -> tuple[list[tuple], list[tuple], int]:
    from magpie.base.crypto import CredentialError

    kept, creds, bad = [], [], 0
    for r in rows:
        user_enc, pw_enc = r[-2], r[-1]
        try:
            creds.append((keyring.decrypt(user_enc) if user_enc else None,
                          keyring.decrypt(pw_enc) if pw_enc else None))
        except CredentialError:
            bad += 1
            continue
        kept.append(r)
    return kept, creds, bad


__all__ = ["COLUMNS", "FORMATS", "ExportError", "ExportFilter", "export_sql", "stream_export"]
