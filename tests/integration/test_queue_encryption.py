"""Queue credential encryption (``PROXY_QUEUE_ENCRYPT_CREDENTIALS``) against real Redis and PostgreSQL:
import, rebuild, the check pool, ``queue update`` and ``queue migrate-payloads``, and a lab check cycle."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import wait_until

from magpie.checker import CheckResult
from magpie.pipeline.checkpool import CheckPool
from magpie.cli import main
from magpie.config import get_settings
from magpie.base.crypto import get_keyring
from magpie.pipeline.promote import promote
from magpie.importer.service import import_file
from magpie.lab.lab import LAB_PASSWORD, LAB_USER, start_free_lab
from magpie.maintenance.rebuild import rebuild_schedule
from magpie.queue import Lease, Payload, RouteQueue
from magpie.queue import migrate as migrate_mod
from magpie.queue.completion import StreamTarget
from magpie.queue.migrate import migrate_payloads
from magpie.queue.payload import payload_revision, read_cipher
from magpie.queue.streams import stream_key

ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = ("Zq9-distinct-pw-A", "Zq9-distinct-pw-B")
LIST = f"""\
socks5://qz-user-1:{PASSWORDS[0]}@127.0.0.1:1080
http://qz-user-2:{PASSWORDS[1]}@127.0.0.2:3128
127.0.0.3:8080
"""
SECRETS = (b"Zq9-distinct", b"qz-user-")


@pytest.fixture
def enc(settings):
    return settings.model_copy(update={"encrypt_queue_credentials": True})


@pytest.fixture
def q(settings, redis_client):
    return RouteQueue.from_settings(settings, redis_client)


@pytest.fixture
def listfile(tmp_path):
    f = tmp_path / "list.txt"
    f.write_text(LIST)
    return f


@pytest.fixture
def cli(settings, monkeypatch):
    """``run(*args, env={...}, code=0)``: the CLI in-process on the test prefix and database."""
    base = {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
            "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
            "PROXY_QUEUE_ENCRYPT_CREDENTIALS": "false"}

    def run(*args, env=None, code=0):
        for k, v in {**base, **(env or {})}.items():
            monkeypatch.setenv(k, v)
        get_settings.cache_clear()
        res = CliRunner().invoke(main, list(args), catch_exceptions=False)
        assert res.exit_code == code, res.output
        return res

    yield run
    get_settings.cache_clear()


def dump(r, prefix: str) -> bytes:
    """Every value under ``prefix`` (SCAN, then GET/HGETALL/... by type), as one blob."""
    out = []
    for pat in (prefix + "*", "{" + prefix + "*"):
        for key in r.scan_iter(match=pat, count=1000):
            t = r.type(key).decode()
            out.append(key)
            if t == "string":
                out.append(r.get(key))
            elif t == "hash":
                out += [x for kv in r.hgetall(key).items() for x in kv]
            elif t == "zset":
                out += r.zrange(key, 0, -1)
            elif t == "list":
                out += r.lrange(key, 0, -1)
            elif t == "set":
                out += list(r.smembers(key))
            elif t == "stream":
                out += [x for _, f in r.xrange(key) for kv in f.items() for x in kv]
    return b"\n".join(out)


def payloads(q) -> dict[str, str]:
    keys = list(q.r.scan_iter(match=q.keys.payload_prefix + "*", count=1000))
    if not keys:
        return {}
    return {k.decode()[len(q.keys.payload_prefix):]: v.decode() for k, v in zip(keys, q.r.mget(keys))}


def make_all_due(q) -> None:
    for shard in q.keys.all_shards():
        members = q.r.zrange(shard, 0, -1)
        if members:
            q.r.zadd(shard, {m: 1000 for m in members})
            q.r.zadd(q.keys.heads, {shard: 1000})


def test_import_with_the_setting_on_stores_no_plaintext_credential(db, enc, q, listfile, redis_client):
    import_file(listfile, "alpha", enc, queue=q, engine=db)
    blob = dump(redis_client, enc.redis_prefix)
    assert blob and not any(s in blob for s in SECRETS)
    stored = payloads(q)
    assert sorted(p[:7] for p in stored.values()) == ['{"v":1,', '{"v":2,', '{"v":2,']  # no creds: v 1
    creds = {(d.route.username, d.route.password) for d in (Payload.decode(p, read_cipher(enc))
                                                             for p in stored.values())}
    assert creds == {("qz-user-1", PASSWORDS[0]), ("qz-user-2", PASSWORDS[1]), (None, None)}

    # a second workspace merges into the sealed payloads: credentials kept, still sealed
    import_file(listfile, "beta", enc, queue=q, engine=db)
    after = payloads(q)
    assert not any(s in dump(redis_client, enc.redis_prefix) for s in SECRETS)
    for h, text in after.items():
        assert text.rsplit('"w":', 1)[0] == stored[h].rsplit('"w":', 1)[0]  # only "w" changed
        d = Payload.decode(text, read_cipher(enc))
        assert len(d.workspaces) == 2 and (d.route.username, d.route.password) in creds

    # a rebuild adds a lost route back sealed and rewrites none of the others (sealing is deterministic)
    lost = next(h for h, t in after.items() if t.startswith('{"v":2,'))
    q.r.delete(q.keys.payload(lost))
    q.r.zrem(q.keys.shard_of(lost), lost)
    rebuild_schedule(enc, engine=db, queue=q, lock=False)
    rebuilt = payloads(q)  # the session's database may hold other tests' routes too: compare ours
    assert {h: rebuilt.get(h) for h in after} == after


def test_import_with_the_setting_off_writes_legacy_plaintext(db, settings, q, listfile):
    import_file(listfile, "alpha", settings, queue=q, engine=db)
    assert sum(PASSWORDS[0] in p or PASSWORDS[1] in p for p in payloads(q).values()) == 2


class RecordingEngine:
    """Stands in for the check engine: records the credentials each check was given; answers alive."""

    judge_url, attempts, max_check_seconds = "http://judge.invalid/", 1, 5.0

    def __init__(self):
        self.seen = []

    async def check(self, route, before_attempt=None):
        self.seen.append((route.port, route.username, route.password))
        await asyncio.sleep(0)  # a yield to the loop, as a real check makes; not a wait
        return CheckResult(True, 1.0, 200, 1, None, "{}", "elite", self.judge_url, int(time.time() * 1000))

    async def check_payload(self, payload, before_attempt=None):
        return await self.check(payload.route, before_attempt)

    async def judge_reachable(self, max_age=2.0):
        return True


def run_pool(q, cipher):
    engine = RecordingEngine()
    stream = StreamTarget(q.keys.prefix + "results", "test-group", 1_000_000)
    pool = CheckPool(q, engine, stream, capacity=50, renew_below_ms=0, complete_interval=0.05,
                     payload_cipher=cipher).start()
    try:
        make_all_due(q)
        n = promote(q, lambda ds: pool.submit([Lease.from_dict(d) for d in ds]), budget=100, max_inflight=100)
        assert pool.wait_idle(10)

        def accounted():
            t = pool.stats().totals
            return t.completed + t.malformed >= n

        wait_until(accounted, timeout=10, what="every claimed lease completed or reported malformed")
        return engine, pool.stats().totals
    finally:
        pool.close()


def test_the_pool_reads_sealed_and_legacy_payloads_side_by_side(db, settings, enc, q, listfile, tmp_path,
                                                                caplog):
    import_file(listfile, "alpha", settings, queue=q, engine=db)  # legacy plaintext
    newer = tmp_path / "newer.txt"
    newer.write_text("socks5://qz-user-3:Zq9-distinct-pw-C@127.0.0.4:1081\n")
    import_file(newer, "alpha", enc, queue=q, engine=db)  # sealed
    assert sorted(p[:7] for p in payloads(q).values()) == ['{"v":1,'] * 3 + ['{"v":2,']

    engine, totals = run_pool(q, read_cipher(settings))
    assert sorted(engine.seen) == [
        (1080, "qz-user-1", PASSWORDS[0]), (1081, "qz-user-3", "Zq9-distinct-pw-C"),
        (3128, "qz-user-2", PASSWORDS[1]), (8080, None, None)]
    assert totals.completed == 4 and totals.malformed == 0

    # under another key the sealed route is not checked: one clear line, no credential in the log
    caplog.set_level(logging.DEBUG)
    engine, totals = run_pool(q, get_keyring("another-key-0123456789abcdef").queue)
    assert totals.malformed == 1 and len(engine.seen) == 3
    lines = [r.getMessage() for r in caplog.records if "malformed payload" in r.getMessage()]
    assert len(lines) == 1 and "PROXY_ENCRYPTION_KEY" in lines[0] and "\n" not in lines[0]
    assert not any(s.decode() in caplog.text for s in SECRETS) and "Zq9" not in caplog.text


def test_a_workers_ownership_change_keeps_sealed_credentials(db, enc, q, listfile):
    import_file(listfile, "alpha", enc, queue=q, engine=db)
    import_file(listfile, "beta", enc, queue=q, engine=db)
    make_all_due(q)
    cipher = read_cipher(enc)
    le = next(x for x in q.pop(10) if x.payload.startswith('{"v":2,'))
    desired = Payload.decode(le.payload, cipher)
    desired.workspaces = desired.workspaces[:1]
    assert q.complete_with_payload(le, desired.encode(cipher)) == "completed"
    now = Payload.decode(q.payload(le.member), cipher)
    assert now.workspaces == desired.workspaces and now.route == desired.route and now.version == 2


def test_migrate_encrypt_then_decrypt_round_trips_and_a_rerun_changes_nothing(db, cli, q, listfile,
                                                                              redis_client, settings):
    cli("import", str(listfile), "--workspace", "alpha", "--json")
    before = payloads(q)
    assert any(s in dump(redis_client, settings.redis_prefix) for s in SECRETS)

    on = {"PROXY_QUEUE_ENCRYPT_CREDENTIALS": "true"}
    first = json.loads(cli("queue", "migrate-payloads", "--encrypt", "--batch", "1", "--json", env=on).stdout)
    assert first["ok"] and first["result"]["changed"] == 2 and first["result"]["scanned"] >= 3
    assert first["result"]["skipped"] == first["result"]["scanned"] - 2
    assert not any(s in dump(redis_client, settings.redis_prefix) for s in SECRETS)
    again = json.loads(cli("queue", "migrate-payloads", "--encrypt", "--json", env=on).stdout)["result"]
    assert again["changed"] == 0 and again["deferred"] == 0

    res = cli("queue", "migrate-payloads", "--decrypt")  # text form; the setting is off here
    assert "decrypted 2 payloads" in res.stdout and "Zq9" not in res.output
    assert payloads(q) == before  # byte for byte
    last = json.loads(cli("queue", "migrate-payloads", "--decrypt", "--json").stdout)["result"]
    assert last["changed"] == 0


def test_migrate_defers_leased_routes_and_resumes_where_it_stopped(db, settings, q, listfile):
    import_file(listfile, "alpha", settings, queue=q, engine=db)
    cipher = read_cipher(settings)
    make_all_due(q)
    leases = q.pop(10)
    le = next(x for x in leases if "qz-user-1" in x.payload)
    q.complete([x for x in leases if x is not le])

    class Stop(Exception):
        pass

    def stop_after_one(counts):
        if counts["changed"]:
            raise Stop

    with pytest.raises(Stop):  # interrupted after its first rewrite
        migrate_payloads(q, cipher, encrypt=True, batch=1, progress=stop_after_one)
    rest = migrate_payloads(q, cipher, encrypt=True, batch=1)
    assert rest["changed"] == 0 and rest["deferred"] == 1  # the leased one waits for its lease
    assert "qz-user-1" in q.payload(le.member)
    q.complete([le])
    last = migrate_payloads(q, cipher, encrypt=True, batch=2)
    assert last["changed"] == 1 and last["deferred"] == 0
    assert all(p.startswith('{"v":2,') or "qz-user" not in p for p in payloads(q).values())


@pytest.mark.parametrize("retries", [2, 0])
def test_migrate_never_loses_a_concurrent_workspace_merge(db, settings, q, listfile, monkeypatch, retries):
    import_file(listfile, "alpha", settings, queue=q, engine=db)
    cipher = read_cipher(settings)
    target = next(h for h, p in payloads(q).items() if "qz-user-2" in p)
    real = migrate_mod.transcode
    merged = []

    def racing(raw, c, *, encrypt):
        out = real(raw, c, encrypt=encrypt)
        text = raw.decode() if isinstance(raw, bytes) else raw
        if not merged and "qz-user-2" in text:  # an import merges workspace 99 between read and write
            d = Payload.decode(text)
            d.workspaces = [99]
            q.schedule([(target, d.encode())])
            merged.append(True)
        return out

    monkeypatch.setattr(migrate_mod, "transcode", racing)
    counts = migrate_payloads(q, cipher, encrypt=True, batch=10, retries=retries)
    now = Payload.decode(q.payload(target), cipher)
    assert 99 in now.workspaces and len(now.workspaces) == 2 and now.route.password == PASSWORDS[1]
    if retries:
        assert counts["changed"] == 2 and q.payload(target).startswith('{"v":2,')
    else:
        assert counts["changed"] == 1 and counts["deferred"] == 1 and now.version == 1


def test_a_wrong_key_is_one_line_naming_the_setting(db, cli, q, listfile):
    on = {"PROXY_QUEUE_ENCRYPT_CREDENTIALS": "true"}
    cli("import", str(listfile), "--workspace", "alpha", "--json", env=on)
    wrong = {"PROXY_ENCRYPTION_KEY": "another-key-0123456789abcdef"}
    res = cli("queue", "migrate-payloads", "--decrypt", "--json", env=wrong, code=2)
    err = res.stderr.strip()
    assert "PROXY_ENCRYPTION_KEY" in err and len(err.splitlines()) == 1 and "Traceback" not in res.output
    assert "Zq9" not in res.output and "qz-user" not in res.output and "another-key" not in res.output
    sealed = next(p for p in payloads(q).values() if p.startswith('{"v":2,'))
    h = json.loads(sealed)["k"]
    res = cli("queue", "update", h, sealed, "--expected-revision", payload_revision(sealed), env=wrong, code=2)
    assert "PROXY_ENCRYPTION_KEY" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_queue_update_honours_the_setting(db, cli, q, listfile, settings):
    cli("import", str(listfile), "--workspace", "alpha", "--json")
    h, plain = next((h, p) for h, p in payloads(q).items() if "qz-user-1" in p)
    cli("queue", "update", h, plain, "--expected-revision", payload_revision(plain),
        env={"PROXY_QUEUE_ENCRYPT_CREDENTIALS": "true"})
    stored = q.payload(h)
    assert stored.startswith('{"v":2,') and "Zq9" not in stored
    # a sealed payload given with the setting off is stored in plaintext
    cli("queue", "update", h, stored, "--expected-revision", payload_revision(stored))
    assert q.payload(h) == plain


CYCLE = """
import json
from magpie.wiring import runtime
from magpie.pipeline.promote import promote
from magpie.queue import Lease
pool = runtime.check_pool()
q = runtime.route_queue()
n = promote(q, lambda ds: pool.submit([Lease.from_dict(d) for d in ds]), budget=100, max_inflight=100)
ok = pool.wait_idle(60)
t = pool.stats().totals
import sys, dataclasses; print(dataclasses.asdict(t), file=sys.stderr); print(json.dumps({"claimed": n, "idle": ok, "completed": t.completed, "malformed": t.malformed}))
runtime.close_check_pool()
"""


def test_a_check_cycle_decrypts_and_checks_through_the_authenticated_socks5_proxy(db, settings, pg_url, q,
                                                                                  redis_client, tmp_path):
    lab = start_free_lab(slow_delay=0.2)
    try:
        env = dict(os.environ, MAGPIE_REDIS_URL=settings.redis_url, MAGPIE_REDIS_PREFIX=settings.redis_prefix,
                   MAGPIE_DATABASE_URL=pg_url, MAGPIE_JUDGE_URL=lab.judge_url, MAGPIE_CHECK_TIMEOUT="3",
                   PROXY_ENCRYPTION_KEY=settings.encryption_key, MAGPIE_CHECKS_PER_PROCESS="100",
                   PROXY_QUEUE_ENCRYPT_CREDENTIALS="true", PYTHONPATH=str(ROOT))
        lst = tmp_path / "lab.txt"
        lab.write_list(lst)
        imp = subprocess.run([sys.executable, "-m", "magpie", "import", str(lst), "--workspace", "lab",
                              "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert imp.returncode == 0, imp.stderr
        blob = dump(redis_client, settings.redis_prefix)
        assert LAB_PASSWORD.encode() not in blob and b"p%40ss" not in blob
        assert f'"u":"{LAB_USER}"'.encode() not in blob
        make_all_due(q)
        cyc = subprocess.run([sys.executable, "-c", CYCLE], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert cyc.returncode == 0, cyc.stderr
        out = json.loads(cyc.stdout.strip().splitlines()[-1])
    finally:
        lab.stop()
    assert out == {"claimed": len(lab.proxies), "idle": True, "completed": len(lab.proxies), "malformed": 0}, cyc.stderr[-3000:]
    auth = lab.proxy("socks5-auth").route
    cipher = read_cipher(settings)
    h = next(h for h, p in payloads(q).items() if Payload.decode(p, cipher).route.port == auth.port)
    assert payloads(q)[h].startswith('{"v":2,')
    entries = redis_client.xrange(stream_key(settings.redis_prefix))
    results = {f[b"route_hash"].decode(): f for _, f in entries}
    assert results[h][b"alive"] == b"1", results[h]
    assert LAB_PASSWORD not in cyc.stdout + cyc.stderr and "p%40ss" not in cyc.stdout + cyc.stderr
