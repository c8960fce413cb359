"""Parse the proxy lists people publish and trade into :class:`~magpie.base.routes.Route` values.

Address forms (the first column of a line)::

    host:port                         user:pass@host:port          user@host:port (password None)
    host:port:user:pass               scheme://host:port           scheme://user:pass@host:port

``scheme`` is a protocol of :mod:`magpie.base.protocols` or one of its aliases, in any case (``socks4a`` is
read as ``socks4``, ``socks5h`` as ``socks5``: :data:`~magpie.base.protocols.SCHEME_WORDS`). One trailing ``/`` after a scheme form is allowed. Credentials in the scheme and
``user:pass@`` forms are percent-decoded; the ``host:port:user:pass`` form is taken literally. Hosts are IPv4,
bracketed IPv6 (``[2001:db8::1]:8080``, in every form) or host names, normalised by
:func:`magpie.base.routes.normalize_host`; an unbracketed IPv6 address is refused as ambiguous. The ``:user:pass``
suffix is also read after a scheme form without ``@``. A line without a scheme takes ``default_protocol``.

Columns: the first column ends at the first whitespace, ``;`` or ``,``; everything after it (country codes,
latency, ``# comments``) is ignored. Credentials that contain whitespace, ``;`` or ``,`` must therefore be
percent-encoded in a scheme or ``user:pass@`` form. Such credentials written raw are never guessed at and
never cut short: the line is **malformed** (reported with its number) when

* the first column is not an address, has a ``:`` before its end, and an ``@`` later on the line is
  followed by a ``host:port`` (``user:pa ss@203.0.113.9:8080``: "credentials contain whitespace..."); or
* the first column is a ``host:port:user:pass`` form (the password is last, so an annotation and the rest
  of a password cannot be told apart) and text other than a ``#`` comment follows it
  (``203.0.113.9:8080:user:pa ss``). Annotate that form after ``#`` only; every other form takes any
  annotation (``203.0.113.9:8080 US-N-S +``).

JSON lines, CSV and TSV with a header, column pairs (``host<TAB>port``) and annotated colon forms
(``host:port:country:anonymity``) are read by :mod:`magpie.importer.formats` before the plain rules
below; line breaks are counted by :mod:`magpie.importer.lines`.

How a line is classified
------------------------
1. Blank, or starting with ``#`` or ``//`` (after whitespace), or with an empty first column (e.g. ``;x``):
   **skipped**.
2. The first column parses as an address: a **route** (or a **duplicate** of an earlier route of the input),
   unless the caller's ``refuse`` check gives a reason (e.g. the egress guard): then the line is
   **malformed** with that reason.
3. Otherwise the line is **malformed** if its first column *looks like an address attempt*, else it is
   header/footer prose and **skipped**. A first column looks like an address attempt when

   a. it contains ``://`` or ``@``; or
   b. it starts with ``[`` and has a ``:`` before any ``]`` (a bracketed IPv6 attempt); or
   c. it has host:port shape: the text after its first ``:`` starts with a digit; or
   d. the text before its first ``:`` is four dot-separated digit groups (IPv4-like, e.g. ``999.1.1.1``),
      or the whole column is hex digits, dots and at least two colons (a bare IPv6 attempt); or
   e. it is the only column on the line and the text before its first ``:`` has a ``.`` between word
      characters (``proxy.example.net`` alone: "missing port").

   So ``Free proxy list - updated hourly``, ``Total: 300 proxies``, ``IP address  Port  Country``,
   ``--- end ---`` and ``Support us at https://...`` are prose, while ``1.2.3.4``, ``1.2.3.4 elite``,
   ``ftp://1.2.3.4:21`` and ``host:99999`` are malformed. A prose line that happens to parse (``Total:300``)
   is read as an address: rule 2 comes first.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO
from urllib.parse import unquote

from magpie.errors import MagpieError
from magpie.importer.lines import read_lines, segments, split_lines
from magpie.base.protocols import PROTOCOLS, SCHEME_WORDS
from magpie.base.routes import Route, normalize_host

__all__ = ["InvalidLine", "ParseError", "ParseResult", "Refuse", "parse_file", "parse_line", "parse_lines", "read_lines",
           "split_lines"]

_FIRST_COLUMN = re.compile(r"[^\s;,]*")
_BRACKET_ATTEMPT = re.compile(r"\[[^\]]*:")
_IPV4_LIKE = re.compile(r"[0-9]+(?:\.[0-9]+){3}")
_HEX_COLON = re.compile(r"[0-9A-Fa-f:.]+")
_DOTTED = re.compile(r"\w\.+\w")

# Fast paths for hosts already in the form normalize_host returns (it is slow: ipaddress raises for names).
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_CANONICAL_IPV4 = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_CANONICAL_NAME = re.compile(rf"(?=.{{1,253}}\Z)(?=.*[a-z_-]){_LABEL}(?:\.{_LABEL})*")
_HEX_COLON_ONLY = re.compile(r"[0-9A-Fa-f:]+")

_SEPARATORS = " \t;,"
_SPLIT_CREDENTIALS = "credentials contain whitespace, ';' or ',' (percent-encode them, e.g. user:pa%20ss@host:port)"
_AFTER_LITERAL = ("text after host:port:user:pass (percent-encode whitespace, ';' or ',' of a password in the "
                  "user:pass@host:port form; annotate this form after '#' only)")

_MAX_TEXT = 300  # InvalidLine.text is clipped to this many characters
_MAX_TOKEN = 40  # tokens quoted in a reason are clipped to this many characters


class ParseError(MagpieError, ValueError):
    """A line that tries to be an address but is malformed.

    Attributes:
        reason: short human text, e.g. ``"bad port '99999'"``; also ``str(error)``.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class InvalidLine:
    """A malformed line: ``line`` is 1-based, ``text`` the stripped line (clipped to 300 characters)."""

    line: int
    reason: str
    text: str


