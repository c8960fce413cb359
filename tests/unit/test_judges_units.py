"""Pure pieces of judge pools and profiles: plans, judge selection, the DNS cache, rules, streak folding."""

from __future__ import annotations

import asyncio
import socket

import pytest

from magpie.judges.dns import DnsCache
from magpie.judges.failures import _fold, parse_owners
from magpie.judges.ownership import payload_owners, with_owners
from magpie.judges.plan import GLOBAL, Defaults, JudgePools, PlanCache, make_plan
from magpie.checker.rules import validate_rule
from magpie.judges.store import JudgeInfo, Profile, Snapshot, _dead_policy, profile_cadence_ms, validate_profile

D = Defaults(10.0, 2, "http://127.0.0.1:8899/")


def test_owners_without_profiles_get_one_simple_check():
    plan = make_plan(Snapshot(3), "socks5", (1, 2), D)
    assert plan.simple and len(plan.variants) == 1
    v = plan.variants[0]
    assert (v.protocol, v.pool, v.timeout, v.attempts, v.rule, v.owners) == ("socks5", GLOBAL, 10.0, 2, None, (1, 2))


def test_same_profile_for_two_owners_is_one_check_and_different_timeouts_are_two():
    same = Snapshot(4, profiles={1: Profile(1, timeout=5.0), 2: Profile(2, timeout=5.0)})
    plan = make_plan(same, "http", (1, 2), D)
    assert not plan.simple and [v.owners for v in plan.variants] == [(1, 2)]
    differ = Snapshot(5, profiles={1: Profile(1, timeout=5.0), 2: Profile(2, timeout=7.0)})
    assert sorted(v.timeout for v in make_plan(differ, "http", (1, 2), D).variants) == [5.0, 7.0]


def test_protocols_fan_out_and_merge_across_owners():
    snap = Snapshot(6, profiles={1: Profile(1, protocols=("http", "socks5")), 2: Profile(2, protocols=("socks5",))})
    plan = make_plan(snap, "http", (1, 2, 3), D)
    got = {(v.protocol, v.owners) for v in plan.variants}
    # owner 3 has no profile: the route's own protocol (http) on the defaults, merged with owner 1's http
    assert got == {("http", (1, 3)), ("socks5", (1, 2))}


def test_workspace_pool_only_when_the_workspace_has_judges():
    j = JudgeInfo(9, "http://127.0.0.2/", "http", workspace_id=1)
    with_pool = Snapshot(7, judges=(j,), profiles={1: Profile(1, judge_pool="workspace")})
    assert make_plan(with_pool, "http", (1,), D).variants[0].pool == 1
    without = Snapshot(8, profiles={1: Profile(1, judge_pool="workspace")})
    assert make_plan(without, "http", (1,), D).variants[0].pool == GLOBAL


def test_plan_cache_is_bounded_and_keyed_by_revision():
    cache = PlanCache(max_size=2)
    s1, s2 = Snapshot(1), Snapshot(2)
    cache.get(s1, "http", [1], D)
    cache.get(s1, "http", [1], D)
    cache.get(s2, "http", [1], D)
    cache.get(s2, "http", [2], D)
    assert cache.stats() == {"hits": 1, "misses": 3, "evictions": 1, "size": 2, "max_size": 2}


def test_round_robin_among_healthy_judges_of_the_wanted_scheme():
    a, b = JudgeInfo(1, "http://127.0.0.1:1/", "http"), JudgeInfo(2, "http://127.0.0.1:2/", "http")
    sick = JudgeInfo(3, "http://127.0.0.1:3/", "http", healthy=False)
    tls = JudgeInfo(4, "https://127.0.0.1:4/", "https")
    pools = JudgePools(Snapshot(1, judges=(a, b, sick, tls)), D.judge_url)
    firsts = [pools.candidates(GLOBAL, "http")[0].id for _ in range(4)]
    assert sorted(firsts) == [1, 1, 2, 2] and firsts[0] != firsts[1]
    assert pools.candidates(GLOBAL, "http")[-1].id == 3  # unhealthy last
    assert pools.candidates(GLOBAL, "https")[0].id == 4  # CONNECT tests prefer an https judge
    pools.mark_down(a)
    assert [j.id for j in pools.candidates(GLOBAL, "http")][:2] == [2, 4]


def test_empty_global_pool_is_the_judge_url_setting():
    pools = JudgePools(Snapshot(1), "http://127.0.0.9:8899/")
    assert [(j.id, j.url) for j in pools.candidates(GLOBAL, "socks5")] == [(0, "http://127.0.0.9:8899/")]


