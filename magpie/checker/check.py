"""Synchronous face of the check engine, for the CLI, scripts and tests.

:class:`Checker` runs a :class:`magpie.checker.engine.CheckEngine` on a private event loop in a daemon
thread, so any thread may call it; :func:`check_many` checks a whole list on that loop with a bound on the
checks in flight. Workers do not use this: they run the engine inside :mod:`magpie.pipeline.checkpool`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable

from magpie.base.collector import tune_collector
from magpie.checker.engine import CheckEngine
from magpie.checker.result import CheckResult
from magpie.base.routes import Route


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when it is installed (it measured cheaper per check), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """An event loop running in a daemon thread; :meth:`run` submits a coroutine and waits for it."""

    def __init__(self, name: str = "magpie-loop"):
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float | None = None):
        """Run ``coro`` on the loop and return its result (its exception propagates)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class Checker:
    """Checks routes against one judge. Thread-safe: one instance may serve many threads.

    Args:
        judge_url: the judge to GET (http or https).
        timeout: hard deadline in seconds over one attempt (connect, handshake and the whole answer).
        attempts: at most this many attempts per check (>= 1).
        body_cap: bytes of the judge's body kept in the result (>= 0).
        own_addresses: known own addresses, skipping :meth:`learn_own_address`.
        connect_timeout: seconds for the TCP connect to the proxy (default: ``timeout``); the handshake
            counts against ``timeout``.
        egress: a :class:`magpie.base.egress.EgressPolicy` guarding every destination (None: no guard).
        ssl_context: TLS context for an https judge (default: the system trust store).

    Raises ``ValueError`` for a non-positive timeout or attempts, a negative body_cap or a judge URL
    that is not http(s).
    """

    def __init__(self, judge_url: str, timeout: float = 10.0, attempts: int = 2, body_cap: int = 2048, *,
                 own_addresses: Iterable[str] | None = None, connect_timeout: float | None = None,
                 egress=None, ssl_context=None) -> None:
        self.engine = CheckEngine(judge_url, timeout, attempts, body_cap, connect_timeout=connect_timeout,
                                  own_addresses=own_addresses, egress=egress, ssl_context=ssl_context)
        self._loop: LoopThread | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings) -> Checker:
        """A checker configured from a :class:`magpie.config.CheckSettings` (or a whole Settings)."""
        from magpie.checker.tls import is_https, judge_ssl_context
        from magpie.base.egress import EgressPolicy

        c = getattr(settings, "checks", settings)
        tls = judge_ssl_context(getattr(c, "judge_ca_bundle", None)) if is_https(c.judge_url) else None
        return cls(c.judge_url, c.timeout, c.attempts, c.body_cap, connect_timeout=c.connect_timeout,
                   egress=EgressPolicy(c.allow_private, "MAGPIE_CHECK_ALLOW_PRIVATE"), ssl_context=tls)

    judge_url = property(lambda self: self.engine.judge_url)
    timeout = property(lambda self: self.engine.timeout)
    attempts = property(lambda self: self.engine.attempts)

    @property
    def own_addresses(self) -> frozenset[str] | None:
        """The cached own addresses, or None when not learned yet."""
        return self.engine.own_addresses

    def _run(self, coro):
        with self._lock:
            if self._loop is None:
                self._loop = LoopThread("magpie-checker")
        return self._loop.run(coro)

    def learn_own_address(self, refresh: bool = False) -> set[str] | None:
        """See :meth:`CheckEngine.learn_own_address`."""
        return self._run(self.engine.learn_own_address(refresh))

    def judge_reachable(self) -> bool:
        """True when the judge answers a direct GET with an echo (probed now)."""
        return self._run(self.engine.judge_reachable(max_age=0))

    def check(self, route: Route, before_attempt: Callable[[int], bool] | None = None) -> CheckResult:
        """Check ``route``; see :meth:`CheckEngine.check` (``before_attempt`` runs on the loop thread)."""
        return self._run(self.engine.check(route, before_attempt))

    def check_many(self, routes: Iterable[Route], concurrency: int = 512,
                   on_result: Callable[[int, CheckResult], None] | None = None) -> list[CheckResult]:
        """Check ``routes`` with at most ``concurrency`` checks in flight; results in the order of ``routes``.

        Learns the own address once up front so that every result can be graded. ``on_result(i, result)``
        is called (on the loop thread) as each check finishes. Raises ``ValueError`` when
        ``concurrency`` < 1.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency!r}")
        routes = list(routes)
        if not routes:
            return []
        return self._run(_check_all(self.engine, routes, concurrency, on_result))

    def close(self) -> None:
        """Stop the private loop thread (a later call starts a new one)."""
        with self._lock:
            if self._loop is not None:
                self._loop.stop()
                self._loop = None


async def _check_all(engine: CheckEngine, routes: list[Route], concurrency: int,
                     on_result: Callable[[int, CheckResult], None] | None) -> list[CheckResult]:
    if engine.own_addresses is None:
        await engine.learn_own_address()
    results: list[CheckResult | None] = [None] * len(routes)
    it = iter(enumerate(routes))

    async def lane() -> None:
        for i, route in it:
            results[i] = res = await engine.check(route)
            if on_result is not None:
                on_result(i, res)

    await asyncio.gather(*(lane() for _ in range(min(concurrency, len(routes)))))
    return results  # type: ignore[return-value]


def check_many(routes: Iterable[Route], checker: Checker, concurrency: int = 512) -> list[CheckResult]:
    """Check ``routes`` with ``checker``, at most ``concurrency`` at once; see :meth:`Checker.check_many`."""
    return checker.check_many(routes, concurrency)


_SPREAD: dict = {}  # what forked children of check_spread read: the checker's arguments and each share


def _check_share(i: int) -> list[CheckResult]:
    kwargs, shares, width, counter = _SPREAD["kwargs"], _SPREAD["shares"], _SPREAD["width"], _SPREAD["counter"]
    tune_collector()
    checker = Checker(**kwargs)
    pending = [0]

    def tick(_i, _r):  # progress in steps of 64, one lock per step
        pending[0] += 1
        if pending[0] >= 64:
            with counter.get_lock():
                counter.value += pending[0]
            pending[0] = 0

    try:
        return checker.check_many(shares[i], width, on_result=tick)
    finally:
        with counter.get_lock():
            counter.value += pending[0]
        checker.close()


def check_spread(routes: Iterable[Route], checker_kwargs: dict, *, processes: int, per_process: int,
                 progress: Callable[[int], None] | None = None) -> list[CheckResult]:
    """Check ``routes`` over ``processes`` forked processes, each with its own event loop and at most
    ``per_process`` checks in flight; results in the order of ``routes``. Each forked process runs the
    garbage collector on a timer (:func:`magpie.base.collector.tune_collector`).

    One event loop is bound by one core and one process's open-file limit (a check holds a socket), so a
    list of mostly dead proxies, each costing a whole timeout, needs several processes to keep tens of
    thousands of checks in flight. Routes are dealt out round-robin, so every process gets the same mix.

    Args:
        checker_kwargs: :class:`Checker` arguments (inherited by the children through ``fork``, never
            pickled; give ``own_addresses`` so that no child asks the judge again).
        processes: >= 1; 1 checks in this process.
        per_process: checks in flight per process (>= 1; already capped below the fd limit).
        progress: ``progress(done)`` called about twice a second with the results counted so far.
    Raises ``ValueError`` for ``processes`` or ``per_process`` below 1.
    """
    import multiprocessing as mp
    import time

    routes = list(routes)
    if processes < 1 or per_process < 1:
        raise ValueError(f"processes and per_process must be >= 1, got {processes!r}, {per_process!r}")
    processes = max(1, min(processes, len(routes)))
    if processes == 1:
        checker = Checker(**checker_kwargs)
        try:
            return checker.check_many(routes, per_process,
                                      on_result=(lambda i, _r: progress(i + 1)) if progress else None)
        finally:
            checker.close()
    ctx = mp.get_context("fork")
    counter = ctx.Value("q", 0)
    _SPREAD.update(kwargs=checker_kwargs, shares=[routes[i::processes] for i in range(processes)],
                   width=per_process, counter=counter)
    try:
        with ctx.Pool(processes) as pool:
            pending = pool.map_async(_check_share, range(processes))
            while not pending.ready():
                pending.wait(0.5)
                if progress is not None:
                    progress(counter.value)
            per_share = pending.get()
    finally:
        _SPREAD.clear()
    out: list[CheckResult | None] = [None] * len(routes)
    for i, share in enumerate(per_share):
        out[i::processes] = share
    if progress is not None:
        progress(len(routes))
    return out  # type: ignore[return-value]
