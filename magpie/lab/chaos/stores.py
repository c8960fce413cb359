"""Fault scenarios on the stores and the clock of the schedule: Redis restarted empty, PostgreSQL stopped
and read-only, a broker restart, two beats, catch-up after downtime.

Each function takes a :class:`magpie.lab.chaos.base.Ctx` and returns an
:class:`magpie.lab.chaos.base.Outcome` whose ``failures`` list the guarantees that did not hold.
"""

from __future__ import annotations

import math
import time

import sqlalchemy as sa

from magpie.lab.chaos import measure as m
from magpie.lab.chaos.base import (
    Ctx,
    Outcome,
    claims_per_second,
    evaluation_passes,
    interval_ms,
    job_passes,
    promote_passes,
    same_slot_runs,
    stack,
    start_all,
    wait_until,
)
from magpie.lab.chaos.workers import _recheck
from magpie.lab.population import population_lines


def redis_restart(ctx: Ctx) -> Outcome:
    """The schedule's Redis restarted empty (celery#1307): the rebuild job schedules 100 % of the routes
    again from PostgreSQL, every route is checked again, and a rebuild while leases are live resets none."""
    from magpie.maintenance.rebuild import rebuild_schedule

    out = Outcome("redis-restarted-empty", "celery#1307")
    n = 60 if ctx.quick else 300
    env = {"MAGPIE_CHECK_TIMEOUT": "3", "MAGPIE_LEASE_SECONDS": "6", "MAGPIE_RENEW_BELOW_SECONDS": "2",
           "CHAOS_SLOW_DELAY": "1.5"}  # slow routes: leases are live at any moment
    with stack(ctx, out.name, env=env, cadences={"rebuild": 2}, separate_broker=True) as st:
        st.import_lines(population_lines(st.address("slow"), n))
        start_all(st)
        time.sleep(4)
        st.redis_server.kill()
        st.r = st.redis_server.start()
        t_restart = m.redis_ms(st.r)
        took = wait_until(lambda: len(m.schedule_members(st)[0]) >= n, 60)
        rescheduled = len(m.schedule_members(st)[0])
        hashes = set(m.route_kinds(st))
        _, missing = _recheck(st, t_restart, hashes, 40)
        # a rebuild while routes are leased keeps every lease as it is
        q = st.queue()
        wait_until(lambda: any(le["expires_in_s"] > 0 for le in q.in_flight(n)), 15, 0.05)
        now = m.redis_ms(st.r)
        leased = {le["member"]: le["lease_score"] for le in q.in_flight(n) if le["expires_in_s"] > 0}
        rep = rebuild_schedule(st.settings(), engine=st.engine, queue=q, lock=False)
        after_ms = m.redis_ms(st.r)
        results = m.stream_results(st.r, st.settings().redis_prefix)
        completed = {r.route_hash for r in results if r.at_ms >= now}
        reset = 0
        for member, score in leased.items():
            cur = q.score(member)
            if cur is not None and cur != score and member not in completed and after_ms < float(score):
                reset += 1
        st.stop_processes(("promote", "checks"))
        acc = m.result_accounting(st, interval_ms(st))
        routes = m.route_accounting(st)
        out.figures = {"routes": n, "rescheduled_pct": round(100.0 * rescheduled / n, 1),
                       "rebuild_s": round(took, 1) if took is not None else -1.0,
                       "rechecked_pct": round(100.0 * (n - len(missing)) / n, 1),
                       "leases_live_at_rebuild": len(leased), "leases_reset": reset,
                       "rebuild_again_new": rep["new"], "lost": routes["lost"] + len(missing),
                       "duplicated": acc["duplicated"], "results_lost": acc["results_lost"],
                       "healthy_dead_lettered": routes["healthy_dead_lettered"]}
        out.expect(rescheduled == n, f"rescheduled {rescheduled} of {n}")
        out.expect(len(leased) > 0, "no lease was live during the second rebuild (scenario did not happen)")
        out.expect_zero("leases_reset", "rebuild_again_new", "lost", "duplicated", "results_lost",
                        "healthy_dead_lettered")
    return out


