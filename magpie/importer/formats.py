"""The structured and annotated list formats, on top of the plain line parser of :mod:`magpie.importer.parse`.

One :class:`LineReader` reads one list, line by line, and keeps the little state a list has (the header of a
CSV or TSV section). Per line, in this order:

1. **JSON lines**: a line starting with ``{`` is one JSON object: ``{"ip": "203.0.113.9", "port": 8080,
   "protocol": "socks5"}``. Host keys ``ip``/``host``/``address``/``addr``/``server``; ``port`` (number or
   digits); protocol keys ``protocol``/``type``/``scheme``/``protocols`` (a string or a list, the first
   known scheme wins); ``username``/``user``/``login`` and ``password``/``pass``, taken literally; or one
   ``proxy``/``url`` key holding an address in any plain form. Malformed JSON, a non-object, a missing host
   or a bad port make the line malformed.
2. **A header** (``ip,port,protocol``; ``IP Address<TAB>Port<TAB>Country``; ``host;port;user;pass``, also
   after a ``#``): two or more fields split by ``,``, ``;`` or a tab, naming a host column and a port column
   (or one address column: ``proxy``, ``address:port``, ``url``...), none of them an address. It is
   skipped, and later lines holding its separator are read as rows by column name (the ``csv`` module's
   quoting applies, so quoted credentials may hold any character); a row with another number of fields
   is malformed. An empty protocol cell takes the default protocol. A new header starts a new section.
3. **Annotated colon forms**: ``host:port:`` followed by ``:``-separated fields, with no ``@``. One field
   that is a code (a two-letter country, an anonymity word such as ``elite``, ``anonymous``,
   ``transparent``, ``H``/``A``/``N``, or an SSL flag ``S``/``+``/``-``/``yes``/``no``) or three or more
   code fields are annotations: the route is ``host:port``. Exactly two fields are also the
   ``host:port:user:pass`` form, so with ``fmt="auto"`` two fields of which either looks like a code are
   **never guessed**: the line is malformed with a reason naming both ``--format`` choices.
   ``fmt="ip:port:user:pass"`` reads them as credentials, ``fmt="ip:port:country:anonymity"`` as
   annotations (any fields).
4. **Column pairs without a header** (TSV, CSV, aligned tables): a first column that is an IP literal or a
   dotted host name followed by a port column (``203.0.113.9<TAB>8080<TAB>US``); a later column that is
   exactly a scheme name (``socks5``) gives the protocol.
5. Everything else goes to the plain parser (``host:port``, ``user:pass@host:port``, URLs, ``host:port
   US-H-S +`` with annotations after whitespace, prose and comments).
"""

from __future__ import annotations

import csv
import json
import re

from magpie.base.protocols import SCHEME_WORDS
from magpie.base.routes import Route

FORMATS = ("auto", "ip:port:user:pass", "ip:port:country:anonymity")
"""Values of ``fmt``: what the two fields after ``host:port:`` are (``auto``: refuse when unsure)."""

_ANONYMITY = frozenset({
    "elite", "elite proxy", "high", "high anonymous", "high-anonymous", "highanonymous", "high_anonymity",
    "hia", "anonymous", "anon", "anm", "transparent", "noa", "distorting", "level1", "level2", "level3",
    "l1", "l2", "l3", "h", "a", "n", "e", "t",
})
_SSL_FLAGS = frozenset({"s", "+", "-", "!", "ssl", "yes", "no", "true", "false", "https"})
_COUNTRY = re.compile(r"[A-Za-z]{2}")
_DIGITS = re.compile(r"[0-9]{1,5}")
_FIRST_COLUMN = re.compile(r"[^\s;,]*")
_HEADER_HINT = re.compile(r"port|proxy|url|endpoint|address", re.IGNORECASE)
_PAIR_SPLIT = re.compile(r"[\s;,]+")
_PAIR_HOST = re.compile(r"[0-9.]+|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*")
_DOTTED = re.compile(r"\w\.\w")

_HOST_COLUMNS = frozenset({"ip", "host", "hostname", "address", "addr", "ip address", "ip_address", "ipaddress",
                           "ip addr", "proxy ip", "proxy_ip", "server", "ipv4"})
_PORT_COLUMNS = frozenset({"port", "proxy port", "proxy_port"})
_ADDRESS_COLUMNS = frozenset({"proxy", "proxies", "ip:port", "host:port", "address:port", "url", "endpoint",
                              "proxy_address", "proxy address"})
_PROTOCOL_COLUMNS = frozenset({"protocol", "protocols", "type", "scheme", "proto", "proxy type", "proxy_type"})
_USER_COLUMNS = frozenset({"username", "user", "login"})
_PASSWORD_COLUMNS = frozenset({"password", "pass", "passwd", "pwd"})
_JSON_HOST = ("ip", "host", "address", "addr", "server")
_JSON_PROTOCOL = ("protocol", "type", "scheme", "protocols")


