"""One proxy check: GET the judge through a route, time it, grade its anonymity.

A check makes up to ``attempts`` attempts, each bounded by ``timeout`` seconds, and stops at the first
success. Success means HTTP 200 with a body that is a judge echo (a JSON object with ``remote_addr`` and
``headers``). The caller may cancel between attempts through ``before_attempt`` (a lost lease).

Error classes in :attr:`CheckResult.error`:

- ``ConnectTimeout`` / ``ReadTimeout``: no connection, or no (complete) answer, within the timeout;
- ``ProxyError``: the HTTP proxy could not be reached or refused the request (e.g. CONNECT failed);
- ``SOCKSError``: the SOCKS proxy could not be reached, refused the credentials or the destination;
- ``SSLError``: TLS to an https judge failed;
- ``ConnectionError``: any other connection failure (e.g. the proxy hung up without an answer);
- ``BadStatus``: the judge (or the proxy) answered with a status other than 200;
- ``BadEcho``: status 200 but the body is not a judge echo (or is larger than the parse limit);
- ``Aborted``: ``before_attempt`` returned False;
- ``UnsupportedProtocol``: the route's protocol is not one of http, https, socks4, socks5.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests
import socks  # PySocks, used by requests[socks]

from magpie.checker.anonymity import LEVELS, classify, normalize_ip
from magpie.routes import Route

CONNECTION_ERRORS = frozenset(
    {"ConnectTimeout", "ReadTimeout", "ProxyError", "SOCKSError", "SSLError", "ConnectionError"}
)
"""Error classes meaning the judge was never reached or never answered."""

MAX_ECHO_BYTES = 64 * 1024
"""Bodies above this size are not parsed as an echo (error ``BadEcho``)."""

USER_AGENT = "magpie-checker/1"
_RELEARN_AFTER_S = 30.0  # back-off before retrying to learn the own address after a failure

_FIELDS = (
    "alive", "latency_ms", "status", "attempts", "error", "body", "anonymity", "judge", "checked_at_ms"
)


def now_ms() -> int:
    """Wall-clock time in whole Unix milliseconds."""
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class CheckResult:
    """Outcome of one check of one route.

    Attributes:
        alive: True only when an attempt got HTTP 200 with a valid judge echo.
        latency_ms: elapsed milliseconds of the successful attempt (request sent to body read); None if
            not alive.
        status: HTTP status of the last attempt that got an answer, else None.
        attempts: attempts actually made (0 when aborted before the first one).
        error: error class of the last attempt (see module doc), None when alive.
        body: the last judge response body, first ``body_cap`` bytes decoded as UTF-8 (bad bytes
            replaced), or None when there was no body.
        anonymity: "transparent", "anonymous", "elite", or None (not alive, or own address unknown).
        judge: the judge URL used.
        checked_at_ms: wall clock when the check finished, Unix ms.
    """

    alive: bool
    latency_ms: float | None
    status: int | None
    attempts: int
    error: str | None
    body: str | None
    anonymity: str | None
    judge: str
    checked_at_ms: int

    def to_fields(self) -> dict[str, str]:
        """Flat ``str -> str`` dict for a Redis Stream entry; ``alive`` is "1"/"0", None becomes ""."""

        def s(v) -> str:
            if v is None:
                return ""
            if isinstance(v, float):
                return repr(v)
            return str(v)

        return {
            "alive": "1" if self.alive else "0",
            "latency_ms": s(self.latency_ms),
            "status": s(self.status),
            "attempts": str(self.attempts),
            "error": s(self.error),
            "body": s(self.body),
            "anonymity": s(self.anonymity),
            "judge": self.judge,
            "checked_at_ms": str(self.checked_at_ms),
        }

    @classmethod
    def from_fields(cls, d: Mapping[str | bytes, str | bytes]) -> CheckResult:
        """Inverse of :meth:`to_fields`; keys and values may be ``bytes`` (UTF-8), extra keys are ignored.

        Empty strings read back as None (so an empty ``body`` becomes None).
        Raises ``ValueError`` when a field is missing or malformed.
        """
        f: dict[str, str] = {}
        try:
            for k, v in d.items():
                key = k.decode() if isinstance(k, bytes) else str(k)
                if key in _FIELDS:
                    f[key] = v.decode() if isinstance(v, bytes) else str(v)
        except (UnicodeDecodeError, AttributeError) as exc:
            raise ValueError(f"check result fields are not UTF-8 text: {exc}") from None
        missing = [k for k in _FIELDS if k not in f]
        if missing:
            raise ValueError(f"check result fields missing: {', '.join(missing)}")
        if f["alive"] not in ("0", "1"):
            raise ValueError(f"check result alive must be '0' or '1', got {f['alive']!r}")
        if f["anonymity"] and f["anonymity"] not in LEVELS:
            raise ValueError(f"check result anonymity unknown: {f['anonymity']!r}")
        if not f["judge"]:
            raise ValueError("check result judge is empty")
        try:
            latency = float(f["latency_ms"]) if f["latency_ms"] else None
            status = int(f["status"]) if f["status"] else None
            attempts = int(f["attempts"])
            checked_at = int(f["checked_at_ms"])
        except ValueError as exc:
            raise ValueError(f"check result number malformed: {exc}") from None
        if latency is not None and (not math.isfinite(latency) or latency < 0):
            raise ValueError(f"check result latency_ms out of range: {latency!r}")
        if attempts < 0:
            raise ValueError(f"check result attempts negative: {attempts}")
        return cls(
            alive=f["alive"] == "1",
            latency_ms=latency,
            status=status,
            attempts=attempts,
            error=f["error"] or None,
            body=f["body"] or None,
            anonymity=f["anonymity"] or None,
            judge=f["judge"],
            checked_at_ms=checked_at,
        )


def proxy_url(route: Route) -> str:
    """The URL handed to requests for ``route`` (credentials percent-encoded).

    ``http`` and ``https`` routes are plain-HTTP proxies (an "https proxy" in proxy lists is one that
    accepts CONNECT); ``socks4`` resolves names locally, ``socks5`` remotely (``socks5h``).
    Raises ``ValueError`` for an unknown protocol.
    """
    scheme = {"http": "http", "https": "http", "socks4": "socks4", "socks5": "socks5h"}.get(route.protocol)
    if scheme is None:
        raise ValueError(f"unsupported protocol {route.protocol!r}")
    return scheme + route.url()[len(route.protocol) :]


def parse_echo(raw: bytes) -> dict | None:
    """The judge echo in ``raw`` as a dict, or None when ``raw`` is not one.

    A valid echo is a JSON object whose ``remote_addr`` is a string and ``headers`` an object.
    """
    if len(raw) > MAX_ECHO_BYTES:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    if not isinstance(doc.get("remote_addr"), str) or not isinstance(doc.get("headers"), dict):
        return None
    return doc


def _chain(exc: BaseException) -> Iterable[BaseException]:
    """``exc`` and everything it wraps (causes, contexts, urllib3 reasons, exception args)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for nxt in (e.__cause__, e.__context__, getattr(e, "reason", None), *getattr(e, "args", ())):
            if isinstance(nxt, BaseException):
                todo.append(nxt)


