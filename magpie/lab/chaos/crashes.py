"""Fault scenarios the short kill loop never reaches: a whole check worker killed twice with hundreds of
routes in flight, and a schedule Redis at ``maxmemory`` (writes refused) while routes are checked and a
list is imported.

Each function takes a :class:`magpie.lab.chaos.base.Ctx` and returns an
:class:`magpie.lab.chaos.base.Outcome` whose ``failures`` list the guarantees that did not hold.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

from magpie.lab.chaos import measure as m
from magpie.lab.chaos.base import Ctx, Outcome, interval_ms, stack, start_all, wait_until
from magpie.lab.chaos.workers import _inflight, _recheck
from magpie.lab.population import population_lines


_REFUSED = re.compile(r"the schedule refused (\d+) writes")


def _suspects(st, threshold: int = 1) -> int:
    """Routes whose counted stalls since their last completion are at least ``threshold`` now."""
    q = st.queue()
    n = 0
    for k, v in st.r.hgetall(q.keys.stalls).items():
        if b"#" not in k and int(v) >= threshold:
            n += 1
    return n


def mass_crash(ctx: Ctx) -> Outcome:
    """The whole check worker SIGKILLed twice while hundreds of routes are in flight (an OOM kill, twice):
    every route is checked again within two intervals of the restarted engine's first claim, nobody waits
    in quarantine for it, and nothing is dead-lettered or lost."""
    out = Outcome("mass-crash", "oom-kill-twice")
    n = 120 if ctx.quick else 300
    env = {"MAGPIE_CHECK_TIMEOUT": "3", "MAGPIE_LEASE_SECONDS": "5", "MAGPIE_RENEW_BELOW_SECONDS": "2",
           "MAGPIE_CHECK_INTERVAL": "3", "CHAOS_SLOW_DELAY": "1.0"}
    with stack(ctx, out.name, env=env) as st:
        st.import_lines(population_lines(st.address("slow"), n))
        start_all(st)
        lease = float(st.env["MAGPIE_LEASE_SECONDS"])
        ival = float(st.env["MAGPIE_CHECK_INTERVAL"])
        alone_at = max(st.settings().max_stalled, 2)
        held, peak_quarantined = [], 0
        for _ in range(2):
            worker = st.running("checks")[0]
            if wait_until(lambda: _inflight(worker, st.address("slow")) >= n // 2, 60, 0.05) is None:
                raise RuntimeError(f"{out.name}: the check worker never had half the routes in flight\n"
                                   f"{st.log_tail()}")
            held.append(_inflight(worker, st.address("slow")))
            worker.signal_group(signal.SIGKILL)
            worker.popen.wait()
            st.spawn("checks")
            st.wait_engines(1)
        ready = m.redis_ms(st.r)
        hashes = set(m.route_kinds(st))

        missing = set(hashes)

        def rechecked() -> bool:
            nonlocal missing, peak_quarantined
            peak_quarantined = max(peak_quarantined, _suspects(st, alone_at))
            missing = hashes - m.checked_since(m.stream_results(st.r, st.settings().redis_prefix), ready)
            return not missing
        took = wait_until(rechecked, lease + 4 * ival + 60, 0.25)
        st.stop_processes(("promote", "checks"))
        acc = m.result_accounting(st, interval_ms(st))
        routes = m.route_accounting(st)
        bound = lease + 2 * ival  # orphans are claimable once their leases expire, then one cycle
        out.figures = {"routes": n, "inflight_at_kills": "+".join(map(str, held)),
                       "quarantined_peak": peak_quarantined,
                       "rechecked_s": round(took, 1) if took is not None else -1.0,
                       "recheck_bound_s": bound, "not_rechecked": len(missing),
                       "lost": routes["lost"] + len(missing), "duplicated": acc["duplicated"],
                       "healthy_dead_lettered": routes["healthy_dead_lettered"],
                       "results_lost": acc["results_lost"], "results": acc["published"]}
        out.expect(took is not None and took <= bound + 2.0,
                   f"every route re-checked after {out.figures['rechecked_s']} s (bound {bound:g} s + 2 s), "
                   f"{len(missing)} not at all")
        out.expect_zero("quarantined_peak", "lost", "duplicated", "healthy_dead_lettered", "results_lost")
    return out


def _cli(st, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "magpie", *args], env=st.env, capture_output=True, text=True,
                          timeout=timeout, cwd=st.dir)


def redis_full(ctx: Ctx) -> Outcome:
    """The schedule's Redis at ``maxmemory`` (``noeviction``) while routes are checked and a list is
    imported: the import says what it stored and scheduled and exits 3, ``magpie health`` is not ready
    and names the memory state, refused completions make no route a suspect, and once memory is freed
    every route (the refused import's too, after its re-run) is checked again."""
    out = Outcome("redis-full", "redis-oom-noeviction")
    n, held_s, extra = (60, 6.0, 50) if ctx.quick else (300, 20.0, 200)
    env = {"MAGPIE_CHECK_TIMEOUT": "3", "MAGPIE_LEASE_SECONDS": "5", "MAGPIE_RENEW_BELOW_SECONDS": "2",
           "MAGPIE_CHECK_INTERVAL": "3", "CHAOS_SLOW_DELAY": "1.0"}
    # only the schedule's Redis fills up; slow routes, so that checks are in flight when it does
    with stack(ctx, out.name, env=env, separate_broker=True) as st:
        st.import_lines(population_lines(st.address("slow"), n))
        st.r.config_set("maxmemory-policy", "noeviction")
        start_all(st)
        hashes = set(m.route_kinds(st))
        prefix = st.settings().redis_prefix
        t_start = m.redis_ms(st.r)
        if _recheck(st, t_start, hashes, 60)[0] is None:
            raise RuntimeError(f"{out.name}: routes were not checked before the fault\n{st.log_tail()}")
        more = st.dir / "more.txt"
        more.write_text("\n".join(population_lines(st.address("slow"), extra, start=10**5)) + "\n")
        worker = st.running("checks")[0]
        if wait_until(lambda: _inflight(worker, st.address("slow")) >= n // 3, 30, 0.05) is None:
            raise RuntimeError(f"{out.name}: no checks in flight to fill Redis under\n{st.log_tail()}")
        st.r.config_set("maxmemory", 1)  # below what Redis uses: every write is refused from now on
        t_full = time.monotonic()
        imp = _cli(st, "import", str(more), "-w", "chaos", "--json")
        health = _cli(st, "health", "--json")
        time.sleep(max(0.0, held_s - (time.monotonic() - t_full)))
        st.r.config_set("maxmemory", 0)
        freed = m.redis_ms(st.r)
        peak = 0

        def settled() -> bool:  # every route re-checked since memory was freed; suspects watched meanwhile
            nonlocal peak
            peak = max(peak, _suspects(st))
            return hashes <= m.checked_since(m.stream_results(st.r, prefix), freed)
        took = wait_until(settled, 90, 0.25)
        again = _cli(st, "import", str(more), "-w", "chaos", "--json")
        all_hashes = set(m.route_kinds(st))
        new_checked = _recheck(st, freed, all_hashes, 60)[0]
        st.stop_processes(("promote", "checks"))
        acc = m.result_accounting(st, interval_ms(st))
        routes = m.route_accounting(st)
        try:
            rep = json.loads(imp.stdout)
        except ValueError:
            rep = {}
        try:
            hrep = json.loads(health.stdout)
        except ValueError:
            hrep = {}
        redis_detail = hrep.get("checks", {}).get("redis", {}).get("detail", "")
        refused = sum(int(x) for p in st.procs if p.role == "checks"
                      for x in _REFUSED.findall(p.log.read_text(errors="replace")))
        out.figures = {"routes": n, "full_s": held_s, "import_exit": imp.returncode,
                       "import_stored": rep.get("stored", -1), "import_scheduled": rep.get("scheduled", -1),
                       "health_ready_while_full": int(bool(hrep.get("ready", True))),
                       "writes_refused": refused, "suspects_after": peak,
                       "rechecked_s": round(took, 1) if took is not None else -1.0,
                       "reimport_exit": again.returncode,
                       "lost": routes["lost"] + (0 if new_checked is not None else 1),
                       "duplicated": acc["duplicated"], "results_lost": acc["results_lost"],
                       "healthy_dead_lettered": routes["healthy_dead_lettered"]}
        out.expect(imp.returncode == 3 and rep.get("stored") == extra and rep.get("scheduled") == 0
                   and "maxmemory" in (rep.get("schedule_error") or ""),
                   f"import into a full Redis: exit {imp.returncode}, {imp.stdout.strip()[:200]} "
                   f"{imp.stderr.strip()[:200]}")
        out.expect(hrep.get("ready") is False and "refuses writes" in redis_detail,
                   f"health while Redis refused writes: {health.stdout.strip()[:300]}")
        out.expect(refused > 0, "no completion was refused while Redis was full (scenario did not happen)")
        out.expect(took is not None, "routes were not checked again after memory was freed")
        out.expect(again.returncode == 0, f"re-run import after memory was freed: exit {again.returncode}")
        out.expect(new_checked is not None, "the re-imported routes were never checked")
        out.expect_zero("suspects_after", "lost", "duplicated", "results_lost", "healthy_dead_lettered")
    return out