def is_code(field: str) -> bool:
    """Does an annotation field look like a country code, an anonymity level or an SSL flag?"""
    f = field.strip()
    return bool(_COUNTRY.fullmatch(f)) or f.lower() in _ANONYMITY or f.lower() in _SSL_FLAGS


AMBIGUOUS = ("fields after host:port look like country:anonymity codes but the same form means user:password; "
             "say which with --format ip:port:country:anonymity or --format ip:port:user:pass")
"""The reason of a refused ``host:port:a:b`` line; it never quotes the fields (they may be credentials)."""


class LineReader:
    """Reads the lines of one list; see the module docstring for the forms and their order.

    Args:
        default_protocol: protocol of an address without one.
        fmt: one of :data:`FORMATS`.
        parse_plain: ``parse_plain(text) -> Route | None`` (the plain parser; raises ``ParseError``).
        parse_address: ``parse_address(column) -> Route`` for one address column (raises ``ParseError``).
        normalize: ``normalize(host) -> str`` canonical host; raises ``ValueError``.
        error: the ``ParseError`` class to raise.
    Raises ``ValueError`` for an unknown ``fmt``.
    """

    def __init__(self, default_protocol: str, fmt, parse_plain, parse_address, normalize, error):
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
        self.protocol = default_protocol
        self.fmt = fmt
        self._plain = parse_plain
        self._address = parse_address
        self._normalize = normalize
        self._error = error
        self._header: dict[str, int] | None = None
        self._delimiter = ","
        self._width = 0

    # -- one line ----------------------------------------------------------------------------------------
    def parse(self, text: str) -> Route | None:
        """The route of one line (no line ending), ``None`` to skip it; raises ``ParseError``."""
        line = text.strip()
        if line.startswith("\ufeff"):
            line = line[1:].strip()
        if not line:
            return None
        if line[0] == "{":
            return self._json(line)
        if line[0] == "[" and line[-1] == "]" and self._json_array(line):
            raise self._error("JSON line is not an object")
        if _HEADER_HINT.search(line) and self._read_header(line):
            return None
        if self._header is not None and self._delimiter in line:
            row = next(csv.reader([line], delimiter=self._delimiter, skipinitialspace=True))
            if len(row) != self._width:
                raise self._error(f"row has {len(row)} fields, its header {self._width}")
            return self._row(row)
        if line[0] == "#" or line.startswith("//"):
            return None
        column = _FIRST_COLUMN.match(line).group()
        if column.count(":") >= 2:  # host:port:<fields> at least
            route = self._annotated(column, line[len(column):].lstrip(" \t;,"))
            if route is not None:
                return route
        try:
            route = self._plain(line)
        except self._error:
            route = self._pair(line)
            if route is not None:
                return route
            raise
        return route if route is not None else self._pair(line)

    # -- forms ---------------------------------------------------------------------------------------------
    def _route(self, host: str, port, protocol: str | None = None, user: str | None = None,
               password: str | None = None) -> Route:
        host = str(host).strip()
        if not host:
            raise self._error("empty host")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # a host field is unambiguous: an IPv6 address needs no brackets there
        try:
            host = self._normalize(host)
        except ValueError:
            raise self._error(f"bad address {host[:40]!r}") from None
        text = str(port).strip()
        if isinstance(port, bool) or not _DIGITS.fullmatch(text) or not 0 < int(text) < 65536:
            raise self._error("missing port" if not text else f"bad port {text[:40]!r}")
        if protocol is not None and not isinstance(protocol, str):
            protocol = None
        scheme = self.protocol
        if protocol and protocol.strip():
            scheme = SCHEME_WORDS.get(protocol.strip().lower())
            if scheme is None:
                raise self._error(f"unknown protocol {protocol.strip()[:40]!r}")
        return Route(scheme, host, int(text), user or None, password if user else None)

    def _json(self, line: str) -> Route:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise self._error(f"malformed JSON line: {exc.msg} at column {exc.colno}") from None
        except RecursionError:
            raise self._error("malformed JSON line: nested too deeply") from None
        if not isinstance(obj, dict):
            raise self._error("JSON line is not an object")
        obj = {str(k).lower(): v for k, v in obj.items()}
        protocol = next((obj[k] for k in _JSON_PROTOCOL if obj.get(k) not in (None, "", [])), None)
        if isinstance(protocol, list):
            known = [p for p in protocol if isinstance(p, str) and p.strip().lower() in SCHEME_WORDS]
            protocol = known[0] if known else str(protocol[0])
        user = next((obj[k] for k in ("username", "user", "login") if obj.get(k)), None)
        password = next((obj[k] for k in ("password", "pass") if obj.get(k) is not None), None)
        host = next((obj[k] for k in _JSON_HOST if obj.get(k) not in (None, "")), None)
        if host is None:
            for key in ("proxy", "url"):
                if isinstance(obj.get(key), str):
                    route = self._address(obj[key].strip())
                    if protocol and "://" not in obj[key]:
                        route = self._route(route.host if ":" not in route.host else f"[{route.host}]",
                                            route.port, protocol, route.username, route.password)
                    return route
            raise self._error("JSON line has no 'ip' or 'host'")
        if "port" not in obj:
            raise self._error("missing port")
        return self._route(str(host), obj["port"], protocol,
                           None if user is None else str(user), None if password is None else str(password))

    @staticmethod
    def _json_array(line: str) -> bool:
        try:
            return isinstance(json.loads(line), list)
        except (ValueError, RecursionError):
            return False

    def _read_header(self, line: str) -> bool:
        body = line.lstrip("#").strip() if line[0] == "#" else line
        best: tuple[str, list[str]] | None = None
        for delim in ("\t", ",", ";"):
            if delim in body:
                fields = next(csv.reader([body], delimiter=delim, skipinitialspace=True))
                if len(fields) >= 2 and (best is None or len(fields) > len(best[1])):
                    best = (delim, fields)
        if best is None:
            return False
        delim, fields = best
        names = [" ".join(f.strip().strip('"').lower().split()) for f in fields]
        if not ((_HOST_COLUMNS & set(names) and _PORT_COLUMNS & set(names)) or _ADDRESS_COLUMNS & set(names)):
            return False
        header: dict[str, int] = {}
        for i, name in enumerate(names):
            for role, words in (("host", _HOST_COLUMNS), ("port", _PORT_COLUMNS), ("address", _ADDRESS_COLUMNS),
                                ("protocol", _PROTOCOL_COLUMNS), ("user", _USER_COLUMNS),
                                ("password", _PASSWORD_COLUMNS)):
                if name in words and role not in header:
                    header[role] = i
        self._header, self._delimiter, self._width = header, delim, len(fields)
        return True

    def _row(self, row: list[str]) -> Route | None:
        h = self._header
        if not any(cell.strip() for cell in row):
            return None
        cell = {role: row[i].strip() if role not in ("user", "password") else row[i] for role, i in h.items()}
        protocol = cell.get("protocol") or None
        if "host" in h and "port" in h and (cell["host"] or "address" not in h):
            route = self._route(cell["host"], cell["port"], protocol, cell.get("user") or None,
                                cell.get("password"))
        else:
            route = self._address(cell.get("address", ""))
            if protocol and "://" not in cell.get("address", ""):
                host = f"[{route.host}]" if ":" in route.host else route.host
                route = self._route(host, route.port, protocol, route.username, route.password)
        return route

    def _annotated(self, column: str, rest_of_line: str) -> Route | None:
        """Rule 3: ``host:port:<fields>`` with code fields; None when the column is not of that shape.

        With ``auto``, two fields followed by text other than a ``#`` comment go to the plain parser, which
        refuses text after ``host:port:user:pass`` (it may be the rest of a password)."""
        if "@" in column or self.fmt == "ip:port:user:pass":
            return None
        scheme, sep, rest = column.rpartition("://")
        if rest.startswith("["):
            end = rest.find("]")
            if end < 0:
                return None
            host, tail = rest[: end + 1], rest[end + 1:]
            if not tail.startswith(":"):
                return None
            parts = tail[1:].split(":")
        else:
            host, *parts = rest.split(":")
            if len(parts) > 3 and all(re.fullmatch(r"[0-9A-Fa-f]{0,4}", p) for p in parts):
                return None  # an unbracketed IPv6 address: the plain parser says so
        if len(parts) < 2 or not _DIGITS.fullmatch(parts[0]):
            return None
        fields = parts[1:]
        codes = [is_code(f) for f in fields]
        if self.fmt == "auto":
            if len(fields) == 2:
                if any(codes) and (not rest_of_line or rest_of_line[0] == "#"):
                    raise self._error(AMBIGUOUS)
                return None
            if not all(codes):
                return None
        elif len(fields) == 2 and not fields[1]:
            return None
        return self._address(f"{scheme}{sep}{host}:{parts[0]}")

    def _pair(self, line: str) -> Route | None:
        """Rule 4: ``host<sep>port[<sep>...]`` without a header; None when the line is not of that shape."""
        cols = [c for c in _PAIR_SPLIT.split(line) if c]
        if len(cols) < 2 or not _DIGITS.fullmatch(cols[1]):
            return None
        host = cols[0]
        if not (_PAIR_HOST.fullmatch(host) or _DOTTED.search(host)):
            return None
        if "://" in host or "@" in host:
            return None
        protocol = next((c for c in cols[2:] if c.lower() in SCHEME_WORDS), None)
        return self._route(host, cols[1], protocol)
