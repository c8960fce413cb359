"""Judge pools, check profiles, the config cache, failure streaks and ownership against real services.

Judges are real judge servers on loopback, routes go through a real forward proxy that counts the
connections it accepts, and the schedule, stream and tables are the real Redis and PostgreSQL ones.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
import sqlalchemy as sa

from helpers import history_by_route, wait_until

from magpie.checker.check import LoopThread
from magpie.checker.judge import make_judge_server
from magpie.checker.result import CheckResult
from magpie.pipeline.checkpool import CheckPool, result_entry
from magpie.judges import store
from magpie.judges.cache import ConfigCache, read_cache_records
from magpie.judges.checking import ProfiledEngine
from magpie.judges.ownership import OwnerChanges, drops_key
from magpie.lab.forward import ForwardProxy
from magpie.wiring.jobs import run_job
from magpie.queue import Payload, RouteQueue
from magpie.queue.completion import StreamTarget
from magpie.base.routes import Route
from magpie.stats.entry import entry_fields, parse_entry
from magpie.stats.store import apply_results


class JudgeProc:
    """A judge server in a thread that can be stopped and started again on the same port."""

    def __init__(self, port: int = 0):
        self.port = port
        self.server = None
        self.start()

    def start(self):
        self.server = make_judge_server("127.0.0.1", self.port)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/"


class CountingProxy(ForwardProxy):
    """The lab's forward proxy, counting accepted connections."""

    def __init__(self):
        super().__init__()
        self.count = 0

    async def handle(self, reader, writer):
        self.count += 1
        await super().handle(reader, writer)


@pytest.fixture
def judges2():
    a, b = JudgeProc(), JudgeProc()
    yield a, b
    for j in (a, b):
        with contextlib.suppress(Exception):  # stopped by the test already
            j.stop()


@pytest.fixture
def proxy():
    loop = LoopThread("test-proxy")
    p = CountingProxy()
    server = loop.run(p.start("127.0.0.1", 0))
    p.port = server.sockets[0].getsockname()[1]
    yield p
    server.close()
    loop.stop()


@pytest.fixture
def workspaces(db):
    with db.begin() as c:
        ids = [c.execute(sa.text("INSERT INTO workspaces (name) VALUES (:n) RETURNING id"), {"n": n}).scalar_one()
               for n in ("alpha", "beta")]
    return ids


def make_engine(settings, db, redis_client, **kw):
    cache = ConfigCache(db, redis_client, settings.redis_prefix, reconcile_s=kw.pop("reconcile_s", 0.3), **kw)
    eng = ProfiledEngine(settings, cache)
    cache.extra_stats = eng.stats
    cache.start()
    return eng, cache


def route_via(proxy, user="u"):
    return Route("http", "127.0.0.1", proxy.port, user, "x")


def test_two_judges_one_stopped_checks_go_on_and_the_refresh_job_marks_it(db, settings, redis_client, judges2, proxy):
    a, b = judges2
    store.add_judge(db, a.url)
    store.add_judge(db, b.url)
    eng, cache = make_engine(settings, db, redis_client)
    loop = LoopThread("test-checks")
    try:
        before = [loop.run(eng.check(route_via(proxy, f"u{i}"))) for i in range(6)]
        assert all(r.alive for r in before)
        assert {r.judge for r in before} == {a.url, b.url}  # round robin over both
        a.stop()
        during = [loop.run(eng.check(route_via(proxy, f"v{i}"))) for i in range(10)]
        assert all(r.alive and not r.judge_fault for r in during), [(r.alive, r.error, r.status, r.judge, r.judge_fault) for r in during]
        assert {r.judge for r in during} == {b.url}
        assert eng.failed_over >= 1

        rep = run_job("judge_refresh", settings, engine=db, redis=redis_client)
        assert rep["status"] == "ok", rep
        rows = {r["url"]: r for r in store.list_judges(db)}
        assert rows[a.url]["healthy"] is False and "ConnectionError" in rows[a.url]["last_error"]
        assert rows[b.url]["healthy"] is True and rows[b.url]["addresses"] == ["127.0.0.1"]
        assert rows[b.url]["addresses_until"] is not None
        wait_until(lambda: cache.snapshot.revision == store.read_revision(db), timeout=3,
                   what="the cache at the stored revision")
        assert {j.url: j.healthy for j in cache.snapshot.judges} == {a.url: False, b.url: True}

        a.start()  # same port: the next pass brings it back
        run_job("judge_refresh", settings, engine=db, redis=redis_client)
        rows = {r["url"]: r for r in store.list_judges(db)}
        assert rows[a.url]["healthy"] is True and rows[a.url]["last_error"] is None
    finally:
        cache.stop()
        loop.stop()


