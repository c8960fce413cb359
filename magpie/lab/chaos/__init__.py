"""The fault suite's scenarios, shared by ``tests/chaos/`` and ``benchmarks/chaos.py``.

Every scenario runs the Procfile's real processes (``magpie.lab.chaos.stack``) against private Redis and
PostgreSQL servers on other ports (``magpie.lab.chaos.servers``) and the lab's fault servers, injects one
fault class, and measures from the stores what the fault did (``magpie.lab.chaos.measure``). Each is
named after the public bug class it reproduces. ``quick`` selects small sizes and short outages.

    from magpie.lab.chaos import SCENARIOS, run_scenario
    from magpie.lab.chaos.servers import PrivatePostgres
    pg = PrivatePostgres(); pg.start()
    outcome = run_scenario("kill-loop", pg, quick=True)   # Outcome: figures, failures
    pg.destroy()
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from magpie.lab.chaos import crashes, stores, workers
from magpie.lab.chaos.base import TOTALS, Ctx, Outcome

SCENARIOS: dict[str, Callable[[Ctx], Outcome]] = {
    "kill-loop": workers.kill_loop,
    "sigstop-past-lease": workers.sigstop,
    "poison-route": workers.poison,
    "trickle-proxy": workers.trickle,
    "redis-restarted-empty": stores.redis_restart,
    "postgres-stopped-and-read-only": stores.pg_outage,
    "broker-restart": stores.broker_restart,
    "two-beats": stores.two_beats,
    "catch-up-after-downtime": stores.catch_up,
    "mass-crash": crashes.mass_crash,
    "redis-full": crashes.redis_full,
}
"""Scenario name -> function, in the order the benchmark runs them."""

QUICK_DEFAULT = ("kill-loop", "two-beats", "catch-up-after-downtime")
"""The short suite of the default test run (small sizes)."""


WORKER_KILLS = ("kill-loop", "sigstop-past-lease", "poison-route", "mass-crash")
"""The scenarios that kill or stop check workers (the fault suite runs them on RabbitMQ too)."""


def run_scenario(name: str, pg, quick: bool = True, log_dir: Path | None = None,
                 keep_logs: bool = False, full: bool = False, broker: str = "redis", net=None) -> Outcome:
    """Run scenario ``name`` on the private PostgreSQL server ``pg`` (``full``: the long forms, see
    :class:`Ctx`; ``broker``: ``redis`` or ``amqp``; ``net``: a started
    :class:`magpie.lab.chaos.netstack.Net` to run it across, ``pg`` then being ``net.pg``); a scenario that
    raises is returned as an Outcome with the error as its failure. Raises KeyError for an unknown name."""
    fn = SCENARIOS[name]
    t0 = time.monotonic()
    try:
        out = fn(Ctx(pg, quick and not full, log_dir, keep_logs, full, broker, net))
    except Exception as exc:  # noqa: BLE001 - reported as a failed scenario
        out = Outcome(name, "?", failures=[f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:300]}"])
    out.seconds = time.monotonic() - t0
    return out


def summary(outcomes: list[Outcome]) -> str:
    """The suite's last line: ``chaos scenarios=N lost=.. duplicated=.. healthy_dead_lettered=..
    results_lost=.. double_leader_runs=..`` summed over ``outcomes``."""
    sums = {k: sum(int(o.figures.get(k, 0)) for o in outcomes) for k in TOTALS}
    return f"chaos scenarios={len(outcomes)} " + " ".join(f"{k}={v}" for k, v in sums.items())


__all__ = ["QUICK_DEFAULT", "SCENARIOS", "WORKER_KILLS", "TOTALS", "Ctx", "Outcome", "run_scenario", "summary"]