@dataclass
class ParseResult:
    """Outcome of parsing one list.

    Attributes:
        routes: unique routes in input order (the first occurrence wins).
        duplicates: good lines whose route equals an earlier good line's route.
        skipped: blank, comment and prose lines.
        invalid: malformed lines, in input order.
        lines: the line number of each of ``routes`` (not compared).
    """

    routes: list[Route] = field(default_factory=list)
    duplicates: int = 0
    skipped: int = 0
    invalid: list[InvalidLine] = field(default_factory=list)
    lines: list[int] = field(default_factory=list, compare=False, repr=False)

    @property
    def valid(self) -> int:
        """Number of unique routes (``len(routes)``)."""
        return len(self.routes)


def _check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"default_protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")


def _short(token: str) -> str:
    return token if len(token) <= _MAX_TOKEN else token[: _MAX_TOKEN - 1] + "…"


def _is_bare_ipv6(hostport: str) -> bool:
    # the whole text, or the text minus a trailing ':port', is an IPv6 address
    for candidate in (hostport, hostport.rpartition(":")[0]):
        try:
            ipaddress.IPv6Address(candidate)
            return True
        except ValueError:
            pass
    return False


def _normalize_host(host: str) -> str:
    """:func:`magpie.base.routes.normalize_host`, skipping it for hosts that are already canonical."""
    if _CANONICAL_IPV4.fullmatch(host) or _CANONICAL_NAME.fullmatch(host):
        return host
    if host[:1] == "[" and host[-1:] == "]" and _HEX_COLON_ONLY.fullmatch(host, 1, len(host) - 1):
        # inet_ntop's text equals ipaddress's whenever it has no dotted IPv4 tail (tests check this)
        try:
            text = socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, host[1:-1]))
        except (OSError, ValueError):
            pass
        else:
            if "." not in text:
                return text
    if not host.isascii():
        host = _idna(host)
    return normalize_host(host)


def _idna(host: str) -> str:
    """An internationalised host name as IDNA ASCII (punycode, lower case); ``ValueError`` when invalid."""
    import idna

    try:
        return idna.encode(host.rstrip(".").rstrip("\u3002\uff0e\uff61"), uts46=True).decode("ascii")
    except (idna.IDNAError, UnicodeError) as exc:
        raise ValueError(f"bad address {host!r}: {exc}") from None


def _split_hostport(hostport: str) -> tuple[str, list[str]]:
    """Split ``host[:a[:b...]]`` into the host text and the ``:``-separated parts after it."""
    if hostport.startswith("["):
        end = hostport.find("]")
        if end < 0:
            raise ParseError(f"bad address {_short(hostport)!r}")
        host, after = hostport[: end + 1], hostport[end + 1 :]
        if not after:
            return host, []
        if after[0] != ":":
            raise ParseError(f"bad address {_short(hostport)!r}")
        return host, after[1:].split(":")
    parts = hostport.split(":")
    if len(parts) > 2 and _HEX_COLON.fullmatch(hostport) and _is_bare_ipv6(hostport):
        raise ParseError("IPv6 address must be bracketed")
    return parts[0], parts[1:]


def _parse_port(text: str) -> int:
    if text.isdigit() and len(text) <= 5 and text.isascii():
        port = int(text)
        if 0 < port < 65536:
            return port
    if not text:
        raise ParseError("missing port")
    raise ParseError(f"bad port {_short(text)!r}")