def test_a_route_is_never_dead_because_of_its_judges(db, settings, redis_client, judges2, proxy):
    a, b = judges2
    store.add_judge(db, a.url)
    store.add_judge(db, b.url)
    eng, cache = make_engine(settings, db, redis_client)
    loop = LoopThread("test-checks")
    try:
        a.stop()
        b.stop()
        res = loop.run(eng.check(route_via(proxy)))
        assert not res.alive and res.judge_fault  # the pool retries it; nothing is recorded
    finally:
        cache.stop()
        loop.stop()


def test_profile_change_reaches_a_running_checker_with_pubsub_blocked(db, settings, redis_client, judges2, proxy,
                                                                     workspaces):
    a, _ = judges2
    store.add_judge(db, a.url)
    eng, cache = make_engine(settings, db, redis_client, reconcile_s=0.5, subscribe=False)
    loop = LoopThread("test-checks")
    payload = Payload(1, route_via(proxy), "h" * 24, [workspaces[0]])
    try:
        assert loop.run(eng.check_payload(payload)).alive
        t0 = time.monotonic()
        # no publish at all; socks5 through an HTTP-only proxy cannot succeed
        store.set_profile(db, "alpha", {"protocols": ["socks5"], "timeout": 1, "attempts": 1})
        wait_until(lambda: workspaces[0] in cache.snapshot.profiles, timeout=3, interval=0.02,
                   what="the profile in the cache")
        took = time.monotonic() - t0
        assert took <= 0.5 + 0.3, took  # within one reconcile cadence
        res = loop.run(eng.check_payload(payload))  # the running checker uses it at once
        assert (res.alive, res.judge_fault, res.attempts) == (False, False, 1)
        assert res.owners is None  # one owner, one way: the route's outcome is the owner's
        assert cache.notifications == 0 and cache.lag == 0
        cache._write_record()
        rec = [r for r in read_cache_records(redis_client, settings.redis_prefix) if r["instance"] == cache.instance]
        assert rec and rec[0]["lag"] == 0 and rec[0]["caches"]["dns"]["max_size"] == settings.dns_cache_size
    finally:
        cache.stop()
        loop.stop()


def test_a_notification_wakes_the_cache_before_its_cadence(db, settings, redis_client, workspaces):
    _eng, cache = make_engine(settings, db, redis_client, reconcile_s=30.0)
    try:
        wait_until(lambda: redis_client.pubsub_numsub(store.channel(settings.redis_prefix))[0][1] >= 1,
                   what="the cache subscribed")
        rev = store.set_profile(db, "beta", {"timeout": 4}, redis=redis_client, prefix=settings.redis_prefix)
        wait_until(lambda: workspaces[1] in cache.snapshot.profiles, timeout=3, interval=0.02,
                   what="the notified profile in the cache")
        assert cache.snapshot.profiles[workspaces[1]].timeout == 4.0 and cache.notifications >= 1
        assert rev["timeout"] == 4.0
    finally:
        cache.stop()


def _pool(q, eng, stream, redis_client):
    return CheckPool(q, eng, stream, capacity=50, renew_below_ms=0, complete_interval=0.05,
                     owner_changes=OwnerChanges(redis_client, q.keys.prefix)).start()


def test_two_owners_with_the_same_profile_mean_one_connection_per_cycle(db, settings, redis_client, judges2, proxy,
                                                                       workspaces):
    a, _ = judges2
    store.add_judge(db, a.url)
    for name in ("alpha", "beta"):
        store.set_profile(db, name, {"timeout": 4, "attempts": 1})
    eng, cache = make_engine(settings, db, redis_client)
    q = RouteQueue.from_settings(settings, redis_client)
    stream = StreamTarget(settings.redis_prefix + "results", "g", 100_000, "evict_oldest")
    h = "a" * 24
    q.schedule([(h, Payload(7, route_via(proxy), h, workspaces).encode())])
    pool = _pool(q, eng, stream, redis_client)
    try:
        leases = q.pop(10)
        assert len(leases) == 1
        before = proxy.count
        pool.submit(leases)
        assert pool.wait_idle(20)
        assert proxy.count - before == 1  # one connection for both owners
        (_, fields), = redis_client.xrange(stream.key)
        fields = {k.decode(): v.decode() for k, v in fields.items()}
        assert fields["alive"] == "1" and "wf" not in fields  # checked alike: one outcome for both

        store.set_profile(db, "beta", {"timeout": 5})  # now two distinct checks
        cache.reconcile()
        q.r.zadd(q.keys.shard_of(h), {h: 1000})
        q.r.zadd(q.keys.heads, {q.keys.shard_of(h): 1000})
        before = proxy.count
        pool.submit(q.pop(10))
        assert pool.wait_idle(20)
        assert proxy.count - before == 2
        fields = {k.decode(): v.decode() for k, v in redis_client.xrange(stream.key)[-1][1].items()}
        assert fields["wf"] == f"{workspaces[0]}:1,{workspaces[1]}:1"  # each owner's own outcome
    finally:
        pool.close()
        cache.stop()


