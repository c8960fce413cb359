"""Fault scenarios on the check workers: kills, a frozen worker, a poison route, a trickle proxy.

Each function takes a :class:`magpie.lab.chaos.base.Ctx` and returns an
:class:`magpie.lab.chaos.base.Outcome` whose ``failures`` list the guarantees that did not hold.
"""

from __future__ import annotations

import os
import random
import signal
import time

import psutil

from magpie.lab.chaos import measure as m
from magpie.lab.chaos.base import Ctx, Outcome, interval_ms, stack, start_all, wait_until
from magpie.lab.chaos.poison import PoisonServer
from magpie.lab.population import population_lines


def _recheck(st, since_ms: int, hashes: set[str], timeout: float) -> tuple[float | None, set[str]]:
    """Wait until every route of ``hashes`` has a result at or after ``since_ms``; (seconds, missing)."""
    missing = set(hashes)

    def done() -> bool:
        nonlocal missing
        missing = hashes - m.checked_since(m.stream_results(st.r, st.settings().redis_prefix), since_ms)
        return not missing
    return wait_until(done, timeout), missing


def kill_loop(ctx: Ctx) -> Outcome:
    """SIGKILL pool children and whole check workers in a loop (celery#1628, kombu#337): no route lost,
    no result lost or duplicated, no healthy route dead-lettered; the harness restarts a killed worker
    as a supervisor would. A pool child is picked among those with checks in flight when there are."""
    out = Outcome("kill-loop", "celery#1628,kombu#337")
    # full: 60 routes, half of them slow (0.5 s a check, so kills land mid-check), 30 kills over 120 s,
    # so that routes meet several crashes in a row
    n, kills, gap = (40, 3, 2.0) if ctx.quick else (60, 30, 4.0) if ctx.full else (150, 30, 3.0)
    rng = random.Random(7)
    with stack(ctx, out.name, env={"CHAOS_SLOW_DELAY": "0.5"} if ctx.full else None) as st:
        lines = population_lines(st.address("echo"), n)
        if ctx.full:
            lines = lines[: n // 2] + population_lines(st.address("slow"), n - n // 2, start=10**5)
        st.import_lines(lines)
        start_all(st)
        time.sleep(3)
        child = whole = restarts = mid_check = missed = 0
        t_loop = time.monotonic()
        for i in range(kills):
            if not st.running("checks"):  # killed while starting: Celery exits entirely; the supervisor restarts
                st.spawn("checks")
                restarts += 1
                time.sleep(gap)
            worker = st.running("checks")[0]
            kids = worker.children()
            if i % 3 == 2 or not kids:  # whole worker and its pool children, then restarted
                worker.signal_group(signal.SIGKILL)
                worker.popen.wait()
                st.spawn("checks")
                whole += 1
            else:
                busy = [k for k in kids
                        if _inflight_pid(k, st.address("echo")) + _inflight_pid(k, st.address("slow"))]
                try:
                    os.kill(rng.choice(busy or kids), signal.SIGKILL)
                    child += 1
                    mid_check += bool(busy)
                except ProcessLookupError:  # the child ended between the listing and the kill
                    missed += 1
            time.sleep(gap)
        loop_s = time.monotonic() - t_loop
        last = m.redis_ms(st.r)
        if not st.running("checks"):
            st.spawn("checks")
            restarts += 1
        hashes = set(m.route_kinds(st))
        took, missing = _recheck(st, last, hashes, 30 + float(st.env["MAGPIE_LEASE_SECONDS"]))
        st.stop_processes(("promote", "checks"))
        acc = m.result_accounting(st, interval_ms(st))
        routes = m.route_accounting(st)
        out.figures = {"routes": n, "child_kills": child, "child_kills_mid_check": mid_check,
                       "worker_kills": whole, "kills_missed": missed, "loop_s": round(loop_s, 0),
                       "supervisor_restarts": restarts,
                       "lost": routes["lost"] + len(missing), "duplicated": acc["duplicated"],
                       "healthy_dead_lettered": routes["healthy_dead_lettered"],
                       "results_lost": acc["results_lost"], "results": acc["published"],
                       "recovered_s": round(took, 1) if took is not None else -1.0}
        out.expect_zero("lost", "duplicated", "healthy_dead_lettered", "results_lost")
    return out


def _tcp_to(pid: int, host: str, port: int) -> int:
    """Established TCP connections process ``pid`` holds to ``host:port`` (IPv4), read from its own
    ``/proc/<pid>/net/tcp``, the table of the network namespace it runs in (psutil reads the caller's,
    which misses processes in :mod:`magpie.lab.netns` namespaces); 0 when it is gone."""
    import socket
    import struct

    want = f"{struct.unpack('<I', socket.inet_aton(host))[0]:08X}:{port:04X}"
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        with open(f"/proc/{pid}/net/tcp") as fh:
            rows = fh.read().splitlines()[1:]
    except OSError:
        return 0
    n = 0
    for row in rows:
        f = row.split()
        if len(f) > 9 and f[2] == want and f[3] == "01" and f[9] in inodes:  # 01: ESTABLISHED
            n += 1
    return n


def _inflight_pid(pid: int, address: str) -> int:
    """TCP connections process ``pid`` holds to ``address`` (0 when it is gone)."""
    host, port = address.rsplit(":", 1)
    return _tcp_to(pid, host, int(port))


def _inflight(worker, address: str) -> int:
    """TCP connections the worker's processes hold to ``address`` (checks in flight through it)."""
    host, port = address.rsplit(":", 1)
    return sum(_tcp_to(pid, host, int(port)) for pid in worker.pids())


def sigstop(ctx: Ctx) -> Outcome:
    """SIGSTOP a check worker with checks in flight past its leases' expiry, let another worker take the
    routes over, then SIGCONT it (the bullmq stalled-lock class): none of its late completions takes
    effect (no cycle completed twice), nothing lost."""
    from magpie.base.counters import read_counters

    out = Outcome("sigstop-past-lease", "bullmq-stalled-lock")
    n = 30 if ctx.quick else 120
    lease = 6.0
    env = {"MAGPIE_CHECK_TIMEOUT": "3", "MAGPIE_LEASE_SECONDS": f"{lease:g}", "MAGPIE_RENEW_BELOW_SECONDS": "2",
           "MAGPIE_CHECK_INTERVAL": "3", "CHAOS_SLOW_DELAY": "1.5"}
    with stack(ctx, out.name, env=env) as st:
        st.import_lines(population_lines(st.address("slow"), n))
        start_all(st, checks=2)
        prefix = st.settings().redis_prefix
        victim = None

        def busy() -> bool:  # the worker with checks in flight now is the one to freeze
            nonlocal victim
            victim = next((w for w in st.running("checks") if _inflight(w, st.address("slow")) > 0), None)
            return victim is not None
        if wait_until(busy, 30, 0.1) is None:
            raise RuntimeError(f"{out.name}: no check worker ever had a check in flight\n{st.log_tail()}")
        stale0 = read_counters(st.r, prefix)["stale"]
        victim.signal_group(signal.SIGSTOP)
        held = _inflight(victim, st.address("slow"))
        t_stop = m.redis_ms(st.r)
        time.sleep(lease + 4)
        victim.signal_group(signal.SIGCONT)
        time.sleep(8 if ctx.quick else 20)
        st.stop_processes(("promote", "checks"))
        acc = m.result_accounting(st, interval_ms(st))
        routes = m.route_accounting(st)
        results = m.stream_results(st.r, prefix)
        late = m.double_completions(results, interval_ms(st), since_ms=t_stop)
        out.figures = {"routes": n, "inflight_at_stop": held, "late_writes_applied": late,
                       "late_completions_refused": read_counters(st.r, prefix)["stale"] - stale0,
                       "lost": routes["lost"], "duplicated": acc["duplicated"],
                       "results_lost": acc["results_lost"], "results": acc["published"],
                       "healthy_dead_lettered": routes["healthy_dead_lettered"]}
        out.expect(held > 0, "the stopped worker held no check in flight (scenario did not happen)")
        out.expect_zero("late_writes_applied", "lost", "duplicated", "results_lost", "healthy_dead_lettered")
    return out


def poison(ctx: Ctx) -> Outcome:
    """A route whose check kills its process (celery#10462): it is dead-lettered within
    max(MAX_STALLED, 2) + 2 claims (the crashes beside its neighbours put it in quarantine, then two
    crashes of its isolated check process dead-letter it), no healthy neighbour is dead-lettered, and the
    others keep flowing."""
    out = Outcome("poison-route", "celery#10462")
    n = 40 if ctx.quick else 150
    max_stalled = 2 if ctx.quick else 3
    bound = max(max_stalled, 2) + 2
    with stack(ctx, out.name, env={"MAGPIE_MAX_STALLED": str(max_stalled)}) as st:
        srv = PoisonServer("127.0.0.130", st.all_pids)
        try:
            st.extra_kinds = {srv.address.rsplit(":", 1)[0]: "poison"}
            lines = population_lines(st.address("echo"), n)
            lines.insert(n // 2, population_lines(srv.address, 1, start=10**6)[0])
            st.import_lines(lines)
            kinds = m.route_kinds(st)
            bad = {h for h, k in kinds.items() if k == "poison"}
            healthy = set(kinds) - bad
            start_all(st)
            lease = float(st.env["MAGPIE_LEASE_SECONDS"])
            timeout = (max_stalled + 4) * (lease + 3) + 20
            took = wait_until(lambda: bad <= m.schedule_members(st)[1], timeout)
            after = m.redis_ms(st.r)
            _, missing = _recheck(st, after, healthy, 3 * float(st.env["MAGPIE_CHECK_INTERVAL"]) + lease + 10)
            st.stop_processes(("promote", "checks"))
            acc = m.result_accounting(st, interval_ms(st))
            routes = m.route_accounting(st, healthy)
        finally:
            srv.stop()
        out.figures = {"routes": n + 1, "max_stalled": max_stalled, "poison_claims": srv.claims,
                       "poison_claims_in_quarantine": max(0, srv.claims - max(max_stalled, 2)),
                       "processes_killed": srv.kills, "poison_dead_lettered": int(took is not None),
                       "dead_letter_s": round(took, 1) if took is not None else -1.0,
                       "healthy_dead_lettered": routes["healthy_dead_lettered"],
                       "healthy_flowing_pct": round(100.0 * (len(healthy) - len(missing)) / len(healthy), 1),
                       "lost": routes["lost"], "duplicated": acc["duplicated"],
                       "results_lost": acc["results_lost"]}
        out.expect(took is not None, "the poison route was never dead-lettered")
        # the first max(MAX_STALLED, 2) crashes only make the route a suspect (a crash may be a neighbour's or
        # a whole worker's); then it is checked in a process of its own, and two crashes of that dead-letter it
        out.expect(0 < srv.claims <= bound, f"poison_claims={srv.claims}, bound={bound}")
        out.expect(srv.claims > bound - 2, f"poison_claims={srv.claims}: dead-lettered before its isolated checks")
        out.expect(not missing, f"{len(missing)} healthy routes stopped flowing")
        out.expect_zero("healthy_dead_lettered", "lost", "duplicated", "results_lost")
    return out


def trickle(ctx: Ctx) -> Outcome:
    """One proxy trickling a byte a second among healthy ones: its check ends at the deadline and every
    other route keeps its cadence."""
    out = Outcome("trickle-proxy", "slowloris-proxy")
    n, window = (60, 12.0) if ctx.quick else (300, 40.0)
    env = {"MAGPIE_CHECK_TIMEOUT": "2", "MAGPIE_LEASE_SECONDS": "5", "MAGPIE_RENEW_BELOW_SECONDS": "2"}
    with stack(ctx, out.name, env=env) as st:
        lines = population_lines(st.address("echo"), n)
        lines.insert(n // 2, population_lines(st.address("trickle"), 1, start=10**6)[0])
        st.import_lines(lines)
        kinds = m.route_kinds(st)
        healthy = {h for h, k in kinds.items() if k == "echo"}
        start_all(st)
        time.sleep(4)
        t0 = m.redis_ms(st.r)
        time.sleep(window)
        t1 = m.redis_ms(st.r)
        st.stop_processes(("promote", "checks"))
        acc = m.result_accounting(st, interval_ms(st))
        results = m.stream_results(st.r, st.settings().redis_prefix)
        ival = float(st.env["MAGPIE_CHECK_INTERVAL"])
        gaps: dict[str, list[int]] = {}
        for res in results:
            if t0 - 4000 <= res.at_ms < t1:
                gaps.setdefault(res.route_hash, []).append(res.at_ms)
        limit_ms = (2 * ival + 1) * 1000
        flowing = sum(1 for h in healthy
                      if len(gaps.get(h, [])) >= 2 and max(b - a for a, b in zip(gaps[h], gaps[h][1:])) <= limit_ms
                      and gaps[h][-1] >= t1 - limit_ms)
        counts = m.per_route_counts(results, t0, t1)
        bad = [res for res in results if kinds.get(res.route_hash) == "trickle"]
        rate = sum(counts[h] for h in healthy) / ((t1 - t0) / 1000.0)
        routes = m.route_accounting(st, healthy)
        out.figures = {"routes": n + 1, "healthy_flowing_pct": round(100.0 * flowing / len(healthy), 1),
                       "healthy_rate_ratio": round(rate / (len(healthy) / ival), 2),
                       "trickle_results": len(bad), "trickle_alive": sum(r.alive for r in bad),
                       "lost": routes["lost"], "duplicated": acc["duplicated"],
                       "results_lost": acc["results_lost"],
                       "healthy_dead_lettered": routes["healthy_dead_lettered"]}
        out.expect(flowing == len(healthy), f"{len(healthy) - flowing} healthy routes lost their cadence")
        out.expect(len(bad) >= 1 and not any(r.alive for r in bad), "the trickle route never ended dead")
        out.expect_zero("lost", "duplicated", "results_lost", "healthy_dead_lettered")
    return out
