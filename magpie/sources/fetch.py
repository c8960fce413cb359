"""Fetching one proxy-list source: the egress guard on every hop, robots.txt, conditional GET, bounds.

Every request (the list, each redirect, robots.txt; in browser mode every request the page makes) resolves
its host and checks every address with :class:`magpie.base.egress.EgressPolicy` (``MAGPIE_SOURCE_ALLOW_PRIVATE``,
and ``MAGPIE_EGRESS_ONLY`` when set) **before** connecting, then connects to an address that passed (no
second lookup). A redirect is followed up to ``MAGPIE_SOURCE_MAX_REDIRECTS`` times, each ``Location``
through the same guard: a refused one fails the fetch with one line naming the redirect. Credentials in the
URL (``user:password@``) are sent as Basic authentication to the URL's own origin only.

A fetch has one deadline (``MAGPIE_SOURCE_FETCH_TIMEOUT``, seconds, for everything) and one size bound
(``MAGPIE_SOURCE_MAX_BYTES``) on the body. ``ETag`` / ``Last-Modified`` of the previous good reply are sent
back (``If-None-Match`` / ``If-Modified-Since``); ``304`` means nothing to import.

**Paged lists**: a reply that names a next page (an HTTP ``Link: <...>; rel="next"`` header, or an HTML
``<a rel="next" href>`` / ``<link rel="next" href>``) is followed, page by page, up to
``MAGPIE_SOURCE_MAX_PAGES`` pages in all, each page a fetch of its own (guard, robots.txt, redirects) within
the same deadline, with the size bound over all pages together; a page seen before ends the walk. The bodies
are joined with newlines. Only the first page is asked conditionally: its ``304`` means nothing to import.

robots.txt of each origin is read (through the same guard, within the same deadline) and obeyed for the
user agent ``magpie-sources`` unless the source says ``--ignore-robots``: 401/403 forbid everything, other
4xx allow everything, 5xx or a network error fail the fetch (retried later). Parsed files are kept in a
bounded LRU cache with a TTL (``MAGPIE_SOURCE_ROBOTS_CACHE_SIZE``, ``MAGPIE_SOURCE_ROBOTS_TTL``).
"""

from __future__ import annotations

import base64
import re
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit
from urllib.robotparser import RobotFileParser

import certifi
import urllib3

from magpie.base.egress import EgressPolicy
from magpie.errors import MagpieError
from magpie.sources.store import shown_url

USER_AGENT = "magpie-sources/1"
ROBOTS_AGENT = "magpie-sources"
ROBOTS_MAX_BYTES = 512 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)


class FetchFailed(MagpieError, RuntimeError):
    """One fetch failed; the message is one line naming the (redacted) URL or host and why."""


@dataclass
class Fetched:
    """Outcome of a fetch: ``status`` (HTTP status of the final reply: 200.., or 304), ``body`` (empty
    for a 304), ``etag`` / ``last_modified`` (validators of the reply, None when absent), ``url`` (the
    final URL, redacted), ``redirects`` followed, ``content_type``, ``final`` (the final URL as fetched,
    for resolving links), ``link`` (its ``Link`` header) and ``pages`` read (:func:`fetch_pages`)."""

    status: int
    body: bytes = b""
    etag: str | None = None
    last_modified: str | None = None
    url: str = ""
    redirects: int = 0
    content_type: str | None = None
    final: str = ""
    link: str | None = None
    pages: int = 1

    @property
    def not_modified(self) -> bool:
        return self.status == 304


@dataclass
class Deadline:
    """A point in time (``time.monotonic``) a fetch must end by; :meth:`left` raises once it passed."""

    at: float
    seconds: float = 0.0

    @classmethod
    def after(cls, seconds: float) -> "Deadline":
        return cls(time.monotonic() + seconds, seconds)

    def left(self, what: str) -> float:
        """Seconds left; raises :class:`FetchFailed` naming ``what`` when none are."""
        rest = self.at - time.monotonic()
        if rest <= 0:
            raise FetchFailed(f"{what}: time bound of {self.seconds:g} s reached (MAGPIE_SOURCE_FETCH_TIMEOUT)")
        return rest


def policy_of(settings) -> EgressPolicy:
    """The egress policy of source fetches (``MAGPIE_SOURCE_ALLOW_PRIVATE``)."""
    return EgressPolicy(settings.source_allow_private, "MAGPIE_SOURCE_ALLOW_PRIVATE")


