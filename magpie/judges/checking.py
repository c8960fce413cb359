"""The check pool's engine with judge pools and check profiles: :class:`ProfiledEngine`.

For each leased route it looks up the plan of the route's owners (:mod:`magpie.judges.plan`; one cached
dict lookup while the config revision holds) and runs each variant on a
:class:`magpie.checker.engine.CheckEngine` for the chosen judge (engines are kept per judge, timeout,
attempts and rule in a bounded map; all share one :class:`magpie.judges.dns.DnsCache`).

Judge failover: a failed check is probed against its judge directly (one shared probe per judge every
2 s); when the judge does not answer, the judge, not the route, failed: it is marked down in this process
and the check runs again through the next judge of the pool, up to ``MAGPIE_JUDGE_FAILOVERS`` times in the
same cycle. When no judge could take it the result carries ``judge_fault`` and the pool retries the route
on the backoff curve without recording anything: a route is never marked dead because of its judge.

A plan with several variants runs them concurrently; the route's result is the first alive one (else the
one testing the route's own protocol) and carries each owner's outcome in :attr:`CheckResult.owners`. A
plan of one variant (every owner checked the same way) carries none: the route's outcome is each owner's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from magpie.checker.engine import CHECK_SLACK_SECONDS, CheckEngine
from magpie.checker.result import CheckResult
from magpie.judges.cache import ConfigCache
from magpie.judges.dns import DnsCache
from magpie.judges.plan import Defaults, JudgePools, PlanCache, Variant
from magpie.judges.store import JudgeInfo, profile_bounds
from magpie.base.routes import Route

log = logging.getLogger(__name__)

_ENGINES_MAX = 256
_FINAL_ERRORS = frozenset({"Aborted", "UnsupportedProtocol"})


class ProfiledEngine:
    """Checks payloads by their owners' profiles through the judge pools (see the module doc).

    Args:
        settings: :class:`magpie.config.Settings` (defaults, failovers, bounds, egress, CA bundle).
        cache: the process's :class:`ConfigCache` (started by the caller).
        dns: the shared DNS cache (default: one from the settings).
        limiter: the process's judge :class:`magpie.coordination.ratelimit.BlockLimiter` (None: judges unlimited);
            a judge's rate is its ``rate`` column, else ``MAGPIE_JUDGE_RATE``.
    """

    def __init__(self, settings, cache: ConfigCache, dns: DnsCache | None = None, limiter=None) -> None:
        from magpie.base.egress import EgressPolicy

        c = settings.checks
        self.settings = settings
        self.cache = cache
        self.dns = dns or DnsCache.from_settings(settings)
        self.defaults = Defaults(c.timeout, c.attempts, c.judge_url)
        self.connect_timeout = c.connect_timeout
        self.body_cap = c.body_cap
        self.failovers = int(settings.judge_failovers)
        self.egress = EgressPolicy(c.allow_private, "MAGPIE_CHECK_ALLOW_PRIVATE")
        self._ca_bundle = c.judge_ca_bundle
        self._ssl = None
        self.plans = PlanCache(settings.plan_cache_size)
        self._pools: JudgePools | None = None
        self._engines: OrderedDict[tuple, CheckEngine] = OrderedDict()
        max_timeout, max_attempts = profile_bounds(settings)
        longest = max(c.attempts * c.timeout, max_attempts * max_timeout)
        # what the check pool's start margin and last guard allow for: the failovers too, as long as
        # that leaves half the lease; a failover runs only while it fits in this budget (see _failover)
        self._budget = min((1 + self.failovers) * longest, max(longest, settings.lease_seconds / 2))
        self.max_check_seconds = self._budget + CHECK_SLACK_SECONDS
        self.attempts = c.attempts
        self.judge_url = c.judge_url
        self.failed_over = 0
        self.judge_faults = 0
        self.limiter = limiter
        self.judge_rate = float(getattr(settings, "judge_rate", 0.0) or 0.0)
        self.rate_limited = 0

    # -- pools and engines ------------------------------------------------------------------------------
    def pools(self) -> JudgePools:
        """Judge selection for the snapshot held now (rebuilt when the revision moved)."""
        snap = self.cache.snapshot
        pools = self._pools
        if pools is None or pools.revision != snap.revision:
            fresh = JudgePools(snap, self.defaults.judge_url, self.settings.judge_down_seconds)
            fresh.carry_down(pools)
            self._pools = pools = fresh
        return pools

    def engine_for(self, judge: JudgeInfo, timeout: float, attempts: int, rule: str | None) -> CheckEngine:
        """The engine checking through ``judge`` with these deadlines and rule (built on first use)."""
        rule = rule or judge.rule
        rate = judge.rate if judge.rate is not None else self.judge_rate
        key = (judge.url, timeout, attempts, rule, rate)
        eng = self._engines.get(key)
        if eng is not None:
            return eng
        ssl_context = None
        if judge.scheme == "https":
            if self._ssl is None:
                from magpie.checker.tls import judge_ssl_context

                self._ssl = judge_ssl_context(self._ca_bundle)
            ssl_context = self._ssl
        eng = CheckEngine(judge.url, timeout, attempts, self.body_cap,
                          connect_timeout=min(self.connect_timeout, timeout), egress=self.egress,
                          ssl_context=ssl_context, rule=rule, resolver=self.dns,
                          limiter=self.limiter if rate > 0 else None, rate=rate)
        self._engines[key] = eng
        if len(self._engines) > _ENGINES_MAX:
            self._engines.popitem(last=False)
        return eng

    def stats(self) -> dict:
        """Figures of this engine's caches (DNS, plans) and judge failovers."""
        return {"dns": self.dns.stats(), "plans": self.plans.stats(), "engines": len(self._engines),
                "failed_over": self.failed_over, "judge_faults": self.judge_faults,
                "rate_limited": self.rate_limited}

    # -- checks -----------------------------------------------------------------------------------------
    async def _variant(self, route: Route, v: Variant, before_attempt) -> CheckResult:
        """One variant's check with judge failover (see the module doc)."""
        if v.protocol != route.protocol:
            route = Route(v.protocol, route.host, route.port, route.username, route.password)
        pools = self.pools()
        judge = pools.first(v.pool, v.protocol)
        eng = self.engine_for(judge, v.timeout, v.attempts, v.rule)
        started = time.monotonic()
        res = await eng.check(route, before_attempt)
        if res.judge_fault:  # out of the judge's rate limit in time, or of descriptors: not the route's fault
            self.rate_limited += res.error == "RateLimited"
            self.judge_faults += 1
            return res
        if res.alive or res.error in _FINAL_ERRORS or not await eng.blame_judge(res, started):
            return res
        return await self._failover(route, v, before_attempt, judge, res, started)

    async def _failover(self, route: Route, v: Variant, before_attempt, failed: JudgeInfo,
                        res: CheckResult, started: float) -> CheckResult:
        """``failed`` did not answer: mark it down and try the next judges, up to the failover limit and
        while another whole check still fits in :attr:`max_check_seconds` from ``started``."""
        pools = self.pools()
        pools.mark_down(failed)
        for n, judge in enumerate(pools.candidates(v.pool, v.protocol, exclude=failed.id)):
            if n >= self.failovers or time.monotonic() - started + v.attempts * v.timeout > self._budget:
                break
            eng = self.engine_for(judge, v.timeout, v.attempts, v.rule)
            t = time.monotonic()
            res = await eng.check(route, before_attempt)
            if res.judge_fault:
                self.rate_limited += 1
                break
            if res.alive or res.error in _FINAL_ERRORS or not await eng.blame_judge(res, t):
                self.failed_over += 1
                return res
            pools.mark_down(judge)
        self.judge_faults += 1
        res.judge_fault = True
        return res

    async def check_payload(self, payload, before_attempt: Callable[[int], bool] | None = None) -> CheckResult:
        """Check a leased :class:`magpie.queue.Payload` by its owners' profiles (see the module doc)."""
        route = payload.route
        plan = self.plans.get(self.cache.snapshot, route.protocol, payload.workspaces, self.defaults)
        if len(plan.variants) == 1:  # one check for every owner: the route's outcome is each owner's
            return await self._variant(route, plan.variants[0], before_attempt)
        results = await asyncio.gather(*(self._variant(route, v, before_attempt) for v in plan.variants))
        counted = [(v, r) for v, r in zip(plan.variants, results) if not r.judge_fault]
        if not counted:
            return results[0]
        main = next((r for _, r in counted if r.alive), None)
        if main is None:
            main = next((r for v, r in counted if v.protocol == route.protocol), counted[0][1])
        outcome: dict[int, bool] = {}
        for v, r in counted:
            for ws in v.owners:
                outcome[ws] = outcome.get(ws, False) or r.alive
        main.owners = ",".join(f"{ws}:{1 if ok else 0}" for ws, ok in sorted(outcome.items()))
        return main

    async def check(self, route: Route, before_attempt: Callable[[int], bool] | None = None) -> CheckResult:
        """Check ``route`` on the defaults (no owners) through the global pool."""
        from magpie.queue import Payload

        return await self.check_payload(Payload(0, route, "", []), before_attempt)

    async def judge_reachable(self, max_age: float = 2.0) -> bool:
        """Always True: each check already probed its judges (a failed result without ``judge_fault``
        is the route's)."""
        return True


def profiled_engine(settings, engine, redis, *, subscribe: bool = True) -> ProfiledEngine:
    """A :class:`ProfiledEngine` on a started :class:`ConfigCache` (reconciling every
    ``MAGPIE_CONFIG_RECONCILE_SECONDS``, listening for notifications unless ``subscribe`` is False), with
    its cache record carrying the DNS and plan cache figures.

    Args:
        settings: :class:`magpie.config.Settings`.
        engine: SQLAlchemy engine on the magpie database.
        redis: client on the schedule's Redis.
    """
    holder: dict = {}
    cache = ConfigCache(engine, redis, settings.redis_prefix, reconcile_s=settings.config_reconcile_seconds,
                        subscribe=subscribe, extra_stats=lambda: holder["e"].stats() if "e" in holder else {})
    from magpie.coordination.ratelimit import BlockLimiter

    limiter = BlockLimiter(redis, settings.redis_prefix, "judge", block=settings.judge_rate_block)
    holder["e"] = eng = ProfiledEngine(settings, cache, limiter=limiter)
    cache.start()
    return eng