def _parse_address(column: str, default_protocol: str) -> Route:
    """Parse one address column; raises :class:`ParseError`."""
    protocol = default_protocol
    rest = column
    sep = column.find("://")
    if sep >= 0:
        raw_scheme = column[:sep]
        scheme = SCHEME_WORDS.get(raw_scheme.lower())
        if scheme is None:
            raise ParseError(f"unknown scheme {_short(raw_scheme)!r}")
        protocol = scheme
        rest = column[sep + 3 :]

    username: str | None = None
    password: str | None = None
    at = rest.rfind("@")  # rfind: an unencoded '@' in a password stays in the credentials
    if at >= 0 and ":" not in rest[at + 1:] and rest[:at].count(":") >= 3:
        at = -1  # host:port:user:pa@ss: the '@' is inside the password of the literal form
    if at >= 0:
        user, colon, secret = rest[:at].partition(":")
        if not user:
            raise ParseError("empty user in credentials")
        username = unquote(user)
        password = unquote(secret) if colon else None
        hostport = rest[at + 1 :]
    else:
        hostport = rest

    if sep >= 0:
        slash = hostport.find("/")
        if slash >= 0:
            if hostport[slash:] != "/":
                raise ParseError(f"unexpected path {_short(hostport[slash:])!r}")
            hostport = hostport[:slash]

    host, parts = _split_hostport(hostport)
    if len(parts) == 1:
        port_text = parts[0]
    elif not parts:
        raise ParseError("missing port")
    elif len(parts) == 3 and at < 0:  # host:port:user:pass, taken literally
        port_text, user, password = parts
        if not user:
            raise ParseError("empty user in credentials")
        username = user
    else:
        raise ParseError("too many colons")

    if host in ("", "[]"):
        raise ParseError("empty host")
    try:
        host = _normalize_host(host)
    except ValueError:
        raise ParseError(f"bad address {_short(host)!r}") from None
    try:
        port = _parse_port(port_text)
    except ParseError:
        if password is not None or at >= 0:  # the text may be part of a password: never quote it
            raise ParseError("bad port after the credentials (percent-encode '@' and ':' in passwords)") from None
        raise
    return Route(protocol, host, port, username, password)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # a tab stays (TSV lines)


def _control_problem(text: str, route: Route | None) -> str | None:
    """Why a line holding control characters is refused (NUL, ESC of terminal escapes, ...), or None."""
    if "\x00" in text:
        return "NUL byte in the line (a UTF-16 file without a byte-order mark? save it as UTF-8)"
    if route is not None:
        for name, value in (("user name", route.username), ("password", route.password)):
            if value is not None and _CONTROL.search(value):
                return f"control character in the {name}"
    return None


def _printable(text: str) -> str:
    """``text`` with control characters shown as ``\\xNN`` escapes, so a reported line cannot drive a terminal."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _looks_like_address(column: str, only_column: bool) -> bool:
    """Rules a-e of the module docstring: is a column that failed to parse an address attempt?"""
    if "://" in column or "@" in column:
        return True
    if _BRACKET_ATTEMPT.match(column):
        return True
    head, colon, tail = column.partition(":")
    if colon and tail[:1].isascii() and tail[:1].isdigit():
        return True
    if _IPV4_LIKE.fullmatch(head):
        return True
    if column.count(":") >= 2 and _HEX_COLON.fullmatch(column):
        return True
    return only_column and _DOTTED.search(head) is not None


def _split_credentials(line: str, start: int, default_protocol: str) -> bool:
    """Is ``line`` credentials cut by a column separator: an ``@`` at or after ``start``, a ``:`` before it,
    and a ``host:port`` right after it (``user:pa ss@host:port``)?"""
    at = line.find("@", start)
    while at >= 0:
        token = _FIRST_COLUMN.match(line, at + 1).group()
        if token and "@" not in token and "://" not in token and ":" in line[:at]:
            try:
                _parse_address(token, default_protocol)
                return True
            except ParseError:
                pass
        at = line.find("@", at + 1)
    return False


def _parse(text: str, default_protocol: str) -> Route | None:
    line = text.strip()
    if line.startswith("\ufeff"):  # a byte-order mark survives a plain utf-8 decode
        line = line[1:].strip()
    if not line or line[0] == "#" or line.startswith("//"):
        return None
    column = _FIRST_COLUMN.match(line).group()
    if not column:
        return None
    try:
        route = _parse_address(column, default_protocol)
    except ParseError:
        if "@" in line[len(column):] and _split_credentials(line, len(column), default_protocol):
            raise ParseError(_SPLIT_CREDENTIALS) from None
        if _looks_like_address(column, len(column) == len(line)):
            raise
        return None
    if route.password is not None and len(column) < len(line) and "@" not in column:
        # host:port:user:pass: what follows may be the rest of the password as well as an annotation
        rest = line[len(column):].lstrip(_SEPARATORS)
        if rest and rest[0] != "#":
            raise ParseError(_AFTER_LITERAL)
    return route


def parse_line(text: str, default_protocol: str = "http", fmt: str = "auto") -> Route | None:
    """Parse one line of a proxy list.

    Args:
        text: the line, with or without its line ending.
        default_protocol: protocol for an address without a scheme; one of :data:`magpie.base.protocols.PROTOCOLS`.
        fmt: as in :func:`parse_lines` (a line alone has no header: CSV rows need :func:`parse_lines`).

    Returns:
        the :class:`Route`, or ``None`` for a line to skip (blank, comment, header/footer prose).

    Raises:
        ValueError: ``default_protocol`` is not a known protocol.
        ParseError: the line is a malformed address; ``.reason`` says why.
    """
    _check_protocol(default_protocol)
    route = _reader(default_protocol, fmt).parse(text)
    why = _control_problem(text, route)
    if why is not None:
        raise ParseError(why)
    return route


def _reader(default_protocol: str, fmt: str):
    from magpie.importer.formats import LineReader

    return LineReader(default_protocol, fmt, lambda t: _parse(t, default_protocol),
                      lambda c: _parse_address(c, default_protocol), _normalize_host, ParseError)


Refuse = Callable[[Route], str | None]
"""A caller's check of each parsed route: a one-line reason to report the line as invalid, or None."""