def _address(host: str, port: int, policy: EgressPolicy, resolve) -> str:
    """First allowed address of ``host``; raises :class:`FetchFailed` when any resolved one is refused."""
    from magpie.base.egress import is_ip_literal, legacy_ipv4

    h = host.strip("[]")
    if is_ip_literal(h):
        found = [h.split("%", 1)[0]]
    elif legacy_ipv4(h):
        found = [legacy_ipv4(h)]
    else:
        try:
            found = list(dict.fromkeys(i[4][0] for i in resolve(h, port, type=socket.SOCK_STREAM)))
        except (OSError, UnicodeError) as exc:
            raise FetchFailed(f"cannot resolve {h!r}: {exc.__class__.__name__}") from None
    for ip in found:
        why = policy.refusal(ip)
        if why:
            raise FetchFailed(f"{h!r} refused by the egress guard: {why}")
    if not found:
        raise FetchFailed(f"{h!r} resolves to no address")
    return found[0]


@dataclass
class _Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def request(url: str, *, policy: EgressPolicy, deadline: Deadline, max_bytes: int,
            headers: dict[str, str] | None = None, resolve=socket.getaddrinfo, what: str = "") -> _Reply:
    """One GET of ``url`` (no redirect followed) through the egress guard, within ``deadline`` and
    ``max_bytes`` of body. User information in the URL becomes a Basic ``Authorization`` header.

    Returns the reply of any status. Raises :class:`FetchFailed` (refused host, network error, time or
    size bound)."""
    shown = what or shown_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise FetchFailed(f"malformed URL {shown}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise FetchFailed(f"{shown}: only http:// and https:// URLs with a host are fetched")
    host = parts.hostname
    port = port or (443 if scheme == "https" else 80)
    ip = _address(host, port, policy, resolve)
    hdrs = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity", "Connection": "close", **(headers or {})}
    if parts.username is not None or parts.password is not None:
        token = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
        hdrs["Authorization"] = "Basic " + base64.b64encode(token).decode()
    name = f"[{host}]" if ":" in host else host
    hdrs["Host"] = name if port == (443 if scheme == "https" else 80) else f"{name}:{port}"
    tmo = urllib3.Timeout(connect=deadline.left(shown), read=deadline.left(shown))
    if scheme == "https":
        pool = urllib3.HTTPSConnectionPool(ip, port, timeout=tmo, retries=False, maxsize=1, cert_reqs="CERT_REQUIRED",
                                           ca_certs=certifi.where(), server_hostname=host, assert_hostname=host)
    else:
        pool = urllib3.HTTPConnectionPool(ip, port, timeout=tmo, retries=False, maxsize=1)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    chunks: list[bytes] = []
    size = 0
    try:
        resp = pool.urlopen("GET", path, headers=hdrs, redirect=False, retries=False, preload_content=False,
                            assert_same_host=False)
        try:
            while True:
                left = deadline.left(shown)
                sock = getattr(getattr(resp, "connection", None), "sock", None)
                if sock is not None:  # each read waits at most until the deadline
                    sock.settimeout(left)
                chunk = resp.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise FetchFailed(f"{shown}: body is larger than {max_bytes} bytes (MAGPIE_SOURCE_MAX_BYTES)")
                chunks.append(chunk)
        finally:
            resp.release_conn()
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        if isinstance(exc, (urllib3.exceptions.ReadTimeoutError, socket.timeout, TimeoutError)):
            deadline.left(shown)  # raises the time-bound message when that was the cause
        raise FetchFailed(f"GET {shown} failed: {exc.__class__.__name__}") from None
    finally:
        pool.close()
    deadline.left(shown)
    return _Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, b"".join(chunks))


def _origin(url: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme.lower(), (p.hostname or "") + (f":{p.port}" if p.port else ""), "", "", ""))


class RobotsCache:
    """Parsed robots.txt per origin: at most ``size`` origins (least recently used leave first), each kept
    ``ttl`` seconds. Thread-safe."""

    def __init__(self, size: int = 1024, ttl: float = 3600.0):
        self.size, self.ttl = int(size), float(ttl)
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[float, RobotFileParser]] = OrderedDict()
        self.fetches = 0

    def get(self, origin: str) -> RobotFileParser | None:
        with self._lock:
            item = self._items.get(origin)
            if item is None or item[0] < time.monotonic():
                self._items.pop(origin, None)
                return None
            self._items.move_to_end(origin)
            return item[1]

    def put(self, origin: str, parser: RobotFileParser) -> None:
        with self._lock:
            self._items[origin] = (time.monotonic() + self.ttl, parser)
            self._items.move_to_end(origin)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


