"""What every fault scenario shares: its outcome, the stack it runs on, waiting and reading logs."""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from magpie.lab.chaos.servers import PrivatePostgres
from magpie.lab.chaos.stack import Stack

TOTALS = ("lost", "duplicated", "healthy_dead_lettered", "results_lost", "double_leader_runs")
"""The figures summed over scenarios in the suite's last line; each must be 0."""


@dataclass
class Outcome:
    """One scenario run: ``name``, ``bug`` (the public bug class it reproduces), ``figures`` (name ->
    number, including every :data:`TOTALS` key the scenario measures), ``failures`` (one line per broken
    guarantee; empty when every guarantee held), ``seconds`` (wall time)."""

    name: str
    bug: str
    figures: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def expect(self, ok: bool, line: str) -> None:
        """Record ``line`` as a broken guarantee unless ``ok``."""
        if not ok:
            self.failures.append(line)

    def expect_zero(self, *names: str) -> None:
        """Every figure in ``names`` must be 0."""
        for n in names:
            self.expect(self.figures.get(n, 0) == 0, f"{n}={self.figures.get(n)}")

    def line(self) -> str:
        """``chaos-scenario name=... bug=... k=v ... ok=1`` (floats with 2 decimals)."""
        def f(v):
            return f"{v:.2f}" if isinstance(v, float) else str(v)
        figs = " ".join(f"{k}={f(v)}" for k, v in self.figures.items())
        return (f"chaos-scenario name={self.name} bug={self.bug} {figs} seconds={self.seconds:.0f} "
                f"ok={int(not self.failures)}")


@dataclass
class Ctx:
    """What a scenario gets: the private PostgreSQL server, ``quick`` (small sizes), a log directory
    (None: temporary, removed), ``keep_logs``, ``full`` (the long forms: the kill loop runs until routes
    meet several crashes), ``broker`` (``redis``: private Redis servers; ``amqp``: a vhost of the scenario's
    own on the local RabbitMQ), ``net`` (a started :class:`magpie.lab.chaos.netstack.Net`: the scenario
    runs over network namespaces, its processes spread over the nodes; ``pg`` is then ``net.pg``)."""

    pg: PrivatePostgres
    quick: bool = True
    log_dir: Path | None = None
    keep_logs: bool = False
    full: bool = False
    broker: str = "redis"
    net: object | None = None


@contextmanager
def stack(ctx: Ctx, name: str, **kw) -> Iterator[Stack]:
    """A started :class:`Stack` (services up, nothing spawned), closed afterwards whatever happens."""
    log_dir = (ctx.log_dir / name) if ctx.log_dir else None
    if ctx.net is not None:
        from magpie.lab.chaos.netstack import NetStack

        st = NetStack(name, ctx.net, log_dir=log_dir, **kw)
    else:
        st = Stack(name, ctx.pg, log_dir=log_dir, broker=ctx.broker, **kw)
    try:
        st.start_services()
        yield st
    finally:
        st.close(keep_logs=ctx.keep_logs)


def start_all(st: Stack, checks: int = 1, beats: int = 1, engines_timeout: float = 90.0) -> None:
    """Spawn the Procfile's processes (jobs, ``checks`` check workers, promote, ``beats`` beats) and wait
    until every check engine announced its slots. On a :class:`magpie.lab.chaos.netstack.NetStack`,
    every node runs jobs, promote and at least one check worker (``checks`` beyond the node count go
    round the nodes), beats go one per node from node1."""
    nodes = getattr(st, "nodes", None)
    if nodes:
        for n in nodes:
            st.spawn("jobs", node=n)
            st.spawn("promote", node=n)
        for i in range(max(checks, len(nodes))):
            st.spawn("checks", node=nodes[i % len(nodes)])
        for i in range(beats):
            st.spawn("beat", node=nodes[i % len(nodes)])
        st.wait_engines(max(checks, len(nodes)), engines_timeout)
        return
    st.spawn("jobs")
    for _ in range(checks):
        st.spawn("checks")
    st.spawn("promote")
    for _ in range(beats):
        st.spawn("beat")
    st.wait_engines(checks, engines_timeout)


