"""Rendering a ``--browser`` source in headless Chromium (Playwright), for lists a page builds by script.

Chromium never dials out itself: every request the page makes is intercepted (``context.route``) and
answered with a fetch through :func:`magpie.sources.fetch.fetch` (egress guard on every hop and redirect,
robots.txt, the fetch's one deadline, the size bound per response); anything else (WebSockets, WebRTC) is
pointed at a dead local proxy. The document is fetched first (robots.txt, redirects, the guard), then
rendered; the text of the rendered ``<body>`` is the list. Conditional GET is not used in this mode.

One Chromium per process is started on first use and kept (:class:`BrowserPool`, async Playwright on a
thread of its own); ``MAGPIE_SOURCE_BROWSER_PAGES`` bounds the pages it renders at once. Without Playwright or the Chromium executable (``MAGPIE_SOURCE_CHROMIUM``) a
render fails with one line saying which is missing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading

from magpie.sources.fetch import Deadline, Fetched, FetchFailed, FetchOptions, fetch

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
        "--force-webrtc-ip-handling-policy=disable_non_proxied_udp"]
MAX_REQUESTS = 64  # requests one render may make



def unavailable(executable: str) -> str | None:
    """Why ``--browser`` cannot run here (one line), or None when Playwright and Chromium are present."""
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        return "--browser needs Playwright (pip install playwright), which is not installed"
    if not os.access(executable, os.X_OK):
        return (f"--browser needs Chromium at {executable} (MAGPIE_SOURCE_CHROMIUM; Debian's chromium "
                "package), which is missing")
    return None


class BrowserPool:
    """One headless Chromium per process, driven by async Playwright on an event-loop thread of its own,
    rendering at most ``pages`` pages at once (callers past that wait). Thread-safe: any thread may call
    :meth:`render`. Started on first use; :meth:`close` stops it."""

    def __init__(self, executable: str, pages: int):
        self.executable, self.pages = executable, int(pages)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="magpie-browser", daemon=True)
        self._thread.start()
        self._sem = asyncio.Semaphore(self.pages)
        self._start = asyncio.Lock()
        self._pw = self._browser = None
        self.pid = os.getpid()

    async def _ensure(self):
        async with self._start:
            if self._browser is None or not self._browser.is_connected():
                from playwright.async_api import async_playwright

                if self._pw is None:
                    self._pw = await async_playwright().start()
                self._browser = await self._pw.chromium.launch(executable_path=self.executable, args=ARGS,
                                                               headless=True)
            return self._browser

    async def _render(self, url: str, doc: Fetched, plain: FetchOptions, policy, robots, deadline: Deadline) -> str:
        from playwright.async_api import Error as PlaywrightError

        loop = asyncio.get_running_loop()
        async with self._sem:
            browser = await self._ensure()
            ctx = await browser.new_context(user_agent="magpie-sources/1", service_workers="block")
            count = [0]

            async def answer(route):
                req = route.request
                count[0] += 1
                try:
                    if req.method != "GET" or count[0] > MAX_REQUESTS:
                        await route.abort("blockedbyclient")
                        return
                    got = doc if count[0] == 1 else await loop.run_in_executor(
                        None, lambda: fetch(req.url, plain, policy=policy, robots=robots, deadline=deadline))
                    await route.fulfill(status=got.status, body=got.body,
                                        headers={"content-type": got.content_type or "application/octet-stream"})
                except FetchFailed:
                    await route.abort("blockedbyclient")

            try:
                await ctx.route("**/*", answer)
                page = await ctx.new_page()
                await page.goto(url, wait_until="load", timeout=deadline.left(doc.url) * 1000)
                try:
                    await page.wait_for_load_state("networkidle", timeout=min(2.0, deadline.left(doc.url)) * 1000)
                except PlaywrightError:
                    pass  # a page that keeps polling: take what it shows now
                return await page.inner_text("body", timeout=deadline.left(doc.url) * 1000)
            except PlaywrightError as exc:
                deadline.left(doc.url)
                first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
                raise FetchFailed(f"rendering {doc.url} failed: {first[:200]}") from None
            finally:
                await ctx.close()

    def render(self, url: str, doc: Fetched, plain: FetchOptions, policy, robots, deadline: Deadline) -> str:
        """The text of the rendered body of ``url`` whose document is ``doc``; raises :class:`FetchFailed`."""
        fut = asyncio.run_coroutine_threadsafe(self._render(url, doc, plain, policy, robots, deadline), self.loop)
        try:
            return fut.result(timeout=deadline.left(doc.url) + 5)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise FetchFailed(f"{doc.url}: time bound of {deadline.seconds:g} s reached while rendering "
                              "(MAGPIE_SOURCE_FETCH_TIMEOUT)") from None

    def close(self) -> None:
        """Close Chromium and Playwright and stop the loop thread."""
        async def stop():
            if self._browser is not None:
                await self._browser.close()
            if self._pw is not None:
                await self._pw.stop()

        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(10)


_pool: BrowserPool | None = None
_pool_lock = threading.Lock()


def browser_pool(executable: str, pages: int) -> BrowserPool:
    """This process's :class:`BrowserPool` (a new one after a fork or for other settings)."""
    global _pool
    with _pool_lock:
        p = _pool
        if p is None or p.pid != os.getpid() or (p.executable, p.pages) != (executable, int(pages)):
            if p is not None and p.pid == os.getpid():
                p.close()
            p = _pool = BrowserPool(executable, pages)
        return p


def close_browser_pool() -> None:
    """Stop this process's browser pool, if any (benchmarks and tests; a worker keeps it)."""
    global _pool
    with _pool_lock:
        p, _pool = _pool, None
    if p is not None and p.pid == os.getpid():
        p.close()


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
    text = browser_pool(executable, pages).render(url, doc, plain, policy, robots, deadline)
    body = text.encode("utf-8")
    if len(body) > opts.max_bytes:
        raise FetchFailed(f"{doc.url}: rendered text is larger than {opts.max_bytes} bytes (MAGPIE_SOURCE_MAX_BYTES)")
    return Fetched(200, body, None, None, doc.url, doc.redirects, "text/plain")


__all__ = ["BrowserPool", "browser_pool", "close_browser_pool", "render", "unavailable"]
