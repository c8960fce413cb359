"""Isolated checks: a quarantined route is checked alone in a short-lived process of its own.

A route in quarantine (:attr:`magpie.queue.Lease.alone`) has stalled beside its neighbours several times
in a row: it may be a poison route (its check kills the process running it) or only unlucky. Checked in
the pool's own process, a crash during its check would still take every neighbour down and could still be
a stray kill of that process. Checked here, in a process that runs nothing else, the evidence is exact:

- the isolated process dies before it answers while the pool lives: the route's own check crashed it
  (:class:`IsolatedCrash`); the pool reports it (:meth:`ScheduleProvider.report_crash`), and two in a row
  dead-letter the route (one could be a stray kill);
- the pool's process dies (a whole-worker crash): the isolated process sees its input close and exits;
  the lease expires with no start mark, so nothing is counted against the route.

The child is the command the composition root gives (:data:`magpie.wiring.runtime.ISOLATED_CHILD`): it
reads one JSON request line on stdin (``{"payload": <the lease's payload text>}``; credentials travel on
the pipe, never in argv), builds the check engine from
the same settings as the workers (``MAGPIE_*`` from the inherited environment), checks the route once
and writes the :class:`magpie.checker.result.CheckResult` as one JSON line on stdout. It exits at once
when its stdin closes before the answer is written.
"""

from __future__ import annotations

import asyncio
import json

from magpie.checker.result import CheckResult
from magpie.errors import MagpieError

_LIMIT = 1 << 20  # bytes of one answer line (the judge body is capped far below that)


class IsolatedCrash(MagpieError):
    """The isolated process ended without an answer. ``returncode``: its exit status (negative: the
    signal that killed it)."""

    def __init__(self, returncode: int | None):
        super().__init__(f"the isolated check process ended without an answer (exit status {returncode})")
        self.returncode = returncode


async def check_isolated(payload_text: str, timeout_s: float, argv: tuple[str, ...]) -> CheckResult:
    """Check the route of ``payload_text`` (a lease's payload as stored) in a process of its own.

    Args:
        payload_text: the payload text of the lease (:attr:`magpie.queue.Lease.payload`).
        timeout_s: seconds the whole run may take (start-up included); the process is killed after it.
        argv: the child's command line (:data:`magpie.wiring.runtime.ISOLATED_CHILD`; tests give a stand-in).
    Returns the check's :class:`CheckResult`. Raises :class:`IsolatedCrash` when the process ended
    without an answer, ``TimeoutError`` after ``timeout_s`` (the process is killed, nothing is counted).
    Cancelling the awaiting task kills the process.
    """
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, limit=_LIMIT,
        start_new_session=True)  # signals to the worker's group (shutdown, a kill) are not its crash
    try:
        async with asyncio.timeout(timeout_s):
            proc.stdin.write(json.dumps({"payload": payload_text}).encode() + b"\n")
            await proc.stdin.drain()
            line = await proc.stdout.readline()
            if not line:
                raise IsolatedCrash(await proc.wait())
            try:
                fields = json.loads(line)
                return CheckResult(**fields)
            except (ValueError, TypeError) as exc:
                raise IsolatedCrash(await proc.wait()) from exc
    finally:
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            try:
                await asyncio.shield(proc.wait())
            except BaseException:  # noqa: BLE001 - the child is killed; reaping may finish later
                pass