def parse_lines(lines: Iterable[str], default_protocol: str = "http", refuse: Refuse | None = None,
                fmt: str = "auto") -> ParseResult:
    """Parse a proxy list given as lines (a single ``str`` is split with :func:`split_lines`).

    Every line is classified independently (:class:`magpie.importer.formats.LineReader`: JSON lines, CSV
    and TSV with a header, annotated and plain forms): a malformed line is recorded in ``invalid`` with its
    1-based line number and the rest still parse. Line numbers count ``\\n`` only; text after a lone CR
    inside a line is read as a further entry with the same number.

    Args:
        refuse: called once per line holding a route not seen before (so for every line of a refused
            route); a returned reason makes the line invalid instead of a route. The parser itself applies
            no policy: the importer passes the egress guard here.
        fmt: one of :data:`magpie.importer.formats.FORMATS`: what the two fields of ``host:port:a:b`` are
            (``auto`` refuses the line when one looks like a country or anonymity code).

    Returns:
        a :class:`ParseResult`.

    Raises:
        ValueError: ``default_protocol`` or ``fmt`` is unknown (checked before any line is read).
    """
    _check_protocol(default_protocol)
    reader = _reader(default_protocol, fmt)
    if isinstance(lines, str):
        lines = split_lines(lines)
    result = ParseResult()
    routes = result.routes
    invalid = result.invalid
    seen: set[Route] = set()
    for number, physical in enumerate(lines, 1):
        for text in segments(physical):
            try:
                route = reader.parse(text)
                why = _control_problem(text, route)
                if why is not None:
                    raise ParseError(why)
            except ParseError as exc:
                invalid.append(InvalidLine(number, exc.reason, _printable(text.strip()[:_MAX_TEXT])))
                continue
            if route is None:
                result.skipped += 1
            elif route in seen:
                result.duplicates += 1
            else:
                why = refuse(route) if refuse is not None else None
                if why is not None:
                    invalid.append(InvalidLine(number, why, _printable(text.strip()[:_MAX_TEXT])))
                    continue
                seen.add(route)
                routes.append(route)
                result.lines.append(number)
    return result


def parse_file(path: str | os.PathLike[str] | IO[bytes], default_protocol: str = "http",
               refuse: Refuse | None = None, fmt: str = "auto") -> ParseResult:
    """Parse a proxy-list file (or an open binary stream such as ``sys.stdin.buffer``), read line by line
    as UTF-8 (undecodable bytes become U+FFFD); ``refuse`` and ``fmt`` as in :func:`parse_lines`.

    Returns:
        a :class:`ParseResult`; line numbers are the file's (``\\n`` counted, as :func:`split_lines`).

    Raises:
        ValueError: ``default_protocol`` or ``fmt`` is unknown (checked before the file is opened).
        OSError: the file cannot be opened or read.
    """
    from magpie.importer.formats import FORMATS

    _check_protocol(default_protocol)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if hasattr(path, "read"):
        return parse_lines(read_lines(path), default_protocol, refuse, fmt)
    with open(path, "rb") as fh:
        return parse_lines(read_lines(fh), default_protocol, refuse, fmt)