def error_class(exc: BaseException) -> str:
    """Map an exception raised while fetching the judge to an error class (see module doc)."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return "ConnectTimeout"
    if isinstance(exc, requests.exceptions.Timeout | TimeoutError):
        return "ReadTimeout"
    if isinstance(exc, requests.exceptions.SSLError):
        return "SSLError"
    if any(isinstance(e, socks.ProxyError) for e in _chain(exc)):
        return "SOCKSError"
    if isinstance(exc, requests.exceptions.ProxyError):
        return "ProxyError"
    if isinstance(exc, requests.exceptions.ConnectionError | ConnectionError | OSError):
        return "ConnectionError"
    if isinstance(exc, requests.exceptions.ChunkedEncodingError | requests.exceptions.ContentDecodingError):
        return "ConnectionError"
    return type(exc).__name__


@dataclass(slots=True)
class _Attempt:
    ok: bool
    status: int | None = None
    error: str | None = None
    raw: bytes | None = None
    echo: dict | None = None
    latency_ms: float | None = None


class Checker:
    """Checks routes against one judge. Thread-safe: one instance may serve many threads.

    Args:
        judge_url: the judge to GET (http or https).
        timeout: seconds per attempt for connecting and for each read; the whole body read is also
            bounded by it.
        attempts: at most this many attempts per check (>= 1).
        body_cap: bytes of the judge's body kept in the result (>= 0).
        own_addresses: known own addresses, skipping :meth:`learn_own_address`.

    Raises ``ValueError`` for a non-positive timeout or attempts, or a negative body_cap.
    """

    def __init__(
        self,
        judge_url: str,
        timeout: float = 10.0,
        attempts: int = 2,
        body_cap: int = 2048,
        *,
        own_addresses: Iterable[str] | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts!r}")
        if body_cap < 0:
            raise ValueError(f"body_cap must be >= 0, got {body_cap!r}")
        self.judge_url = judge_url
        self.timeout = float(timeout)
        self.attempts = int(attempts)
        self.body_cap = int(body_cap)
        self._lock = threading.Lock()
        self._own: frozenset[str] | None = frozenset(own_addresses) if own_addresses else None
        self._learn_failed_at: float | None = None

    @classmethod
    def from_settings(cls, settings) -> Checker:
        """A checker configured from :class:`magpie.config.Settings` (judge_url, check_timeout, ...)."""
        return cls(settings.judge_url, settings.check_timeout, settings.check_attempts, settings.body_cap)

    @property
    def own_addresses(self) -> frozenset[str] | None:
        """The cached own addresses, or None when not learned yet."""
        return self._own

    def _fetch(self, session: requests.Session, proxies: dict[str, str] | None) -> _Attempt:
        """One GET of the judge; never raises for network trouble."""
        start = time.perf_counter()
        try:
            resp = session.get(
                self.judge_url,
                proxies=proxies or {},
                timeout=(self.timeout, self.timeout),
                stream=True,
                allow_redirects=False,
                headers={"User-Agent": USER_AGENT, "Accept": "application/json, */*"},
            )
        except Exception as exc:  # noqa: BLE001 (any failure is a result, not a crash)
            return _Attempt(ok=False, error=error_class(exc))
        try:
            deadline = start + self.timeout
            buf = bytearray()
            limit = max(self.body_cap, MAX_ECHO_BYTES) + 1
            try:
                for chunk in resp.iter_content(8192):
                    buf += chunk
                    if len(buf) >= limit:
                        break
                    if time.perf_counter() > deadline:
                        return _Attempt(
                            ok=False, status=resp.status_code, error="ReadTimeout", raw=bytes(buf)
                        )
            except Exception as exc:  # noqa: BLE001
                return _Attempt(ok=False, status=resp.status_code, error=error_class(exc), raw=bytes(buf))
            elapsed_ms = round((time.perf_counter() - start) * 1000.0, 3)
            raw = bytes(buf)
            if resp.status_code != 200:
                return _Attempt(ok=False, status=resp.status_code, error="BadStatus", raw=raw)
            echo = parse_echo(raw)
            if echo is None:
                return _Attempt(ok=False, status=200, error="BadEcho", raw=raw)
            return _Attempt(ok=True, status=200, raw=raw, echo=echo, latency_ms=elapsed_ms)
        finally:
            resp.close()

    @staticmethod
    def _session() -> requests.Session:
        s = requests.Session()
        s.trust_env = False  # environment proxies and netrc must never interfere
        return s

    def learn_own_address(self, refresh: bool = False) -> set[str] | None:
        """Learn (and cache) the addresses the judge sees for this host when reached without a proxy.

        One direct GET of the judge. The result holds the echoed ``remote_addr`` plus the local source
        address towards the judge (they differ behind NAT), normalized. Cached after the first success; pass
        ``refresh=True`` to ask again. Returns None when the judge is unreachable or its answer is not an
        echo (nothing is cached then).
        """
        if not refresh and self._own is not None:
            return set(self._own)
        with self._session() as session:
            att = self._fetch(session, None)
        if not att.ok or att.echo is None:
            with self._lock:
                self._learn_failed_at = time.monotonic()
            return None
        own = {normalize_ip(att.echo["remote_addr"]) or att.echo["remote_addr"].strip()}
        local = self._local_address()
        if local:
            own.add(local)
        with self._lock:
            self._own = frozenset(own)
            self._learn_failed_at = None
        return set(own)

    def _local_address(self) -> str | None:
        """Source address the OS picks towards the judge (a UDP route lookup; no packet is sent)."""
        u = urlsplit(self.judge_url)
        try:
            port = u.port or (443 if u.scheme == "https" else 80)
            infos = socket.getaddrinfo(u.hostname, port, type=socket.SOCK_DGRAM)
            family, _, _, _, addr = infos[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                return normalize_ip(s.getsockname()[0])
        except (OSError, ValueError, IndexError, TypeError):
            return None

    def _own_for_grading(self) -> frozenset[str] | None:
        if self._own is not None:
            return self._own
        failed = self._learn_failed_at
        if failed is not None and time.monotonic() - failed < _RELEARN_AFTER_S:
            return None
        learned = self.learn_own_address()
        return frozenset(learned) if learned else None

    def _body(self, raw: bytes | None) -> str | None:
        if raw is None:
            return None
        return raw[: self.body_cap].decode("utf-8", "replace")

    def check(self, route: Route, before_attempt: Callable[[int], bool] | None = None) -> CheckResult:
        """Check ``route`` against the judge.

        Args:
            route: the proxy to go through.
            before_attempt: called as ``before_attempt(n)`` before attempt ``n`` (1-based); returning
                False stops the check with error ``"Aborted"`` (exceptions it raises propagate).

        Returns a :class:`CheckResult`; network failures never raise. When the own address is not known
        yet, it is learned on the first successful attempt (one direct GET; retried at most every 30 s).
        """
        try:
            proxy = proxy_url(route)
        except ValueError:
            return CheckResult(
                False, None, None, 0, "UnsupportedProtocol", None, None, self.judge_url, now_ms()
            )
        proxies = {"http": proxy, "https": proxy}
        last: _Attempt | None = None
        made = 0
        with self._session() as session:
            for n in range(1, self.attempts + 1):
                if before_attempt is not None and not before_attempt(n):
                    return CheckResult(
                        alive=False,
                        latency_ms=None,
                        status=last.status if last else None,
                        attempts=made,
                        error="Aborted",
                        body=self._body(last.raw) if last else None,
                        anonymity=None,
                        judge=self.judge_url,
                        checked_at_ms=now_ms(),
                    )
                made += 1
                last = self._fetch(session, proxies)
                if last.ok:
                    break
        assert last is not None
        anonymity = None
        if last.ok and last.echo is not None:
            own = self._own_for_grading()
            anonymity = classify(last.echo, own) if own else None
        return CheckResult(
            alive=last.ok,
            latency_ms=last.latency_ms if last.ok else None,
            status=last.status,
            attempts=made,
            error=None if last.ok else last.error,
            body=self._body(last.raw),
            anonymity=anonymity,
            judge=self.judge_url,
            checked_at_ms=now_ms(),
        )


def check_many(routes: Iterable[Route], checker: Checker, concurrency: int = 16) -> list[CheckResult]:
    """Check ``routes`` with ``concurrency`` threads; results come back in the order of ``routes``.

    Learns the own address once up front so that every result can be graded. Raises ``ValueError`` when
    ``concurrency`` < 1.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency!r}")
    routes = list(routes)
    if not routes:
        return []
    if checker.own_addresses is None:
        checker.learn_own_address()
    workers = min(concurrency, len(routes))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="magpie-check") as ex:
        return list(ex.map(checker.check, routes))