def wait_until(cond: Callable[[], bool], timeout: float, step: float = 0.5) -> float | None:
    """Poll ``cond`` until true; the seconds it took, or None after ``timeout`` seconds."""
    t0 = time.monotonic()
    while True:
        if cond():
            return time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            return None
        time.sleep(step)


_TASK = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+): \w+/[\w-]+\] Task magpie\.promote\[([^\]]+)\] "
                   r"(received|succeeded in [\d.e-]+s: (\d+))")


def _ms(stamp: str, millis: str) -> int:
    return int(time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))) * 1000 + int(millis)


def promote_passes(st: Stack) -> list[tuple[int, int, int]]:
    """``(received ms, finished ms, routes claimed)`` of every promote pass, oldest first, from the promote
    workers' logs (info level; this machine's clock, which is also the Redis server's)."""
    got: dict[str, int] = {}
    out = []
    for p in st.procs:
        if p.role != "promote":
            continue
        for mt in _TASK.finditer(p.log.read_text(errors="replace")):
            at = _ms(mt.group(1), mt.group(2))
            if mt.group(4) == "received":
                got[mt.group(3)] = at
            elif mt.group(3) in got:
                out.append((got[mt.group(3)], at, int(mt.group(5))))
    return sorted(out)


_JOB = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+): \w+/[\w-]+\] Task magpie\.maintenance\.run\[([^\]]+)\] "
                  r"(received|succeeded in [\d.e-]+s: \{'job': '([\w-]+)', 'status': '(\w+)')")


def job_passes(st: Stack, job: str) -> list[tuple[int, int, str]]:
    """``(received ms, finished ms, status)`` of every pass of maintenance job ``job`` (``ok``, ``failed``,
    ``skipped``), oldest first, from the jobs workers' logs (info level)."""
    got: dict[str, int] = {}
    out = []
    for p in st.procs:
        if p.role != "jobs":
            continue
        for mt in _JOB.finditer(p.log.read_text(errors="replace")):
            at = _ms(mt.group(1), mt.group(2))
            if mt.group(4) == "received":
                got[mt.group(3)] = at
            elif mt.group(5) == job and mt.group(3) in got:
                out.append((got[mt.group(3)], at, mt.group(6)))
    return sorted(out)


_EVAL = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+): \w+/[\w-]+\] Task magpie\.alerts\.evaluate"
                   r"\[([^\]]+)\] (received|succeeded in [\d.e-]+s: (None|\{))")


def evaluation_passes(st: Stack) -> list[tuple[int, int, str]]:
    """``(received ms, finished ms, status)`` of every alert evaluation pass (``ok``, or ``skipped`` when
    another leader held the lock or the slot had run), oldest first, from the jobs workers' logs."""
    got: dict[str, int] = {}
    out = []
    for p in st.procs:
        if p.role != "jobs":
            continue
        for mt in _EVAL.finditer(p.log.read_text(errors="replace")):
            at = _ms(mt.group(1), mt.group(2))
            if mt.group(4) == "received":
                got[mt.group(3)] = at
            elif mt.group(3) in got:
                out.append((got[mt.group(3)], at, "skipped" if mt.group(5) == "None" else "ok"))
    return sorted(out)


def same_slot_runs(passes: list[tuple[int, int, str]], cadence_s: float) -> int:
    """Passes that ran (not skipped) in a cadence slot where another pass had already run; a pass that
    straddles a slot boundary cannot be placed and is left out."""
    seen: set[int] = set()
    n = 0
    for received, finished, status in passes:
        slot = int(received // (cadence_s * 1000))
        if status == "skipped" or slot != int(finished // (cadence_s * 1000)):
            continue
        if slot in seen:
            n += 1
        seen.add(slot)
    return n


def claims_per_second(passes: list[tuple[int, int, int]]) -> dict[int, int]:
    """Routes claimed per clock second (promote's budget bucket), summed over the passes that ran inside
    that second; a pass that straddles a second boundary cannot be placed and is left out."""
    out: dict[int, int] = defaultdict(int)
    for received, finished, n in passes:
        if received // 1000 == finished // 1000:
            out[received // 1000] += n
    return out


def interval_ms(st: Stack) -> float:
    """The stack's check interval in ms (``MAGPIE_CHECK_INTERVAL``)."""
    return float(st.env["MAGPIE_CHECK_INTERVAL"]) * 1000.0