def _routes(db, owners_by_hash):
    ids = {}
    with db.begin() as c:
        for h, owners in owners_by_hash.items():
            rid = c.execute(sa.text("INSERT INTO routes (route_hash, protocol, host, port) "
                                    "VALUES (:h, 'http', '127.0.0.1', 9) RETURNING id"), {"h": h}).scalar_one()
            ids[h] = rid
            for w in owners:
                c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) VALUES (:r, :w)"),
                          {"r": rid, "w": w})
    return ids


def _entries(ids, alive, n0, wf=None):
    out = []
    for i, (h, rid) in enumerate(sorted(ids.items())):
        res = CheckResult(alive, None, None, 1, None if alive else "ConnectTimeout", None, None, "j",
                          1_700_000_000_000 + n0 * 1000 + i)
        fields = entry_fields(res, rid, h)
        if wf:
            fields["wf"] = wf
        out.append(parse_entry(f"{1_700_000_000_000 + n0}-{i}", fields))
    return out


def _streaks(db):
    from magpie.judges.failures import STREAK_SQL

    with db.connect() as c:
        return {(w, r): n for w, r, n in c.execute(sa.text(
            f"SELECT rw.workspace_id, rw.route_id, {STREAK_SQL} FROM route_workspaces rw "
            "JOIN route_health h ON h.route_id = rw.route_id "
            "LEFT JOIN route_failures f ON f.workspace_id = rw.workspace_id AND f.route_id = rw.route_id"))}


def test_ingestion_keeps_failure_streaks_per_owner(db, workspaces):
    A, B = workspaces
    ids = _routes(db, {"1" * 24: [A, B]})
    rid = ids["1" * 24]
    apply_results(db, _entries(ids, False, 1))
    apply_results(db, _entries(ids, False, 2))
    assert _streaks(db) == {(A, rid): 2, (B, rid): 2}  # checked alike: the route's streak, no extra row
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM route_failures")).scalar_one() == 0
    apply_results(db, _entries(ids, False, 3, wf=f"{A}:1,{B}:0"))  # checked per profile: per owner
    assert _streaks(db) == {(A, rid): 0, (B, rid): 1}
    apply_results(db, _entries(ids, False, 4, wf=f"{A}:0,{B}:0"))
    assert _streaks(db) == {(A, rid): 1, (B, rid): 2}
    apply_results(db, _entries(ids, True, 5))  # alike again: the per-owner rows are stale, the route's counts
    assert _streaks(db) == {(A, rid): 0, (B, rid): 0}