_robots_caches: dict[tuple[int, float], RobotsCache] = {}
_robots_lock = threading.Lock()


def robots_cache(settings) -> RobotsCache:
    """The process's robots cache for the settings' size and TTL."""
    key = (settings.source_robots_cache_size, settings.source_robots_ttl)
    with _robots_lock:
        cache = _robots_caches.get(key)
        if cache is None:
            cache = _robots_caches[key] = RobotsCache(*key)
        return cache


def robots_allow(url: str, *, policy: EgressPolicy, deadline: Deadline, cache: RobotsCache,
                 resolve=socket.getaddrinfo) -> bool:
    """Does robots.txt of ``url``'s origin let ``magpie-sources`` fetch ``url``? Raises :class:`FetchFailed`
    when robots.txt answers 5xx or cannot be read (the fetch is retried later)."""
    origin = _origin(url)
    parser = cache.get(origin)
    if parser is None:
        robots_url = origin + "/robots.txt"
        shown = shown_url(robots_url)
        reply = None
        for _ in range(3):  # robots.txt may redirect (http -> https, a www host): a few hops, guarded
            reply = request(robots_url, policy=policy, deadline=deadline, max_bytes=ROBOTS_MAX_BYTES,
                            resolve=resolve, what=shown)
            loc = reply.headers.get("location")
            if reply.status in _REDIRECTS and loc:
                robots_url = urljoin(robots_url, loc)
                continue
            break
        cache.fetches += 1
        parser = RobotFileParser()
        if reply.status in (401, 403):
            parser.disallow_all = True
        elif 400 <= reply.status < 500 or reply.status in _REDIRECTS:
            parser.allow_all = True
        elif reply.status >= 500:
            raise FetchFailed(f"robots.txt of {shown_url(origin)} answered HTTP {reply.status}; retried later")
        else:
            parser.parse(reply.body.decode("utf-8", "replace").splitlines())
        parser.modified()
        cache.put(origin, parser)
    return parser.can_fetch(ROBOTS_AGENT, url)


@dataclass
class FetchOptions:
    """What one fetch may do: ``max_bytes``, ``timeout`` (s, all in), ``max_redirects``, ``robots``
    (obey robots.txt), ``etag`` / ``last_modified`` (validators to send back)."""

    max_bytes: int
    timeout: float
    max_redirects: int = 5
    robots: bool = True
    etag: str | None = None
    last_modified: str | None = None

    @classmethod
    def from_settings(cls, settings, **kw) -> "FetchOptions":
        return cls(max_bytes=settings.source_max_bytes, timeout=settings.source_fetch_timeout,
                   max_redirects=settings.source_max_redirects, **kw)


def fetch(url: str, opts: FetchOptions, *, policy: EgressPolicy, robots: RobotsCache | None = None,
          resolve=socket.getaddrinfo, deadline: Deadline | None = None) -> Fetched:
    """Fetch a source list: robots.txt (when ``opts.robots``), conditional GET, redirects through the guard.

    Returns a :class:`Fetched` with a 2xx or 304 status. Raises :class:`FetchFailed` with one line: a refused
    host or redirect, robots.txt forbidding the URL, a non-2xx reply, the time or size bound."""
    deadline = deadline or Deadline.after(opts.timeout)
    robots = robots or RobotsCache()
    current = url
    first_origin = _origin(url)
    for hop in range(opts.max_redirects + 1):
        shown = shown_url(current)
        try:
            allowed = not opts.robots or robots_allow(current, policy=policy, deadline=deadline, cache=robots,
                                                      resolve=resolve)
        except FetchFailed as exc:
            if hop and "egress guard" in str(exc):
                raise FetchFailed(f"redirect to {shown} refused: {exc}") from None
            raise
        if not allowed:
            raise FetchFailed(f"{shown} is disallowed by robots.txt (add the source with --ignore-robots "
                              "to fetch it anyway)")
        headers = {}
        if hop == 0 and opts.etag:
            headers["If-None-Match"] = opts.etag
        if hop == 0 and opts.last_modified:
            headers["If-Modified-Since"] = opts.last_modified
        target = current
        if _origin(current) != first_origin:  # credentials go to the URL's own origin only
            p = urlsplit(current)
            target = urlunsplit((p.scheme, p.netloc.rsplit("@", 1)[-1], p.path, p.query, ""))
        try:
            reply = request(target, policy=policy, deadline=deadline, max_bytes=opts.max_bytes,
                            headers=headers, resolve=resolve)
        except FetchFailed as exc:
            if hop and "egress guard" in str(exc):
                raise FetchFailed(f"redirect to {shown} refused: {exc}") from None
            raise
        if reply.status in _REDIRECTS and reply.headers.get("location"):
            nxt = urljoin(current, reply.headers["location"].strip())
            if urlsplit(nxt).scheme.lower() not in ("http", "https"):
                raise FetchFailed(f"redirect from {shown} to a non-http(s) URL refused")
            current = nxt
            continue
        if reply.status == 304:
            return Fetched(304, b"", opts.etag, opts.last_modified, shown, hop, final=current)
        if not 200 <= reply.status < 300:
            raise FetchFailed(f"{shown} answered HTTP {reply.status}")
        return Fetched(reply.status, reply.body, reply.headers.get("etag"), reply.headers.get("last-modified"),
                       shown, hop, reply.headers.get("content-type"), current, reply.headers.get("link"))
    raise FetchFailed(f"{shown_url(url)}: more than {opts.max_redirects} redirects (MAGPIE_SOURCE_MAX_REDIRECTS)")


