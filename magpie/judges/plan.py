"""Which checks a route gets this cycle: its owners' profiles merged into distinct checks.

A route owned by several workspaces is checked once per distinct (protocol, judge pool, timeout,
attempts, rule) combination of its owners' profiles; each :class:`Variant` lists the owners its result
counts for. A workspace without a profile row checks the route's own protocol on the global pool with the
deployment's timeout, attempts and the judges' rule. Plans are pure functions of a snapshot, cached per
(revision, protocol, owners) in a bounded :class:`PlanCache`, so the check path does one dict lookup.

:class:`JudgePools` picks judges: per pool (``global`` or a workspace id) and scheme, round robin among
the healthy judges; ``https`` tests prefer https judges (CONNECT plus TLS), the others http judges,
falling back to the other scheme, and to unhealthy judges only when no healthy one is left. The
deployment's ``MAGPIE_JUDGE_URL`` is the global pool while no global judge is stored.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import urlsplit

from magpie.base.protocols import prefers_tls_judge
from magpie.judges.store import JudgeInfo, Profile, Snapshot

GLOBAL = "global"


@dataclass(frozen=True, slots=True)
class Defaults:
    """The deployment's check defaults: seconds per attempt, attempts, and the fallback judge URL."""

    timeout: float
    attempts: int
    judge_url: str


@dataclass(frozen=True, slots=True)
class Variant:
    """One check of a route: how, and for which owners (workspace ids)."""

    protocol: str
    pool: str | int  # GLOBAL or a workspace id
    timeout: float
    attempts: int
    rule: str | None  # None: each judge's own rule
    owners: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """The variants of one route; ``simple``: one variant on the defaults for every owner (its result
    needs no per-owner attribution)."""

    variants: tuple[Variant, ...]
    simple: bool


def make_plan(snapshot: Snapshot, protocol: str, owners: tuple[int, ...], d: Defaults) -> Plan:
    """The plan of a route with ``protocol`` owned by ``owners`` under ``snapshot`` (see module doc)."""
    groups: dict[tuple, list[int]] = {}
    has_pool = {j.workspace_id for j in snapshot.judges if j.workspace_id is not None}
    custom = False
    for ws in owners or (0,):
        p: Profile | None = snapshot.profiles.get(ws)
        if p is None:
            key = ((protocol,), GLOBAL, d.timeout, d.attempts, None)
        else:
            custom = True
            pool: str | int = ws if p.judge_pool == "workspace" and ws in has_pool else GLOBAL
            key = (p.protocols or (protocol,), pool, float(p.timeout or d.timeout), int(p.attempts or d.attempts),
                   p.rule)
        groups.setdefault(key, []).append(ws)
    variants: dict[tuple, list[int]] = {}
    for (protos, pool, timeout, attempts, rule), wss in groups.items():
        for proto in protos:
            variants.setdefault((proto, pool, timeout, attempts, rule), []).extend(wss)
    out = tuple(Variant(*k, owners=tuple(sorted(set(v)))) for k, v in variants.items())
    return Plan(out, simple=not custom and len(out) == 1)


class PlanCache:
    """Bounded LRU of plans keyed by (revision, protocol, owners); counts hits, misses and evictions.
    A new revision makes old keys unreachable; they leave as the bound pushes them out."""

    def __init__(self, max_size: int = 4096) -> None:
        self.max_size = max(1, int(max_size))
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def get(self, snapshot: Snapshot, protocol: str, owners, d: Defaults) -> Plan:
        """The cached plan, made on a miss."""
        key = (snapshot.revision, protocol, tuple(owners))
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            return plan
        self.misses += 1
        plan = self._plans[key] = make_plan(snapshot, protocol, key[2], d)
        if len(self._plans) > self.max_size:
            self._plans.popitem(last=False)
            self.evictions += 1
        return plan

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "size": len(self._plans), "max_size": self.max_size}


class JudgePools:
    """Judge selection over one snapshot (see module doc); ``down_s``: how long a judge a check found
    failing stays behind the others in this process."""

    def __init__(self, snapshot: Snapshot, fallback_url: str, down_s: float = 30.0) -> None:
        self.revision = snapshot.revision
        self.down_s = float(down_s)
        self._down: dict[int, float] = {}
        by_pool: dict[str | int, list[JudgeInfo]] = {}
        for j in snapshot.judges:
            by_pool.setdefault(GLOBAL if j.workspace_id is None else j.workspace_id, []).append(j)
        if not by_pool.get(GLOBAL):
            by_pool[GLOBAL] = [JudgeInfo(0, fallback_url, urlsplit(fallback_url).scheme or "http")]
        self._pools = by_pool
        self._rr: dict[tuple, itertools.count] = {}
        self._tier_cache: dict[tuple, tuple[list[JudgeInfo], ...]] = {}

    def carry_down(self, older: JudgePools | None) -> None:
        """Keep ``older``'s local down marks (a new snapshot does not forget a judge just seen failing)."""
        if older is not None:
            self._down.update(older._down)

    def mark_down(self, judge: JudgeInfo) -> None:
        self._down[judge.id] = time.monotonic() + self.down_s

    def _tiers(self, pool: str | int, tls: bool) -> tuple[list[JudgeInfo], ...]:
        """Judges of ``pool`` by (healthy, preferred scheme): built once per snapshot."""
        key = (pool, tls)
        tiers = self._tier_cache.get(key)
        if tiers is None:
            judges = self._pools.get(pool) or self._pools[GLOBAL]
            want = "https" if tls else "http"
            tiers = ([], [], [], [])
            for j in judges:
                tiers[(0 if j.scheme == want else 1) + (0 if j.healthy else 2)].append(j)
            self._tier_cache[key] = tiers
        return tiers

    def first(self, pool: str | int, protocol: str) -> JudgeInfo:
        """The judge to try first (round robin among the healthy judges of the preferred scheme); the
        common case of :meth:`candidates`, without building the whole list."""
        if not self._down:
            for i, tier in enumerate(self._tiers(pool, prefers_tls_judge(protocol))):
                if tier:
                    if len(tier) == 1:
                        return tier[0]
                    return tier[next(self._rr.setdefault((pool, i), itertools.count())) % len(tier)]
        return self.candidates(pool, protocol)[0]

    def candidates(self, pool: str | int, protocol: str, exclude: int | None = None) -> list[JudgeInfo]:
        """Judges to try in order (see the module doc), judges marked down in this process behind the
        others of their tier group; ``exclude``: a judge id already tried."""
        now = time.monotonic()
        down = self._down
        for jid in [k for k, until in down.items() if until <= now]:
            del down[jid]
        out: list[JudgeInfo] = []
        later: list[JudgeInfo] = []
        for i, tier in enumerate(self._tiers(pool, prefers_tls_judge(protocol))):
            if len(tier) > 1:
                n = next(self._rr.setdefault((pool, i), itertools.count())) % len(tier)
                tier = tier[n:] + tier[:n]
            for j in tier:
                if j.id == exclude:
                    continue
                (later if j.id in down and i < 2 else out).append(j)
            if i == 1:
                out.extend(later)
                later = []
        return out