def test_auto_remove_drops_ownership_and_the_last_owner_route_while_an_import_keeps_it(
        db, settings, redis_client, workspaces, tmp_path):
    from magpie.importer.service import import_file

    A, B = workspaces
    store.set_profile(db, "alpha", {"auto_remove_after": 2})
    q = RouteQueue.from_settings(settings, redis_client)
    lists = {"alpha": "127.0.0.1:9\n127.0.0.2:9\n127.0.0.3:9\n", "beta": "127.0.0.1:9\n"}
    for ws, text in lists.items():
        (tmp_path / ws).write_text(text)
        import_file(str(tmp_path / ws), ws, settings, queue=q, engine=db)
    with db.connect() as c:
        by_host = {host: (rid, h.strip()) for rid, h, host in c.execute(sa.text(
            "SELECT id, route_hash, host FROM routes"))}
    shared, contested, last = (by_host[f"127.0.0.{i}"][1] for i in (1, 2, 3))
    ids = {h: rid for rid, h in by_host.values()}
    apply_results(db, _entries(ids, False, 1))
    apply_results(db, _entries(ids, False, 2))

    rep = run_job("route_ownership", settings, engine=db, redis=redis_client)
    assert rep["status"] == "ok" and rep["result"]["auto_removed"] == 3, rep
    with db.connect() as c:
        owners = dict(c.execute(sa.text("SELECT route_id, array_agg(workspace_id) FROM route_workspaces "
                                        "GROUP BY route_id")).all())
    assert owners == {ids[shared]: [B]}
    pending = {k.decode(): v.decode() for k, v in redis_client.hgetall(drops_key(settings.redis_prefix)).items()}
    assert pending == {shared: str(A), last: str(A), contested: str(A)}

    for h in (shared, last, contested):  # all due now
        q.r.zadd(q.keys.shard_of(h), {h: 1000})
        q.r.zadd(q.keys.heads, {q.keys.shard_of(h): 1000})
    leases = {le.member: le for le in q.pop(10)}
    assert set(leases) == {shared, last, contested}
    # an import adds the contested route to beta while its lease is out (PostgreSQL, then Redis)
    src = tmp_path / "list.txt"
    src.write_text("127.0.0.2:9\n")
    report = import_file(str(src), "beta", settings, queue=q, engine=db)
    assert json.loads(q.payload(contested))["w"] == [A, B]
    assert report.imported == 1

    stream = StreamTarget(settings.redis_prefix + "results", "g", 100_000, "evict_oldest")
    changes = OwnerChanges(redis_client, settings.redis_prefix)
    done = [(le, Payload.decode(le.payload), CheckResult(False, None, None, 1, "ConnectTimeout", None, None, "j",
                                                          int(time.time() * 1000)))
            for le in leases.values()]
    plan = changes.plan(done)  # what the pool's flush does: one completion call with the changes
    comp = q.complete_with_results([le for le, _, _ in done], [result_entry(p, r) for _, p, r in done], stream,
                                   desired=plan.desired)
    changes.settle(done, plan, comp.codes)
    assert sorted(comp.codes) == [1, 1, 2] and changes.applied == 3
    assert changes.removed == 1 and changes.kept_by_import == 1
    assert json.loads(q.payload(shared))["w"] == [B]
    assert q.payload(last) is None and q.score(last) is None
    assert json.loads(q.payload(contested))["w"] == [B]  # the import's owner stays
    assert redis_client.hlen(drops_key(settings.redis_prefix)) == 0
    assert redis_client.xlen(stream.key) == 2  # the two completed routes' results

    rep = run_job("route_ownership", settings, engine=db, redis=redis_client)
    assert rep["result"]["deleted"] == 1, rep
    with db.connect() as c:
        left = set(c.execute(sa.text("SELECT route_hash FROM routes")).scalars())
    assert {h.strip() for h in left} == {shared, contested}
    assert history_by_route(db) == {ids[shared]: 2, ids[contested]: 2}  # the deleted route's history went too


def test_verification_records_drops_and_merges_back_missing_owners(db, settings, redis_client, workspaces):
    A, B = workspaces
    q = RouteQueue.from_settings(settings, redis_client)
    h = "4" * 24
    ids = _routes(db, {h: [B]})
    q.schedule([(h, Payload(ids[h], Route("http", "127.0.0.1", 9), h, [A]).encode())])
    rep = run_job("route_ownership", settings, engine=db, redis=redis_client)
    assert rep["result"]["drops"] == 1 and rep["result"]["readded"] == 1, rep
    assert json.loads(q.payload(h))["w"] == [A, B]  # B merged back at once
    assert redis_client.hget(drops_key(settings.redis_prefix), h) == str(A).encode()  # A waits for a lease


def test_verification_sweeps_a_bounded_share_per_pass(db, settings, redis_client, workspaces):
    """Each pass verifies at most MAGPIE_OWNERSHIP_VERIFY_PER_PASS routes and resumes where it stopped,
    so the job's cost per pass does not grow with the population."""
    A, _B = workspaces
    q = RouteQueue.from_settings(settings, redis_client)
    hashes = [str(i) * 24 for i in range(1, 6)]
    ids = _routes(db, {h: [A] for h in hashes})
    q.schedule([(h, Payload(ids[h], Route("http", "127.0.0.1", 9), h, [A]).encode()) for h in hashes])
    bounded = settings.model_copy(update={"ownership_verify_per_pass": 2})
    seen = []
    for _ in range(3):
        rep = run_job("route_ownership", bounded, engine=db, redis=redis_client)
        seen.append((rep["result"]["verified"], rep["result"]["complete"]))
    assert seen == [(2, False), (2, False), (1, True)], seen


