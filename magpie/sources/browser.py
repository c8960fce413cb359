"""Rendering a ``--browser`` source in headless Chromium (Playwright), for lists a page builds by script.

Chromium never dials out itself: every request the page makes is intercepted (``context.route``) and
answered with a fetch through :func:`magpie.sources.fetch.fetch` (egress guard on every hop and redirect,
robots.txt, the fetch's one deadline, the size bound per response); anything else (WebSockets, WebRTC) is
pointed at a dead local proxy. The document is fetched first (robots.txt, redirects, the guard), then
rendered; the text of the rendered ``<body>`` is the list. Conditional GET is not used in this mode.

One Chromium per thread is started on first use and kept; ``MAGPIE_SOURCE_BROWSER_PAGES`` bounds the pages
a process renders at once. Without Playwright or the Chromium executable (``MAGPIE_SOURCE_CHROMIUM``) a
render fails with one line saying which is missing.
"""

from __future__ import annotations

import os
import threading

from magpie.sources.fetch import Deadline, Fetched, FetchFailed, FetchOptions, fetch

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
        "--force-webrtc-ip-handling-policy=disable_non_proxied_udp"]
MAX_REQUESTS = 64  # requests one render may make

_local = threading.local()
_pools: dict[int, threading.BoundedSemaphore] = {}
_pools_lock = threading.Lock()


def unavailable(executable: str) -> str | None:
    """Why ``--browser`` cannot run here (one line), or None when Playwright and Chromium are present."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "--browser needs Playwright (pip install playwright), which is not installed"
    if not os.access(executable, os.X_OK):
        return (f"--browser needs Chromium at {executable} (MAGPIE_SOURCE_CHROMIUM; Debian's chromium "
                "package), which is missing")
    return None


def _pool(pages: int) -> threading.BoundedSemaphore:
    with _pools_lock:
        sem = _pools.get(pages)
        if sem is None:
            sem = _pools[pages] = threading.BoundedSemaphore(pages)
        return sem


def _browser(executable: str):
    b = getattr(_local, "browser", None)
    if b is not None and b.is_connected():
        return b
    from playwright.sync_api import sync_playwright

    pw = getattr(_local, "pw", None)
    if pw is None:
        pw = _local.pw = sync_playwright().start()
    b = _local.browser = pw.chromium.launch(executable_path=executable, args=ARGS, headless=True)
    return b


def close_thread_browser() -> None:
    """Close this thread's Chromium and Playwright (benchmarks and tests; a worker keeps them)."""
    b, pw = getattr(_local, "browser", None), getattr(_local, "pw", None)
    _local.browser = _local.pw = None
    try:
        if b is not None:
            b.close()
    finally:
        if pw is not None:
            pw.stop()


def render(url: str, opts: FetchOptions, *, policy, robots, executable: str, pages: int = 2) -> Fetched:
    """Render ``url`` and return its body text as a :class:`Fetched` (status 200, ``body`` UTF-8 text).

    Raises :class:`FetchFailed`: Playwright or Chromium missing, the document's fetch failed (refused,
    robots.txt, status, bounds), or the render passed the deadline."""
    why = unavailable(executable)
    if why:
        raise FetchFailed(why)
    deadline = Deadline.after(opts.timeout)
    plain = FetchOptions(opts.max_bytes, opts.timeout, opts.max_redirects, opts.robots)
    doc = fetch(url, plain, policy=policy, robots=robots, deadline=deadline)
    with _pool(pages):
        from playwright.sync_api import Error as PlaywrightError

        browser = _browser(executable)
        ctx = browser.new_context(user_agent="magpie-sources/1", service_workers="block")
        count = [0]

        def answer(route):
            req = route.request
            count[0] += 1
            try:
                if req.method != "GET" or count[0] > MAX_REQUESTS:
                    route.abort("blockedbyclient")
                    return
                if count[0] == 1:
                    got = doc
                else:
                    got = fetch(req.url, plain, policy=policy, robots=robots, deadline=deadline)
                route.fulfill(status=got.status, body=got.body,
                              headers={"content-type": got.content_type or "application/octet-stream"})
            except FetchFailed:
                route.abort("blockedbyclient")

        try:
            ctx.route("**/*", answer)
            page = ctx.new_page()
            page.goto(url, wait_until="load", timeout=deadline.left(doc.url) * 1000)
            try:
                page.wait_for_load_state("networkidle", timeout=min(2.0, deadline.left(doc.url)) * 1000)
            except PlaywrightError:
                pass  # a page that keeps polling: take what it shows now
            text = page.inner_text("body", timeout=deadline.left(doc.url) * 1000)
        except PlaywrightError as exc:
            deadline.left(doc.url)
            first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
            raise FetchFailed(f"rendering {doc.url} failed: {first[:200]}") from None
        finally:
            ctx.close()
    body = text.encode("utf-8")
    if len(body) > opts.max_bytes:
        raise FetchFailed(f"{doc.url}: rendered text is larger than {opts.max_bytes} bytes (MAGPIE_SOURCE_MAX_BYTES)")
    return Fetched(200, body, None, None, doc.url, doc.redirects, "text/plain")


__all__ = ["close_thread_browser", "render", "unavailable"]