def pg_outage(ctx: Ctx) -> Outcome:
    """PostgreSQL stopped, then up but read-only (answers pings, refuses writes): ingestion waits, every
    result published during either outage is stored exactly once afterwards."""
    out = Outcome("postgres-stopped-and-read-only", "celery-results-sick-db")
    n, down = (40, 6.0) if ctx.quick else (150, 60.0)
    with stack(ctx, out.name) as st:
        st.import_lines(population_lines(st.address("echo"), n))
        start_all(st)
        time.sleep(3)
        ctx.pg.stop()
        time.sleep(down)
        ctx.pg.start()
        time.sleep(3)
        ctx.pg.read_only(True)
        time.sleep(down)
        ctx.pg.read_only(False)
        t_back = time.monotonic()
        during = len(m.stream_results(st.r, st.settings().redis_prefix))
        time.sleep(3)
        st.stop_processes(("promote", "checks"))
        acc = m.result_accounting(st, interval_ms(st))
        drain_s = time.monotonic() - t_back
        routes = m.route_accounting(st)
        out.figures = {"routes": n, "stopped_s": down, "read_only_s": down, "published": acc["published"],
                       "published_by_recovery": during, "stored": acc["stored"],
                       "stats_dead_lettered": acc["stats_dead_lettered"], "drained_after_s": round(drain_s, 1),
                       "results_lost": acc["results_lost"], "duplicated": acc["duplicated"],
                       "lost": routes["lost"], "healthy_dead_lettered": routes["healthy_dead_lettered"]}
        out.expect(acc["drained"] == 1, "ingestion did not drain within 60 s of the last write")
        out.expect_zero("results_lost", "duplicated", "stats_dead_lettered", "lost", "healthy_dead_lettered")
    return out


def broker_restart(ctx: Ctx) -> Outcome:
    """The broker (a private Redis of its own, or the stack's RabbitMQ vhost deleted and created again)
    restarted empty: promote resumes, every route is checked again, and no lease is left behind
    (messages lost with the broker cost only a lease expiry)."""
    out = Outcome("broker-restart", "kombu-redis-broker-restart")
    n = 40 if ctx.quick else 150
    with stack(ctx, out.name, separate_broker=True) as st:
        st.import_lines(population_lines(st.address("echo"), n))
        start_all(st)
        time.sleep(3)
        st.restart_broker_empty(1.0)
        t_restart, t0 = m.redis_ms(st.r), time.monotonic()
        before = len(promote_passes(st))
        resumed = wait_until(lambda: any(c > 0 for _, _, c in promote_passes(st)[before:]), 60)
        hashes = set(m.route_kinds(st))
        rec, missing = _recheck(st, t_restart, hashes, 60)
        rec_at = time.monotonic()
        st.stop_processes(("promote", "checks"))
        q = st.queue()
        left = sum(1 for le in q.in_flight(n) if le["expires_in_s"] > 0)
        acc = m.result_accounting(st, interval_ms(st))
        routes = m.route_accounting(st)
        out.figures = {"routes": n, "promote_resumed_s": round(resumed, 1) if resumed is not None else -1.0,
                       "rechecked_s": round(rec_at - t0, 1) if rec is not None else -1.0,
                       "lease_leaks": len(missing), "leases_live_after_stop": left,
                       "lost": routes["lost"] + len(missing), "duplicated": acc["duplicated"],
                       "results_lost": acc["results_lost"], "healthy_dead_lettered": routes["healthy_dead_lettered"]}
        out.expect(resumed is not None, "promote never claimed again after the broker restart")
        out.expect_zero("lease_leaks", "lost", "duplicated", "results_lost", "healthy_dead_lettered")
    return out


def _overdue(st, hours: float = 1.0) -> int:
    """Make every scheduled route overdue by about ``hours`` (as after downtime); returns the count."""
    q = st.queue()
    members, _ = m.schedule_members(st)
    base = m.redis_ms(st.r) - int(hours * 3_600_000)
    for i, member in enumerate(sorted(members)):
        q.enqueue_at(member, base + i)
    return len(members)