_LINK_NEXT = re.compile(r'<([^>]+)>\s*;[^,]*?rel\s*=\s*"?(?:[^",]*\s)?next(?:\s[^",]*)?"?', re.IGNORECASE)
_TAG = re.compile(r"<(?:a|link)\b[^>]*>", re.IGNORECASE)
_ATTR = re.compile(r'([a-z-]+)\s*=\s*(?:"([^"]*)"|\'([^\']*)\'|([^\s>]+))', re.IGNORECASE)


def next_page(body: bytes, link_header: str | None, base: str) -> str | None:
    """The absolute URL of the next page a reply names (``Link`` header ``rel="next"``, else an HTML
    ``<a>``/``<link>`` with ``rel`` holding ``next``), or None."""
    import html

    if link_header:
        m = _LINK_NEXT.search(link_header)
        if m:
            return urljoin(base, m.group(1).strip())
    head = body[:2 * 1024 * 1024].decode("utf-8", "replace")
    if "next" not in head.lower():
        return None
    for tag in _TAG.findall(head):
        attrs = {k.lower(): html.unescape(a or b or c) for k, a, b, c in _ATTR.findall(tag)}
        if "next" in attrs.get("rel", "").lower().split() and attrs.get("href"):
            return urljoin(base, attrs["href"].strip())
    return None


def fetch_pages(url: str, opts: FetchOptions, *, policy: EgressPolicy, robots: RobotsCache | None = None,
                max_pages: int = 1, resolve=socket.getaddrinfo) -> Fetched:
    """:func:`fetch` of ``url`` and of the next pages it names, up to ``max_pages`` pages (module docstring).

    Returns one :class:`Fetched`: the first page's status and validators, the joined bodies and the
    number of ``pages`` fetched. Raises :class:`FetchFailed` as :func:`fetch` does, for any page."""
    deadline = Deadline.after(opts.timeout)
    robots = robots or RobotsCache()
    first = fetch(url, opts, policy=policy, robots=robots, resolve=resolve, deadline=deadline)
    first.pages = 1
    if first.not_modified or max_pages <= 1:
        return first
    bodies, size, seen = [first.body], len(first.body), {url}
    current, body, link = first.final, first.body, first.link
    while first.pages < max_pages:
        nxt = next_page(body, link, current)
        if nxt is None or nxt in seen:
            break
        seen.add(nxt)
        rest = FetchOptions(opts.max_bytes - size, opts.timeout, opts.max_redirects, opts.robots)
        if rest.max_bytes <= 0:
            raise FetchFailed(f"{shown_url(url)}: pages are larger than {opts.max_bytes} bytes "
                              "(MAGPIE_SOURCE_MAX_BYTES)")
        page = fetch(nxt, rest, policy=policy, robots=robots, resolve=resolve, deadline=deadline)
        bodies.append(page.body)
        size += len(page.body) + 1
        first.pages += 1
        current, body, link = page.final, page.body, page.link
    first.body = b"\n".join(bodies)
    return first


__all__ = ["Deadline", "fetch_pages", "next_page", "FetchFailed", "FetchOptions", "Fetched", "RobotsCache", "fetch", "policy_of",
           "request", "robots_allow", "robots_cache"]