def test_dns_cache_respects_ttl_bound_and_counts():
    now = [0.0]
    calls = []

    async def resolve(host, port):
        calls.append(host)
        if host == "bad.test":
            raise socket.gaierror(socket.EAI_NONAME, "nope")
        return [f"127.0.0.{len(calls)}"], 5.0 if host == "short.test" else None

    cache = DnsCache(max_size=2, ttl=60.0, negative_ttl=10.0, resolve=resolve, clock=lambda: now[0])

    async def go():
        a1 = await cache("a.test")
        a2 = await cache("A.test")
        await cache("short.test")
        now[0] = 6.0  # short.test (record TTL 5 s) expired, a.test (60 s) not
        await cache("short.test")
        with pytest.raises(OSError):
            await cache("bad.test")
        with pytest.raises(OSError):
            await cache("bad.test")  # negative hit, no new lookup
        return a1, a2

    a1, a2 = asyncio.run(go())
    assert a1 == a2 and calls.count("a.test") == 1 and calls.count("short.test") == 2
    assert calls.count("bad.test") == 1
    st = cache.stats()
    assert (st["hits"], st["negative_hits"], st["size"], st["max_size"]) == (1, 1, 2, 2)
    assert st["evictions"] >= 1


def test_concurrent_lookups_of_one_name_share_one_resolution():
    calls = []

    async def resolve(host, port):
        calls.append(host)
        await asyncio.sleep(0.05)  # the behaviour: a slow resolver, so the lookups overlap
        return ["127.0.0.1"], None

    cache = DnsCache(resolve=resolve)

    async def go():
        return await asyncio.gather(*(cache("x.test") for _ in range(20)))

    assert all(r == ["127.0.0.1"] for r in asyncio.run(go())) and calls == ["x.test"]


@pytest.mark.parametrize("rule,ok", [("echo", True), ("status", True), ("contains:origin", True),
                                     ("contains:", False), ("json", False)])
def test_rules(rule, ok):
    if ok:
        assert validate_rule(rule) == rule
    else:
        with pytest.raises(ValueError):
            validate_rule(rule)


def test_profile_validation_names_the_field():
    assert validate_profile({"protocols": "http, socks5", "timeout": 3, "judge_pool": None},
                            max_timeout=30, max_attempts=3) == {"protocols": ["http", "socks5"], "timeout": 3.0,
                                                                "judge_pool": "global"}
    with pytest.raises(ValueError, match="timeout"):
        validate_profile({"timeout": 99}, max_timeout=30, max_attempts=3)
    with pytest.raises(ValueError, match="protocols"):
        validate_profile({"protocols": "ftp"}, max_timeout=30, max_attempts=3)


def test_profile_cadence_fields_validate_and_keep_the_dead_policy_whole():
    ok = validate_profile({"check_interval": 60, "dead_after": 3, "dead_factor": 5}, max_timeout=30, max_attempts=3)
    assert ok == {"check_interval": 60.0, "dead_after": 3, "dead_factor": 5}
    for bad, field in (({"check_interval": 0.5}, "check_interval"), ({"check_interval": 31 * 86400}, "check_interval"),
                       ({"dead_after": 0}, "dead_after"), ({"dead_factor": 1}, "dead_factor")):
        with pytest.raises(ValueError, match=field):
            validate_profile(bad, max_timeout=30, max_attempts=3)
    none = {"dead_after": None, "dead_factor": None}
    assert _dead_policy({"dead_after": 3}, none) == {"dead_after": 3, "dead_factor": 4}  # the default factor
    assert _dead_policy({"dead_after": 3}, {"dead_after": 2, "dead_factor": 6}) == {"dead_after": 3}  # keeps 6
    assert _dead_policy({"dead_after": None}, {"dead_after": 2, "dead_factor": 6}) == none  # the whole policy
    assert _dead_policy({"dead_factor": None}, {"dead_after": 2, "dead_factor": 6}) == {"dead_factor": 4}
    assert _dead_policy({"dead_factor": 7}, {"dead_after": 2, "dead_factor": 6}) == {"dead_factor": 7}
    with pytest.raises(ValueError, match="dead_factor needs dead_after"):
        _dead_policy({"dead_factor": 7}, none)
    assert profile_cadence_ms({"check_interval": 1.5, "dead_after": None, "dead_factor": None}) == {
        "interval_ms": 1500, "dead_after": 0, "dead_factor": 0}
    assert profile_cadence_ms({"check_interval": None, "dead_after": 3, "dead_factor": 4}) == {
        "interval_ms": 0, "dead_after": 3, "dead_factor": 4}


def test_streak_folding_and_owner_parsing():
    assert _fold([(False, 1), (False, 2)]) == (False, 2, 2, 2)
    assert _fold([(False, 1), (True, 2), (False, 3)]) == (True, 1, 3, 3)
    assert _fold([(True, 1)]) == (True, 0, None, 1)
    assert parse_owners("3:1,7:0,x:1,8:") == [(3, True), (7, False)]


def test_payload_owner_helpers_take_any_encoding():
    compact = '{"v":1,"id":4,"p":"http","h":"127.0.0.1","o":80,"k":"abc","w":[1,7]}'
    assert payload_owners(compact) == {1, 7}
    assert payload_owners('{ "w" : [ 7 , 2 ], "v": 1 }') == {2, 7}
    assert with_owners(compact, {9, 3}) == compact.replace("[1,7]", "[3,9]")