def two_beats(ctx: Ctx) -> Outcome:
    """Two beat processes (redbeat#230): each leader job runs once per cadence slot, and promote's budget
    holds per second across both beats' passes."""
    out = Outcome("two-beats", "redbeat#230")
    n, window, cadence, budget = (120, 12.0, 2.0, 20) if ctx.quick else (400, 60.0, 5.0, 20)
    env = {"MAGPIE_PROMOTE_BUDGET": str(budget), "MAGPIE_CHECK_INTERVAL": "120", "MAGPIE_LEASE_SECONDS": "10",
           "MAGPIE_ALERT_EVAL_INTERVAL": f"{cadence:g}"}
    with stack(ctx, out.name, env=env, cadences={"rebuild": cadence, "judge_refresh": cadence}) as st:
        st.import_lines(population_lines(st.address("echo"), n))
        _overdue(st)
        st.spawn("jobs")
        st.spawn("checks")
        st.spawn("promote")
        st.wait_engines(1)
        t0 = m.redis_ms(st.r) / 1000.0
        st.spawn("beat")
        st.spawn("beat")
        time.sleep(window)
        t1 = m.redis_ms(st.r) / 1000.0
        for p in st.running("beat"):
            p.stop()
        with st.engine.connect() as c:
            runs = c.execute(sa.text("SELECT runs_total FROM maintenance_runs WHERE job = 'rebuild'")).scalar() or 0
        slots = math.floor(t1 / cadence) - math.floor(t0 / cadence) + 1
        per_s = claims_per_second(promote_passes(st))
        passes = job_passes(st, "rebuild")
        doubles = max(runs - slots, same_slot_runs(passes, cadence), 0)
        judge = job_passes(st, "judge_refresh")
        evals = evaluation_passes(st)
        ran = {name: sum(1 for p in ps if p[2] != "skipped") for name, ps in (("judge", judge), ("eval", evals))}
        for ps, n_ran in ((judge, ran["judge"]), (evals, ran["eval"])):
            doubles += max(n_ran - slots, same_slot_runs(ps, cadence), 0)
        out.figures = {"beats": 2, "cadence_s": cadence, "window_s": window, "leader_runs": runs,
                       "cadence_slots": slots, "triggers": len(passes),
                       "passes_skipped": sum(1 for p in passes if p[2] == "skipped"),
                       "judge_refresh_runs": ran["judge"], "alert_evaluations": ran["eval"],
                       "double_leader_runs": doubles,
                       "promote_budget": budget, "max_claims_per_s": max(per_s.values(), default=0)}
        # the alerts lock (60 s TTL) refuses every holder for 21 s after a Redis start: the quick window
        # is shorter, so only the full one must see an evaluation
        out.expect(runs >= 1 and ran["judge"] >= 1 and (ctx.quick or ran["eval"] >= 1),
                   f"a leader job never ran (rebuild {runs}, judge_refresh {ran['judge']}, alerts {ran['eval']})")
        out.expect(out.figures["max_claims_per_s"] <= budget, f"promote claimed {out.figures['max_claims_per_s']} "
                                                              f"in one second (budget {budget})")
        out.expect_zero("double_leader_runs")
    return out


def catch_up(ctx: Ctx) -> Outcome:
    """Catch-up after downtime (django-celery-beat#459): every route an hour overdue; promote claims at
    most its budget per pass and per second, and each overdue route is claimed once, not once per missed
    cycle."""
    out = Outcome("catch-up-after-downtime", "django-celery-beat#459")
    n, budget = (150, 25) if ctx.quick else (1000, 100)
    env = {"MAGPIE_PROMOTE_BUDGET": str(budget), "MAGPIE_CHECK_INTERVAL": "300", "MAGPIE_LEASE_SECONDS": "10"}
    with stack(ctx, out.name, env=env) as st:
        st.import_lines(population_lines(st.address("echo"), n))
        overdue = _overdue(st)
        t0 = m.redis_ms(st.r)
        start_all(st)
        hashes = set(m.route_kinds(st))
        took, missing = _recheck(st, t0, hashes, 3 * n / budget + 30)
        st.stop_processes(("promote", "checks"))
        passes = promote_passes(st)
        results = m.stream_results(st.r, st.settings().redis_prefix)
        per_route = m.per_route_counts(results, t0, m.redis_ms(st.r))
        acc = m.result_accounting(st, interval_ms(st))
        routes = m.route_accounting(st)
        out.figures = {"routes": n, "overdue": overdue, "promote_budget": budget,
                       "max_claims_per_pass": max((c for _, _, c in passes), default=0),
                       "max_claims_per_s": max(claims_per_second(passes).values(), default=0),
                       "caught_up_s": round(took, 1) if took is not None else -1.0,
                       "claimed_more_than_once": sum(1 for c in per_route.values() if c > 1),
                       "lost": routes["lost"] + len(missing), "duplicated": acc["duplicated"],
                       "results_lost": acc["results_lost"], "healthy_dead_lettered": routes["healthy_dead_lettered"]}
        out.expect(out.figures["max_claims_per_s"] <= budget, "promote claimed more than its budget in a second")
        out.expect_zero("claimed_more_than_once", "lost", "duplicated", "results_lost", "healthy_dead_lettered")
    return out