def test_complete_with_payload_takes_any_json_encoding(settings, redis_client):
    from magpie.errors import Refusal
    from magpie.queue import QueueError

    q = RouteQueue.from_settings(settings, redis_client)
    h = "5" * 24
    q.schedule([(h, Payload(1, Route("http", "127.0.0.1", 9), h, [1, 2]).encode())])
    q.r.zadd(q.keys.shard_of(h), {h: 1000})
    q.r.zadd(q.keys.heads, {q.keys.shard_of(h): 1000})
    (le,) = q.pop(1)
    desired = json.dumps({"w": [2, 5], "k": h, "v": 1}, indent=2)  # spaces, newlines, another key order
    assert q.complete_with_payload(le, desired) == "completed"
    assert json.loads(q.payload(h))["w"] == [2, 5]
    assert q.payload(h).endswith('"w":[2,5]}')  # stored compact
    q.r.zadd(q.keys.shard_of(h), {h: 1000})
    q.r.zadd(q.keys.heads, {q.keys.shard_of(h): 1000})
    (le,) = q.pop(1)
    with pytest.raises(QueueError) as exc:
        q.complete_with_payload(le, "not json")
    assert exc.value.code is Refusal.BAD_PAYLOAD


@pytest.fixture
def cli(settings, monkeypatch):
    from click.testing import CliRunner

    from magpie.cli import main
    from magpie.config import get_settings

    for k, v in {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
                 "MAGPIE_DATABASE_URL": settings.database_url,
                 "PROXY_ENCRYPTION_KEY": settings.encryption_key}.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    runner = CliRunner()

    def run(*args, code=0):
        res = runner.invoke(main, list(args), catch_exceptions=False)
        assert res.exit_code == code, res.output
        return res

    yield run
    get_settings.cache_clear()


def test_cli_judges_and_profiles(cli, db, workspaces, judges2):
    a, b = judges2
    added = json.loads(cli("judges", "add", a.url, "--json").output)["result"]
    cli("judges", "add", b.url, "--workspace", "alpha", "--rule", "status")
    assert "already" in cli("judges", "add", a.url, code=2).output
    assert "rule" in cli("judges", "add", "http://127.0.0.1:1/", "--rule", "bogus", code=2).output
    listed = json.loads(cli("judges", "list", "--json").output)["result"]
    assert [(j["url"], j["workspace"], j["rule"]) for j in listed] == [(a.url, None, "echo"), (b.url, "alpha", "status")]
    b.stop()
    probes = json.loads(cli("judges", "check", "--json", code=1).output)["result"]
    assert {p["url"]: p["healthy"] for p in probes} == {a.url: True, b.url: False}
    cli("judges", "remove", str(added["id"]))
    assert [j["url"] for j in json.loads(cli("judges", "list", "--json").output)["result"]] == [b.url]

    shown = json.loads(cli("profiles", "show", "alpha", "--json").output)["result"]
    assert shown["custom"] is False and shown["judge_pool"] == "global"
    out = json.loads(cli("profiles", "set", "alpha", "--protocols", "http,socks5", "--timeout", "3",
                         "--auto-remove-after", "5", "--json").output)["result"]
    assert (out["protocols"], out["timeout"], out["auto_remove_after"]) == (["http", "socks5"], 3.0, 5)
    out = json.loads(cli("profiles", "set", "alpha", "--reset", "timeout", "--json").output)["result"]
    assert out["timeout"] is None and out["protocols"] == ["http", "socks5"]
    assert "MAGPIE_PROFILE_MAX_TIMEOUT" in cli("profiles", "set", "alpha", "--timeout", "999", code=2).output
    assert "no workspace" in cli("profiles", "show", "nope", code=2).output


def test_exporter_families_show_cache_lag_and_judge_health(db, settings, redis_client, judges2):
    from magpie.judges.metrics import cache_families, judge_families

    a, _ = judges2
    store.add_judge(db, a.url)
    _eng, cache = make_engine(settings, db, redis_client, reconcile_s=0.2)
    try:
        cache._write_record()
        fams = {f.name: f for f in cache_families(redis_client, settings.redis_prefix)}
        lag = [s for s in fams["magpie_config_cache_revision_lag"].samples if s.labels["process"] == cache.instance]
        assert lag and lag[0].value == 0
        sizes = {s.labels["cache"] for s in fams["magpie_cache_max_size"].samples
                 if s.labels["process"] == cache.instance}
        assert sizes == {"dns", "plans"}
        with db.connect() as conn:
            (healthy,) = list(judge_families(conn))
        assert [(s.labels, s.value) for s in healthy.samples] == [({"judge": a.url, "pool": "global"}, 1.0)]
    finally:
        cache.stop()
