"""The check pool: one per check-worker process, leases in, completed results out.

A check message carries many leases. :meth:`CheckPool.submit` admits them into the process's pool and
returns; each lease starts as soon as one of the engine's slots is free (up to ``capacity`` checks at once
on one event loop). The pool's own coroutines then keep the leases moving:

- **completion flush** every ``complete_interval`` seconds (~100 ms): the leases whose checks finished
  since the last flush are completed and their results appended to the results stream in one atomic,
  fenced script call (``complete.lua``): a result is recorded if and only if its lease completed, and a
  slow route never holds back a fast one;
- **renewal** once a second: leases with less than ``renew_below_ms`` left are renewed in one pipelined
  round trip; a refused renewal (the lease was lost) cancels the check in flight at once, and a lease past
  its expiry is cancelled too;
- **start marks and quarantine**: admitted leases are marked as started (one ``HSET`` per message,
  :meth:`RouteQueue.mark_started`), so that only a lease that started checking is evidence against its
  route if it expires; a route in quarantine (:attr:`Lease.alone`) is checked alone: one at a time per
  process, and only while this pool holds the deployment's quarantine slot
  (:class:`magpie.queue.quarantine.QuarantineSlot`), and it is marked right before its check starts, so
  that a crash during it is its own;
- **hand-back**: a lease that could not start before ``expiry - max_check_seconds`` is released unchecked
  (``release.lua``), claimable again at once, with no stall counted;
- **capacity heartbeat**: the engine's slots are announced to :class:`magpie.queue.capacity.CapacityRegistry`
  so promote claims no more than the engines can run.

Redis calls run in one dedicated I/O thread so the event loop never blocks on them. When the judge
itself is unreachable a failed check is not the route's fault: the route is retried on the backoff curve
and no result is published. A result whose lease was lost is dropped.

One module on purpose: admission, the slots, completion flushes, renewals, hand-back and the heartbeat
share the pool's state and one event loop; split apart they would pass that state back and forth.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis as redis_lib

from magpie.backoff import Backoff
from magpie.checker.check import LoopThread
from magpie.checker.engine import CheckEngine
from magpie.checker.result import CheckResult
from magpie.queue import COMPLETED, Lease, Payload, PayloadError, RouteQueue
from magpie.queue.capacity import CapacityRegistry
from magpie.queue.completion import Completion, StreamTarget
from magpie.queue.quarantine import withdraw_starts
from magpie.stats.entry import entry_fields

log = logging.getLogger(__name__)

_COMPLETE_CHUNK = 500  # leases per completion script call (its arguments stay well below Lua's limits)



@dataclass
class BatchReport:
    """Outcome counts of one completion flush (or, summed, of a pool's life).

    Attributes: ``completed`` (cycles completed and published), ``lease_lost`` (results dropped: renewal or
    completion refused), ``aborted`` (checks stopped because the lease was lost), ``malformed`` (payloads
    that do not decode; left to expire), ``retried`` (judge unreachable: backoff retry), ``handed_back``
    (released unchecked, too late to start), ``stale_completions`` (completions refused as stale),
    ``published`` (stream entries written), ``dropped`` (results lost to the stream's bound; their routes
    were still completed), ``overran`` (checks stopped by the pool's last guard, recorded as ReadTimeout:
    the event loop fell far behind its deadlines), ``refused`` (completions, retries and hand-backs the
    schedule refused, e.g. Redis at ``maxmemory``: results dropped, start marks withdrawn, no stall).
    """

    completed: int = 0
    lease_lost: int = 0
    aborted: int = 0
    malformed: int = 0
    retried: int = 0
    handed_back: int = 0
    stale_completions: int = 0
    published: int = 0
    dropped: int = 0
    overran: int = 0
    refused: int = 0

    def add(self, other: BatchReport) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


Record = Callable[[BatchReport, list[dict[str, str]]], object]


def result_entry(payload: Payload, res: CheckResult) -> dict[str, str]:
    """The stream entry of one completed check: the result with the route's id and hash
    (:func:`magpie.stats.entry.entry_fields`), plus ``wf`` (each owner's outcome) when the check ran per
    workspace profile (:attr:`CheckResult.owners`)."""
    fields = entry_fields(res, payload.route_id, payload.route_hash)
    if res.owners:
        fields["wf"] = res.owners
    return fields


def _unmark_quietly(queue, lease: Lease) -> None:
    try:
        queue.unmark_started([lease])
    except Exception:  # noqa: BLE001 - the mark then stays: a crash before completion counts, as before
        log.debug("could not withdraw the start mark of %s", lease.member, exc_info=True)


@dataclass
class _Running:
    lease: Lease
    task: asyncio.Task | None = None


@dataclass
class PoolStats:
    """A snapshot of a pool: ``capacity``, ``running``, ``pending`` (admitted, not started),
    ``peak_running`` and the summed :class:`BatchReport` ``totals``."""

    capacity: int
    running: int
    pending: int
    peak_running: int
    totals: BatchReport = field(default_factory=BatchReport)


class CheckPool:
    """Runs leased checks on one event loop thread; see the module doc for the flow.

    Args:
        queue: the schedule the leases come from.
        engine: the :class:`CheckEngine` to check with (bound to this pool's loop once started).
        stream: the results stream completion appends to (:class:`magpie.queue.completion.StreamTarget`;
            policy ``block`` waits up to ``block_timeout`` seconds for room, then drops the new results).
        capacity: most checks at once (already capped by the descriptor limit).
        renew_below_ms: renew a lease when fewer ms than this remain.
        backoff: delay curve for judge-unreachable retries (attempt = the route's retry count + 1).
        registry: where to announce ``capacity``; None announces nothing (tests, one-shot runs).
        record: ``record(report, entries)`` after every flush with outcomes (metrics); optional.
        complete_interval: seconds between completion flushes.
        heartbeat: seconds between capacity announcements (their TTL is three of these).
        lateness: optional ``lateness(leases)`` called at admission (metrics of claim lateness).
        payload_cipher: opens payloads with sealed credentials (:attr:`magpie.crypto.Keyring.queue`);
            without it such a payload counts as malformed.
        quarantine: the deployment's :class:`magpie.queue.quarantine.QuarantineSlot`; None: quarantined
            checks are alone in this process only (tests, one-shot runs).
    """

    def __init__(self, queue: RouteQueue, engine: CheckEngine, stream: StreamTarget, *, capacity: int,
                 renew_below_ms: float, backoff: Backoff | None = None, registry: CapacityRegistry | None = None,
                 record: Record | None = None, complete_interval: float = 0.1, heartbeat: float = 2.0,
                 lateness: Callable[[Sequence[Lease]], object] | None = None, payload_cipher=None,
                 block_timeout: float = 2.0, quarantine=None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.queue = queue
        self.engine = engine
        self.stream = stream
        self.block_timeout = float(block_timeout)
        self.capacity = int(capacity)
        self.backlog = max(1, self.capacity // 10)
        self.renew_below_ms = float(renew_below_ms)
        self.backoff = backoff or Backoff("exponential", 5_000, 300_000, 2.0, "full")
        self.registry = registry
        self.record = record
        self.lateness = lateness
        self.payload_cipher = payload_cipher
        self.quarantine = quarantine
        self.owner_changes = None  # optional: applies pending owner drops at flush (magpie.judges.ownership)
        self.complete_interval = float(complete_interval)
        self.heartbeat = float(heartbeat)
        self.instance = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.totals = BatchReport()
        self.peak_running = 0
        self._start_margin_ms = engine.max_check_seconds * 1000.0
        # last guard over a whole check: the engine's own deadlines plus room for a loaded event loop
        self._guard_s = engine.max_check_seconds * 1.25 + 5.0
        self._pending: deque[Lease] = deque()
        self._alone: deque[Lease] = deque()  # quarantined leases, checked one at a time
        self._alone_busy = False
        self._running: dict[int, _Running] = {}
        self._done: list[tuple[Lease, Payload, CheckResult]] = []
        self._retry: list[Lease] = []
        self._handback: list[Lease] = []
        self._counts = BatchReport()  # outcomes found on the loop since the last flush
        self._loop: LoopThread | None = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="magpie-io")
        self._room: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._services: list[asyncio.Task] = []
        self._closing = False
        self._start_lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> CheckPool:
        """Start the loop thread and the pool's coroutines (idempotent); returns ``self``."""
        with self._start_lock:
            if self._loop is None:
                self._loop = LoopThread("magpie-checks")
                self._loop.run(self._start())
        return self

    async def _start(self) -> None:
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._services = [asyncio.ensure_future(self._flush_loop()), asyncio.ensure_future(self._renew_loop())]
        if self.registry is not None:
            self._services.append(asyncio.ensure_future(self._heartbeat_loop()))

    def close(self, timeout: float = 10.0) -> None:
        """Stop: cancel running checks, hand every held lease back (no stall), flush, withdraw capacity."""
        if self._loop is None:
            return
        try:
            self._loop.run(self._close(), timeout)
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.exception("check pool did not close cleanly")
        self._loop.stop()
        self._loop = None
        self._io.shutdown(wait=True)

    async def _close(self) -> None:
        self._closing = True
        if self._room is not None:
            self._room.set()
        for svc in self._services:
            svc.cancel()
        self._handback.extend(self._pending)
        self._handback.extend(self._alone)
        self._pending.clear()
        self._alone.clear()
        tasks = [r.task for r in self._running.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._flush()
        if self.registry is not None:
            try:
                await self._in_io(self.registry.withdraw, self.instance)
            except Exception:  # noqa: BLE001
                log.warning("could not withdraw check capacity of %s", self.instance)

    # -- admission ----------------------------------------------------------------------------------
    def submit(self, leases: Sequence[Lease], timeout: float | None = None) -> int:
        """Admit ``leases`` (thread-safe); blocks while a backlog of ``backlog`` leases (a tenth of the
        capacity) already waits to start, so a full process leaves the next messages to one with free slots. Returns the count admitted."""
        self.start()
        if self.lateness is not None and leases:
            try:
                self.lateness(leases)
            except Exception:  # noqa: BLE001 - metrics never stop checks
                log.debug("lateness metric failed", exc_info=True)
        fut = asyncio.run_coroutine_threadsafe(self._admit(list(leases)), self._loop.loop)
        try:
            return fut.result(timeout)
        except BaseException:  # a time limit or shutdown: leases not admitted are handed back
            fut.cancel()
            raise

    async def _admit(self, leases: list[Lease]) -> int:
        assert self._room is not None and self._idle is not None
        try:
            while len(self._pending) >= self.backlog and not self._closing:
                self._room.clear()
                await self._room.wait()
        except asyncio.CancelledError:
            self._handback.extend(leases)
            raise
        if self._closing:
            self._handback.extend(leases)
            return 0
        regular = [le for le in leases if not le.alone]
        if regular:
            try:
                await self._in_io(self.queue.mark_started, regular)
            except Exception:  # noqa: BLE001 - unmarked leases are simply no evidence if they expire
                log.warning("could not record that %d leases started (Redis unavailable?)", len(regular))
        self._pending.extend(regular)
        self._alone.extend(le for le in leases if le.alone)
        self._idle.clear()
        self._fill()
        return len(leases)

    def _fill(self) -> None:
        """Start pending leases while slots are free; hand back those too late to start."""
        loop = asyncio.get_running_loop()
        while self._pending and len(self._running) < self.capacity and not self._closing:
            le = self._pending.popleft()
            if le.remaining_ms() < self._start_margin_ms:
                self._handback.append(le)
                continue
            slot = _Running(le)
            self._running[id(le)] = slot
            slot.task = loop.create_task(self._run(slot))
        while self._alone and not self._alone_busy and len(self._running) < self.capacity \
                and not self._closing:
            le = self._alone.popleft()
            if le.remaining_ms() < self._start_margin_ms:
                self._handback.append(le)
                continue
            self._alone_busy = True
            slot = _Running(le)
            self._running[id(le)] = slot
            slot.task = loop.create_task(self._run(slot))
        if len(self._running) > self.peak_running:
            self.peak_running = len(self._running)
        if self._room is not None and len(self._pending) < self.backlog:
            self._room.set()
        if not self._pending and not self._alone and not self._running and self._idle is not None:
            self._idle.set()

    async def _run(self, slot: _Running) -> None:
        le = slot.lease
        slot_token = None
        try:
            if le.alone:
                slot_token = await self._take_quarantine_slot(le)
                if slot_token is False:  # too late to start: hand back, no evidence
                    self._handback.append(le)
                    return
                try:
                    await self._in_io(self.queue.mark_started, [le])
                except Exception:  # noqa: BLE001 - no mark: no evidence if this lease expires
                    log.warning("could not record the start of quarantined route %s", le.member)
            try:
                payload = Payload.decode(le.payload, self.payload_cipher)
            except PayloadError as exc:
                log.error("route %s has a malformed payload: %s", le.member, exc)
                self._counts.malformed += 1
                return
            try:
                async with asyncio.timeout(self._guard_s):  # last guard: the engine's deadlines come first
                    by_payload = getattr(self.engine, "check_payload", None)  # owners' profiles (magpie.judges)
                    res = await (by_payload(payload, before_attempt=lambda _n: not le.cancelled) if by_payload
                                 else self.engine.check(payload.route, before_attempt=lambda _n: not le.cancelled))
            except asyncio.CancelledError:
                if self._closing:
                    self._handback.append(le)
                    raise
                self._counts.aborted += 1
                return
            except TimeoutError:
                self._counts.overran += 1
                res = CheckResult(False, None, None, self.engine.attempts, "ReadTimeout", None, None,
                                  self.engine.judge_url, int(time.time() * 1000))
            if res.error == "Aborted":
                self._counts.aborted += 1
            elif not res.alive and (res.judge_fault or not await self.engine.judge_reachable()):
                self._retry.append(le)
            else:
                self._done.append((le, payload, res))
        finally:
            self._running.pop(id(le), None)
            if le.alone:
                self._alone_busy = False
                self._io.submit(_unmark_quietly, self.queue, le)  # a crash from here on is not its check's
                if slot_token:
                    self._io.submit(self._give_back_slot, slot_token)
            if not self._closing:
                self._fill()

    async def _take_quarantine_slot(self, le: Lease):
        """The slot token once held; None without a slot to take (or Redis away: this process's lane
        is then the only guard); False when the lease became too late to start while waiting."""
        if self.quarantine is None:
            return None
        token = f"{self.instance}:{le.member}"
        ttl_ms = int(self._guard_s * 1000)
        while not self._closing:
            try:
                if await self._in_io(self.quarantine.take, token, ttl_ms):
                    return token
            except Exception:  # noqa: BLE001
                log.warning("quarantine slot unavailable (Redis?); checking route %s alone in this process",
                            le.member)
                return None
            if le.remaining_ms() < self._start_margin_ms:
                return False
            await asyncio.sleep(0.25)
        return False

    def _give_back_slot(self, token: str) -> None:
        try:
            self.quarantine.give_back(token)
        except Exception:  # noqa: BLE001 - it expires with its TTL
            log.warning("could not give the quarantine slot back; it frees itself when its TTL ends")

    # -- background services -----------------------------------------------------------------------
    async def _in_io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.complete_interval)
            try:
                await self._flush()
            except Exception:  # noqa: BLE001 - Redis trouble: the leases expire and come back
                log.exception("completion flush failed")

    async def _flush(self) -> None:
        done, self._done = self._done, []
        retry, self._retry = self._retry, []
        handback, self._handback = self._handback, []
        counts, self._counts = self._counts, BatchReport()
        if not (done or retry or handback or any(vars(counts).values())):
            return
        await self._in_io(self._flush_sync, done, retry, handback, counts)

    def _complete(self, leases: list[Lease], results: list[dict[str, str]]) -> Completion:
        """One atomic completion + append; the ``block`` policy waits for room, then drops new results."""
        if self.stream.policy != "block":
            return self.queue.complete_with_results(leases, results, self.stream)
        deadline = time.monotonic() + self.block_timeout
        waiting = dataclasses.replace(self.stream, policy="refuse")
        while True:
            comp = self.queue.complete_with_results(leases, results, waiting)
            if not comp.full:
                return comp
            if time.monotonic() >= deadline:
                return self.queue.complete_with_results(leases, results,
                                                        dataclasses.replace(self.stream, policy="drop_new"))
            time.sleep(0.05)

    def _flush_sync(self, done, retry, handback, report: BatchReport) -> None:
        entries: list[dict[str, str]] = []
        if self.owner_changes is not None:
            done = self.owner_changes(done, report)  # fenced owner changes; the rest completes below
        for i in range(0, len(done), _COMPLETE_CHUNK):
            chunk = done[i: i + _COMPLETE_CHUNK]
            results = [result_entry(payload, res) for _, payload, res in chunk]
            try:
                comp = self._complete([le for le, _, _ in chunk], results)
            except redis_lib.RedisError as exc:  # refused (e.g. maxmemory): no stall for these routes
                withdraw_starts(self.queue, [le for le, _, _ in chunk], exc)
                report.refused += len(chunk)
                continue
            report.dropped += comp.dropped
            for fields, code, stream_id in zip(results, comp.codes, comp.ids):
                if code == COMPLETED:
                    report.completed += 1
                    if stream_id:
                        entries.append(fields)
                else:
                    report.lease_lost += 1
                    report.stale_completions += 1
        refused = []
        for le in retry:
            try:
                self.queue.retry(le, self.backoff.delay(le.retry_attempts + 1))
                report.retried += 1
            except redis_lib.RedisError as exc:
                refused.append(le)
                report.refused += 1
                error = exc
            except Exception:  # noqa: BLE001 - QueueError (lease lost) or other store trouble
                report.lease_lost += 1
        if handback:
            try:
                self.queue.release(handback)
                report.handed_back += len(handback)
            except redis_lib.RedisError as exc:
                refused.extend(handback)
                report.refused += len(handback)
                error = exc
        if refused:
            withdraw_starts(self.queue, refused, error)
        report.published = len(entries)
        if report.overran:
            log.warning("%d checks outlived their deadline by more than the guard's slack and were stopped "
                        "(the event loop is overloaded: lower MAGPIE_CHECKS_PER_PROCESS or add processes)",
                        report.overran)
        self.totals.add(report)
        if self.record is not None:
            try:
                self.record(report, entries)
            except Exception:  # noqa: BLE001 - metrics never stop checks
                log.debug("check metrics failed", exc_info=True)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._renew()
            except Exception:  # noqa: BLE001
                log.exception("lease renewal failed")

    async def _renew(self) -> None:
        due, expired = [], []
        for slot in list(self._running.values()):
            left = slot.lease.remaining_ms()
            if slot.lease.cancelled or left <= 0:
                expired.append(slot)
            elif left < self.renew_below_ms:
                due.append(slot)
        for slot in expired:
            slot.lease.cancel()
            if slot.task is not None:
                slot.task.cancel()
        if not due:
            return
        codes = await self._in_io(self.queue.renew_many, [s.lease for s in due])
        for slot, code in zip(due, codes):
            if code != COMPLETED and slot.task is not None:
                slot.task.cancel()  # the lease is lost: stop the attempt in flight

    async def _heartbeat_loop(self) -> None:
        assert self.registry is not None
        ttl_ms = int(self.heartbeat * 3000)
        while True:
            try:
                await self._in_io(self.registry.announce, self.instance, self.capacity, ttl_ms)
            except Exception:  # noqa: BLE001 - Redis away: promote stops counting us until it is back
                log.warning("could not announce check capacity (Redis unavailable?)")
            await asyncio.sleep(self.heartbeat)

    # -- reads --------------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        """A snapshot (see :class:`PoolStats`); safe from any thread."""
        return PoolStats(self.capacity, len(self._running), len(self._pending) + len(self._alone),
                         self.peak_running, self.totals)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until nothing is pending or running and every result was flushed; False on timeout."""
        if self._loop is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._pending and not self._alone and not self._running and not self._done \
                    and not self._retry \
                    and not self._handback:
                self._loop.run(self._flush())
                return True
            time.sleep(0.02)
        return False
