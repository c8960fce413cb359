"""The check pool: one per check-worker process, leases in, completed results out.

A check message carries many leases. :meth:`CheckPool.submit` admits them into the process's pool and
returns; each lease starts as soon as one of the engine's slots is free (up to ``capacity`` checks at once
on one event loop). The pool's own coroutines then keep the leases moving:

- **completion flush** every ``complete_interval`` seconds (~100 ms): the leases whose checks finished
  since the last flush are completed and their results appended to the results stream in one atomic,
  fenced script call (``complete.lua``): a result is recorded if and only if its lease completed, and a
  slow route never holds back a fast one;
- **renewal**: leases with less than ``renew_below_ms`` left are renewed in one pipelined round trip; a
  refused renewal (the lease was lost) cancels the check in flight at once, and a lease past its expiry is
  cancelled too. The sweep over the running slots comes within a second of the first lease needing it, and
  at least every :data:`SWEEP_MAX_S` seconds, so its cost follows the checks, not the slots held;
- **admission never waits on the loop or on Redis**: :meth:`CheckPool.submit` puts a message's leases in a
  thread-safe inbox and wakes the loop; it blocks only while leases of this process already wait for
  slots that are all taken (or a backlog of them waits), so a full process leaves the next messages to
  a process with free slots instead of holding them behind its own queue. A lease starts in the loop
  iteration that frees a slot;
- **start marks and quarantine**: started leases are marked (``HSET`` of ``<hash>#s``,
  :meth:`RouteQueue.mark_started`) in one write per pass of the loop for every lease it started, and
  each check waits for that write before it dials, so that only a lease that started checking is
  evidence against its route if it expires, and a route that kills its process always is;
- **quarantine**: given ``isolate``, a route in quarantine (:attr:`Lease.alone`) is checked in a process
  of its own (:mod:`magpie.pipeline.isolation`, up to ``isolated_checks`` at once), unmarked: that process dying
  under the check is reported as the route's crash (:meth:`RouteQueue.report_crash`), while this process
  dying counts nothing. Without ``isolate`` it is checked one at a time per process, only while this pool
  holds the deployment's quarantine slot (:class:`magpie.queue.quarantine.QuarantineSlot`), and marked
  right before its check starts;
- **hand-back**: a lease that could not start before ``expiry - max_check_seconds`` is released unchecked
  (``release.lua``), claimable again at once, with no stall counted;
- **capacity heartbeat**: the engine's slots are announced to :class:`magpie.queue.capacity.CapacityRegistry`
  so promote claims no more than the engines can run.

Redis calls run in two dedicated I/O threads so the event loop never blocks on them: one for completion
flushes, one for everything else (start marks, renewals, hand-backs' metrics, capacity heartbeats, the
quarantine slot), so a long completion flush never delays a renewal or a mark.

- **claim-to-start timings**: each lease's way from claim to start is stamped (claimed and dispatched by
  promote, received by :meth:`submit`, admitted to the loop, started in a slot) and handed in batches to
  the ``timings`` callback (metrics: ``magpie_lease_claim_to_start_seconds`` and its stages). When the judge
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
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis as redis_lib

from magpie.base.backoff import Backoff
from magpie.pipeline.isolation import IsolatedCrash
from magpie.checker.check import LoopThread
from magpie.checker.engine import CheckEngine
from magpie.checker.result import CheckResult
from magpie.errors import Refusal
from magpie.queue import COMPLETED, REMOVED, Lease, Payload, PayloadError, RouteQueue
from magpie.queue.capacity import CapacityRegistry
from magpie.queue.completion import Completion, StreamTarget
from magpie.queue.quarantine import withdraw_starts
from magpie.stats.entry import entry_fields

log = logging.getLogger(__name__)

_COMPLETE_CHUNK = 500  # leases per completion script call (its arguments stay well below Lua's limits)
SWEEP_MAX_S = 5.0
"""Longest gap in seconds between two sweeps over the running slots while none needs renewal or expires
sooner (:meth:`CheckPool._renew`); the check guard leaves at least this much slack."""



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


@dataclass(slots=True)
class StartTiming:
    """How one lease got from its claim to its check's start: Unix ms stamps (0.0 where unknown).

    ``claimed`` and ``dispatched`` are promote's clock, the rest this process's; ``due`` is the route's due
    time moved onto this process's clock (the lateness of the start is ``started - due``).
    """

    claimed: float
    dispatched: float
    received: float
    admitted: float
    started: float
    due: float


def _unmark_quietly(queue, lease: Lease) -> None:
    try:
        queue.unmark_started([lease])
    except Exception:  # noqa: BLE001 - the mark then stays: a crash before completion counts, as before
        log.debug("could not withdraw the start mark of %s", lease.member, exc_info=True)


class _Running:
    """One slot's lease and its task; ``task`` is None while the lease waits for its start mark (the task
    is created once the mark is written), and for a suspect ``suspect`` says its task marks it first.
    The renewal sweep reads ``expires`` and ``guard_at`` (plain floats: no parsing per slot and sweep)."""

    __slots__ = ("lease", "task", "suspect", "expires", "guard_at", "overran")

    def __init__(self, lease: Lease, expires: float, suspect: bool = False) -> None:
        self.lease = lease
        self.task: asyncio.Task | None = None
        self.suspect = suspect
        self.expires = expires  # lease expiry on this process's clock (Unix ms)
        self.guard_at = 0.0  # loop time past which the running check is stopped (0: not started)
        self.overran = False  # stopped by the guard


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
        payload_cipher: opens payloads with sealed credentials (:attr:`magpie.base.crypto.Keyring.queue`);
            without it such a payload counts as malformed.
        isolate: ``async (payload_text, timeout_s) -> CheckResult`` checking a quarantined route in a
            process of its own (:func:`magpie.pipeline.isolation.check_isolated`; it raises
            :class:`magpie.pipeline.isolation.IsolatedCrash` when that process died under the check, which is then
            reported to the schedule, :meth:`RouteQueue.report_crash`). None: quarantined routes are
            checked in this process, one at a time and only while this pool holds ``quarantine``, marked
            started, so that a crash during the check is counted.
        isolated_checks: quarantined checks this pool runs at once in processes of their own (each
            process's crash is its own route's, so they need no deployment-wide slot).
        suspect_spread_s: a lease re-claimed after its lease expired (:attr:`Lease.stalled`) starts after
            a random delay of up to this many seconds, so that routes which crashed together (one message,
            one pass, one lease expiry) do not start together again: a poison route's neighbours then
            differ from one crash to the next, and only the poison keeps meeting its own crashes. 0: at once.
        quarantine: the deployment's :class:`magpie.queue.quarantine.QuarantineSlot`; None: quarantined
            checks are alone in this process only (tests, one-shot runs).
        timings: optional ``timings(samples)`` with the leases started since the last flush, each a
            :class:`StartTiming`; called on an I/O thread (metrics), never on the loop.
        owner_changes: the pending ownership changes (:class:`magpie.judges.ownership.OwnerChanges`),
            applied by each flush's completion call; None applies none.
    """

    def __init__(self, queue: RouteQueue, engine: CheckEngine, stream: StreamTarget, *, capacity: int,
                 renew_below_ms: float, backoff: Backoff | None = None, registry: CapacityRegistry | None = None,
                 record: Record | None = None, complete_interval: float = 0.1, heartbeat: float = 2.0,
                 payload_cipher=None,
                 block_timeout: float = 2.0, quarantine=None, owner_changes=None, isolate=None,
                 isolated_checks: int = 4, suspect_spread_s: float = 2.0,
                 timings: Callable[[list[StartTiming]], object] | None = None) -> None:
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
        self.payload_cipher = payload_cipher
        self.quarantine = quarantine
        self.isolate = isolate
        self.suspect_spread_s = max(0.0, float(suspect_spread_s))
        self.timings = timings
        self.owner_changes = owner_changes
        self.complete_interval = float(complete_interval)
        self.heartbeat = float(heartbeat)
        self.instance = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.totals = BatchReport()
        self.peak_running = 0
        self._start_margin_ms = engine.max_check_seconds * 1000.0
        # last guard over a whole check: the engine's own deadlines plus room for a loaded event loop
        self._guard_s = engine.max_check_seconds * 1.25 + 5.0
        # (lease, (received ms, admitted ms)) waiting for a slot; quarantined ones are checked one at a time
        self._pending: deque[tuple[Lease, tuple[float, float]]] = deque()
        self._alone: deque[tuple[Lease, tuple[float, float]]] = deque()
        self._alone_busy = 0  # quarantined checks running
        self._alone_limit = int(isolated_checks) if isolate is not None else 1
        self._running: dict[int, _Running] = {}
        self._sweep_at_ms = 0.0  # wall ms of the next sweep over them (_renew)
        self._done: list[tuple[Lease, Payload, CheckResult]] = []
        self._retry: list[Lease] = []
        self._handback: list[Lease] = []
        self._counts = BatchReport()  # outcomes found on the loop since the last flush
        self._loop: LoopThread | None = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="magpie-io")
        self._side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="magpie-side")
        # admission: the Celery thread appends to the inbox; the loop drains it. _held counts leases
        # submitted and not yet started or handed back (inbox + pending), under _cond.
        self._cond = threading.Condition()
        self._inbox: deque[tuple[float, list[Lease]]] = deque()
        self._held = 0
        self._waiters = 0  # submits blocked on a full process
        self._marks: list[Lease] = []
        self._marking: asyncio.Future | None = None  # the mark write the leases started now wait for
        self._gated: list[_Running] = []  # slots whose task starts once that write is done
        self._started: list[StartTiming] = []
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
        self._idle = asyncio.Event()
        self._idle.set()
        self._services = [asyncio.ensure_future(self._flush_loop()), asyncio.ensure_future(self._renew_loop()),
                          asyncio.ensure_future(self._side_loop())]
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
        self._side.shutdown(wait=True)
        with self._cond:
            self._cond.notify_all()

    async def _close(self) -> None:
        self._closing = True
        with self._cond:
            self._cond.notify_all()
        for svc in self._services:
            svc.cancel()
        self._take_inbox()
        waiting = [le for le, _ in self._pending] + [le for le, _ in self._alone]
        self._handback.extend(waiting)
        self._pending.clear()
        self._alone.clear()
        self._release_held(len(waiting))
        gated = [r for r in self._running.values() if r.task is None]  # marks not written yet: not started
        for r in gated:
            self._running.pop(id(r.lease), None)
            self._handback.append(r.lease)
        tasks = [r.task for r in self._running.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._flush()
        await self._side_flush()
        if self.registry is not None:
            try:
                await self._in_side(self.registry.withdraw, self.instance)
            except Exception:  # noqa: BLE001
                log.warning("could not withdraw check capacity of %s", self.instance)

    # -- admission ----------------------------------------------------------------------------------
    def submit(self, leases: Sequence[Lease], timeout: float | None = None) -> int:
        """Admit ``leases`` (thread-safe) and return the count admitted, without waiting on the event loop
        or on Redis: the leases go to the pool's inbox and start as slots free.

        Blocks (backpressure) while leases already wait to start and every slot is taken (running plus
        waiting reach the capacity), or while ``backlog`` leases (a tenth of the capacity) wait: a full
        process takes at most one message beyond its slots, and Celery hands the next ones to a process
        with free slots. Args: ``timeout`` most seconds to
        wait for room (None: no limit). Raises ``TimeoutError`` when no room came in time (nothing
        admitted: the leases expire and come back). A closed pool admits nothing and returns 0.
        """
        self.start()
        leases = list(leases)
        if not leases:
            return 0
        received = time.time() * 1000
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._full() and not self._closing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no room in the check pool within {timeout:g} s")
                self._waiters += 1
                try:
                    self._cond.wait(left if left is not None else 1.0)
                finally:
                    self._waiters -= 1
            if self._closing or self._loop is None:
                return 0
            self._held += len(leases)
            self._inbox.append((received, leases))
        if not self._wake_inbox():
            return 0
        return len(leases)

    def offer(self, leases: Sequence[Lease]) -> list[Lease]:
        """Admit (thread-safe, never blocking) as many of ``leases`` as this process has free slots for and
        return the rest, in order, for another process to take: a full process forwards a message instead
        of holding it behind its own checks (see ``magpie.check_routes``). A closing pool admits nothing
        and returns every lease."""
        self.start()
        leases = list(leases)
        if not leases:
            return []
        received = time.time() * 1000
        with self._cond:
            if self._closing or self._loop is None:
                return leases
            room = self.capacity - len(self._running) - self._held
            take = leases[:max(0, room)]
            if not take:
                return leases
            self._held += len(take)
            self._inbox.append((received, take))
        self._wake_inbox()
        return leases[len(take):]

    def _wake_inbox(self) -> bool:
        """Have the loop take the inbox; False when the loop stopped under us (close() hands back what it
        finds there)."""
        try:
            self._loop.loop.call_soon_threadsafe(self._take_inbox)
        except RuntimeError:
            return False
        return True

    def _take_inbox(self) -> None:
        """On the loop: move submitted leases into the pending queues and start what the slots allow."""
        if not self._inbox:
            return
        admitted = time.time() * 1000
        while self._inbox:
            try:
                received, leases = self._inbox.popleft()
            except IndexError:
                break
            for le in leases:
                stamp = (received, admitted)
                if le.alone:
                    self._alone.append((le, stamp))
                else:
                    self._pending.append((le, stamp))
        if self._closing:
            return
        if self._idle is not None:
            self._idle.clear()
        self._fill()

    def _full(self) -> bool:
        """Under ``_cond``: no room for another message (see :meth:`submit`)."""
        held = self._held
        return held >= self.backlog or (held > 0 and held + len(self._running) >= self.capacity)

    def _release_held(self, n: int, wake: bool = False) -> None:
        if n or wake:
            with self._cond:
                self._held -= n
                if self._waiters and not self._full():  # a blocked submit may go on
                    self._cond.notify_all()

    def _fill(self) -> None:
        """Start pending leases while slots are free; hand back those too late to start."""
        loop = asyncio.get_running_loop()
        taken = 0
        now = 0.0
        while self._pending and len(self._running) < self.capacity and not self._closing:
            le, stamp = self._pending.popleft()
            taken += 1
            now = now or time.time() * 1000
            expires = self._startable(le, stamp, now)
            if expires is None:
                continue
            if le.stalled and self.suspect_spread_s > 0:
                slot = _Running(le, expires, suspect=True)  # marked when it starts, at a random moment
                self._running[id(le)] = slot
                slot.task = loop.create_task(self._run(slot))
            else:  # its task starts once this pass's start marks are written (_write_marks)
                slot = _Running(le, expires)
                self._running[id(le)] = slot
                self._marks.append(le)
                self._gated.append(slot)
                self._mark_soon()
        while self._alone and self._alone_busy < self._alone_limit and len(self._running) < self.capacity \
                and not self._closing:
            le, stamp = self._alone.popleft()
            taken += 1
            now = now or time.time() * 1000
            expires = self._startable(le, stamp, now)
            if expires is None:
                continue
            self._alone_busy += 1
            slot = _Running(le, expires)
            self._running[id(le)] = slot
            slot.task = loop.create_task(self._run(slot))
        if len(self._running) > self.peak_running:
            self.peak_running = len(self._running)
        if taken:
            self._release_held(taken)
        if not self._pending and not self._alone and not self._running and not self._inbox \
                and self._idle is not None:
            self._idle.set()

    def _startable(self, le: Lease, stamp: tuple[float, float], now: float) -> float | None:
        """The lease's expiry on this process's clock (Unix ms) when it may start at ``now`` (ms), its start
        timing recorded; None when too little lease is left for a whole check: it is handed back."""
        expires = le.expires_at_ms - le.server_offset_ms
        if expires - now < self._start_margin_ms:
            self._handback.append(le)
            return None
        if expires - self.renew_below_ms < self._sweep_at_ms:
            self._sweep_at_ms = expires - self.renew_below_ms
        self._started.append(StartTiming(le.claimed_ms, le.dispatched_ms, stamp[0], stamp[1], now,
                                         float(le.previous_score or 0) - le.server_offset_ms))
        return expires

    def _mark_soon(self) -> asyncio.Future:
        """The future of the next start-mark write: one script call for every lease started in this pass of
        the loop, written before any of them dials (a crash during its check is then its evidence). Its
        result: the ids of the leases already marked with their own token (a process that died started
        them: they are not started again, and their expiry counts the stall once)."""
        if self._marking is None:
            self._marking = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(self._write_marks)
        return self._marking

    def _write_marks(self) -> None:
        marks, self._marks = self._marks, []
        gated, self._gated = self._gated, []
        fut, self._marking = self._marking, None

        async def write() -> None:
            again: set[int] = set()
            try:
                if marks:
                    again = {id(le) for le in await self._in_side(self.queue.mark_started, marks) or ()}
            except Exception:  # noqa: BLE001 - unmarked leases are simply no evidence if they expire
                log.warning("could not record that %d leases started (Redis unavailable?)", len(marks))
            finally:
                if fut is not None and not fut.done():
                    fut.set_result(again)
                self._open_gates(gated, again)

        asyncio.ensure_future(write())

    def _open_gates(self, gated: list[_Running], again: set[int]) -> None:
        """Start the checks of ``gated`` slots whose start marks were written: one task each, created only
        now (no task waits on the write). A slot the pool no longer holds (closed) starts nothing."""
        loop = asyncio.get_running_loop()
        refused = False
        for slot in gated:
            le = slot.lease
            if self._running.get(id(le)) is not slot or slot.task is not None:
                continue
            if id(le) in again:
                log.warning("route %s: not started: its lease was started before by a process that died "
                            "(it comes back when the lease expires) or is no longer held", le.member)
                self._running.pop(id(le), None)
                refused = True
                continue
            slot.task = loop.create_task(self._run(slot))
        if refused and not self._closing:
            self._fill()

    async def _run(self, slot: _Running) -> None:
        le = slot.lease
        slot_token = None
        restarted = False
        try:
            if slot.suspect:  # its crash-mates must not start with it again
                await asyncio.sleep(random.uniform(0, self.suspect_spread_s))
                self._marks.append(le)
                try:
                    again = await asyncio.shield(self._mark_soon())
                except asyncio.CancelledError:
                    if self._closing:
                        self._handback.append(le)
                    raise
                if id(le) in again:
                    log.warning("route %s: not started: its lease was started before by a process that died "
                                "(it comes back when the lease expires) or is no longer held", le.member)
                    return
            if le.alone:
                slot_token = await self._take_quarantine_slot(le) if self.isolate is None else None
                if slot_token is False:  # too late to start: hand back, no evidence
                    self._handback.append(le)
                    return
                if self.isolate is None:
                    try:
                        if await self._in_side(self.queue.mark_started, [le]):
                            restarted = True  # the mark is the dead process's evidence: it stays
                            log.warning("quarantined route %s: not started: its lease was started before by "
                                        "a process that died, or is no longer held", le.member)
                            return
                    except Exception:  # noqa: BLE001 - no mark: no evidence if this lease expires
                        log.warning("could not record the start of quarantined route %s", le.member)
            try:
                payload = Payload.decode(le.payload, self.payload_cipher)
            except PayloadError as exc:
                log.error("route %s has a malformed payload: %s", le.member, exc)
                self._counts.malformed += 1
                return
            # the last guard (the engine's deadlines come first): the renewal sweep stops a check still
            # running past guard_at, which costs no timer per check
            slot.guard_at = asyncio.get_running_loop().time() + self._guard_s
            try:
                if le.alone and self.isolate is not None:
                    try:
                        res = await self.isolate(le.payload, self._guard_s)
                    except IsolatedCrash as exc:
                        self._side.submit(self._report_crash, le, exc)
                        return
                else:
                    res = await self.engine.check_payload(payload, before_attempt=lambda _n: not le.cancelled)
            except asyncio.CancelledError:
                if self._closing:
                    self._handback.append(le)
                    raise
                if not slot.overran:
                    self._counts.aborted += 1
                    return
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
                self._alone_busy -= 1
                if self.isolate is None and not restarted:  # a crash from here on is not its check's
                    self._io.submit(_unmark_quietly, self.queue, le)
                if slot_token:
                    self._side.submit(self._give_back_slot, slot_token)
            if not self._closing:
                self._fill()
                if self._waiters:  # a slot freed with no lease taken (quarantined ones wait their lane)
                    self._release_held(0, wake=True)

    async def _take_quarantine_slot(self, le: Lease):
        """The slot token once held; None without a slot to take (or Redis away: this process's lane
        is then the only guard); False when the lease became too late to start while waiting."""
        if self.quarantine is None:
            return None
        token = f"{self.instance}:{le.member}"
        ttl_ms = int(self._guard_s * 1000)
        while not self._closing:
            try:
                if await self._in_side(self.quarantine.take, token, ttl_ms):
                    return token
            except Exception:  # noqa: BLE001
                log.warning("quarantine slot unavailable (Redis?); checking route %s alone in this process",
                            le.member)
                return None
            if le.remaining_ms() < self._start_margin_ms:
                return False
            await asyncio.sleep(0.25)
        return False

    def _report_crash(self, le: Lease, exc: IsolatedCrash) -> None:
        if self._closing:  # shutting down: the isolated process may have been stopped with this one
            return
        try:
            code = self.queue.report_crash(le)
        except Exception:  # noqa: BLE001 - the lease expires unmarked: nothing counted, checked again
            log.warning("could not report that quarantined route %s crashed its isolated check", le.member)
            return
        what = {2: "dead-lettered", 1: "checked again, still in quarantine"}.get(code, "lease already lost")
        log.warning("quarantined route %s crashed its isolated check process (exit status %s): %s",
                    le.member, exc.returncode, what)

    def _give_back_slot(self, token: str) -> None:
        try:
            self.quarantine.give_back(token)
        except Exception:  # noqa: BLE001 - it expires with its TTL
            log.warning("could not give the quarantine slot back; it frees itself when its TTL ends")

    # -- background services -----------------------------------------------------------------------
    async def _in_io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _in_side(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._side, fn, *args)

    async def _side_loop(self) -> None:
        while True:
            await asyncio.sleep(self.complete_interval)
            try:
                await self._side_flush()
            except Exception:  # noqa: BLE001 - timings are only metrics
                log.exception("start timings not recorded")

    async def _side_flush(self) -> None:
        """Hand the start timings gathered since the last flush to ``timings`` on the side thread (start
        marks are written before the checks dial: :meth:`_mark_soon`)."""
        started, self._started = self._started, []
        if started and self.timings is not None:
            await self._in_side(self._record_timings, started)

    def _record_timings(self, started: list[StartTiming]) -> None:
        try:
            self.timings(started)
        except Exception:  # noqa: BLE001 - metrics never stop checks
            log.debug("start timings not recorded", exc_info=True)

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

    def _complete(self, leases: list[Lease], results: list[dict[str, str]],
                  desired: list[str | None] | None = None) -> Completion:
        """One atomic completion + ownership changes + append; the ``block`` policy waits for room, then
        drops new results."""
        if self.stream.policy != "block":
            return self.queue.complete_with_results(leases, results, self.stream, desired=desired)
        deadline = time.monotonic() + self.block_timeout
        waiting = dataclasses.replace(self.stream, policy="refuse")
        out = Completion(codes=[0] * len(leases), ids=[None] * len(leases))
        todo = list(range(len(leases)))  # a partitioned schedule refuses per partition: the rest completes

        def pick(xs):
            return None if xs is None else [xs[i] for i in todo]

        while True:
            policy = waiting if time.monotonic() < deadline else dataclasses.replace(self.stream, policy="drop_new")
            comp = self.queue.complete_with_results(pick(leases), pick(results), policy, desired=pick(desired))
            out.dropped += comp.dropped
            out.trimmed += comp.trimmed
            left = []
            for j, i in enumerate(todo):
                code = comp.codes[j] if j < len(comp.codes) else 0
                if code:
                    out.codes[i], out.ids[i] = code, comp.ids[j]
                else:
                    left.append(i)
            todo = left
            if not comp.full or not todo:
                return out
            time.sleep(0.05)

    def _complete_done(self, chunk: list, desired: list[str | None] | None, report: BatchReport,
                       entries: list[dict[str, str]]) -> list[int]:
        """Complete the ``(lease, payload, result)`` triples of ``chunk``; counts into ``report``, stream
        entries into ``entries``. A lease whose ownership change cannot merge completes without it."""
        results = [result_entry(payload, res) for _, payload, res in chunk]
        comp = self._complete([le for le, _, _ in chunk], results, desired)
        report.dropped += comp.dropped
        unmerged = []
        for item, fields, code, stream_id in zip(chunk, results, comp.codes, comp.ids):
            if code == COMPLETED:
                report.completed += 1
                if stream_id:
                    entries.append(fields)
            elif code == REMOVED:
                report.completed += 1
            elif code == Refusal.BAD_PAYLOAD and desired is not None:
                unmerged.append(item)
            else:
                report.lease_lost += 1
                report.stale_completions += 1
        if unmerged:
            log.warning("owner change of %d routes refused (bad_payload); completed without it",
                        len(unmerged))
            self._complete_done(unmerged, None, report, entries)
        return comp.codes

    def _flush_sync(self, done, retry, handback, report: BatchReport) -> None:
        entries: list[dict[str, str]] = []
        for i in range(0, len(done), _COMPLETE_CHUNK):
            chunk = done[i: i + _COMPLETE_CHUNK]
            plan = self.owner_changes.plan(chunk) if self.owner_changes is not None else None
            try:
                codes = self._complete_done(chunk, plan.desired if plan else None, report, entries)
            except redis_lib.RedisError as exc:  # refused (e.g. maxmemory): no stall for these routes
                withdraw_starts(self.queue, [le for le, _, _ in chunk], exc)
                report.refused += len(chunk)
                continue
            if plan is not None:
                self.owner_changes.settle(chunk, plan, codes)
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
            if time.time() * 1000 < self._sweep_at_ms:
                continue
            try:
                await self._renew()
            except Exception:  # noqa: BLE001
                self._sweep_at_ms = 0.0
                log.exception("lease renewal failed")

    async def _renew(self) -> None:
        """The sweep over the running slots: cancel checks whose lease expired or was lost, stop checks past
        their guard (:attr:`_Running.guard_at`), renew leases with less than ``renew_below_ms`` left (one
        pipelined round trip). Sets the time of the next sweep: the first renewal or expiry due, at most
        :data:`SWEEP_MAX_S` away (:meth:`_fill` brings it forward for a lease started closer to either)."""
        due, expired, overran = [], [], []
        now = time.time() * 1000
        mono = asyncio.get_running_loop().time()
        below = self.renew_below_ms
        soonest = now + SWEEP_MAX_S * 1000.0 + below
        for slot in list(self._running.values()):
            expires = slot.expires
            if expires <= now or slot.lease.cancelled:
                expired.append(slot)
                continue
            if expires - now < below:
                due.append(slot)
            elif expires < soonest:
                soonest = expires
            if 0.0 < slot.guard_at < mono and not slot.overran and slot.task is not None:
                overran.append(slot)
        self._sweep_at_ms = now + 1000.0 if due else soonest - below
        for slot in overran:
            slot.overran = True
            slot.task.cancel()
        for slot in expired:
            slot.lease.cancel()
            if slot.task is not None:
                slot.task.cancel()
        if not due:
            return
        codes = await self._in_side(self.queue.renew_many, [s.lease for s in due])
        for slot, code in zip(due, codes):
            if code == COMPLETED:
                slot.expires = slot.lease.expires_at_ms - slot.lease.server_offset_ms
            else:  # the lease is lost: stop the attempt in flight (or never start it)
                slot.lease.cancel()
                if slot.task is not None:
                    slot.task.cancel()

    async def _heartbeat_loop(self) -> None:
        assert self.registry is not None
        ttl_ms = int(self.heartbeat * 3000)
        while True:
            try:
                await self._in_side(self.registry.announce, self.instance, self.capacity, ttl_ms)
            except Exception:  # noqa: BLE001 - Redis away: promote stops counting us until it is back
                log.warning("could not announce check capacity (Redis unavailable?)")
            await asyncio.sleep(self.heartbeat)

    # -- reads --------------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        """A snapshot (see :class:`PoolStats`); safe from any thread."""
        return PoolStats(self.capacity, len(self._running), self._held, self.peak_running, self.totals)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until nothing is pending or running and every result was flushed (a flush the flush loop
        had already taken included: its counts are in :attr:`totals` on return); False on timeout."""
        if self._loop is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._held and not self._running and not self._done and not self._retry \
                    and not self._handback:
                self._loop.run(self._flush())
                self._loop.run(self._side_flush())
                for thread in (self._io, self._side):  # one thread each: this runs after what they hold
                    thread.submit(lambda: None).result(max(0.0, deadline - time.monotonic()))
                return True
            time.sleep(0.02)
        return False
