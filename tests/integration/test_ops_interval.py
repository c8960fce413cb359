"""Interval changes converge by themselves: the stored interval, the bounded, resumable respread (job and
``magpie queue respread``), its progress and its metrics, against real Redis and PostgreSQL."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from magpie.maintenance import interval as iv
from magpie.wiring.jobs import run_job
from magpie.queue import QueueKeys, RouteQueue
from magpie.queue.payload import Payload
from magpie.base.routes import Route


def _items(n: int):
    out = []
    for i in range(n):
        h = f"{i:024x}"
        out.append((h, Payload(i, Route("http", "127.0.0.1", 1000 + i % 60000), h, [1]).encode()))
    return out


def _queue(redis_client, prefix, interval_s: float, shards: int = 4) -> RouteQueue:
    return RouteQueue(redis_client, QueueKeys(prefix, shards), interval_ms=int(interval_s * 1000))


def _offsets(q: RouteQueue, now_ms: int) -> list[float]:
    """Due times (ms from ``now_ms``) of every unleased route."""
    out = []
    for shard in q.keys.all_shards():
        out += [s - now_ms for _, s in q.r.zrange(shard, 0, -1, withscores=True) if s % 1 != 0.5]
    return out


def _now_ms(q: RouteQueue) -> int:
    sec, usec = q.r.time()
    return int(sec) * 1000 + int(usec) // 1000


def test_respread_walks_each_shard_in_bounded_batches(redis_client, redis_prefix, monkeypatch):
    q = _queue(redis_client, redis_prefix, 3600, shards=1)
    items = _items(3000)
    q.schedule(items)  # one large shard (a skiplist: ZSCAN honours COUNT)
    for h, _ in items[1000:1005]:
        q.enqueue_in(h, 0)
    held = q.pop(6, lease_ms=600_000)
    assert len(held) == 6
    seen = []
    real = RouteQueue.respread_batch

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        seen.append(out["placed"] - kw["placed"])
        return out

    monkeypatch.setattr(RouteQueue, "respread_batch", spy)
    t0 = _now_ms(q)
    res = q.respread(interval_ms=10_000, batch=200)
    assert res == {"moved": 2994, "leased": 6, "missing": 0}
    assert len(seen) > 5 and max(seen) <= 600  # never the whole shard in one call
    offs = _offsets(q, t0)
    assert len(offs) == 2994 and min(offs) >= 0 and max(offs) < 10_000 + 5_000
    assert len(set(int(o) // 100 for o in offs)) > 90  # spread over the interval, not bunched
    for le in held:
        assert q.score(le.member) == le.lease_score


def test_a_stale_run_token_moves_nothing(redis_client, redis_prefix):
    q = _queue(redis_client, redis_prefix, 60)
    q.schedule(_items(50))
    before = {m: s for sh in q.keys.all_shards() for m, s in q.r.zrange(sh, 0, -1, withscores=True)}
    iv.start_run(q, 5_000)
    step = q.respread_batch(0, "0", count=100, placed=0, total=50, interval_ms=5_000,
                            progress_key=iv.interval_key(q), run="not-the-token")
    assert step["superseded"] is True
    after = {m: s for sh in q.keys.all_shards() for m, s in q.r.zrange(sh, 0, -1, withscores=True)}
    assert after == before


def _settings(settings, interval_s: float, **kw):
    return settings.model_copy(update={"check_interval": float(interval_s), "queue_shards": 4, **kw})


def test_the_job_records_then_respreads_once_resumably_with_progress(settings, db, redis_client, redis_prefix):
    s60 = _settings(settings, 60, respread_batch=20)
    q60 = RouteQueue.from_settings(s60, redis_client)
    q60.schedule(_items(600))
    first = run_job("interval_respread", s60, engine=db, redis=redis_client)
    assert first["status"] == "ok" and first["result"]["action"] == "recorded"
    assert iv.read_interval_state(q60)["effective_ms"] == 60_000
    assert run_job("interval_respread", s60, engine=db, redis=redis_client)["result"]["action"] == "none"

    s10 = _settings(settings, 10, respread_batch=20)
    q10 = RouteQueue.from_settings(s10, redis_client)
    part = run_job("interval_respread", s10, engine=db, redis=redis_client, max_batches=3)
    assert part["status"] == "ok", part
    res = part["result"]
    assert res["action"] == "started" and res["complete"] is False and res["batches"] == 3
    run = iv.read_interval_state(q10)["running"]
    assert run["target_ms"] == 10_000 and run["from_ms"] == 60_000 and run["total"] == 600
    assert 0 < run["placed"] < 600 and run["moved"] == run["placed"]

    t0 = _now_ms(q10)
    rest = run_job("interval_respread", s10, engine=db, redis=redis_client)
    assert rest["result"]["action"] == "done" and rest["result"]["complete"] is True
    st = iv.read_interval_state(q10)
    assert st["effective_ms"] == 10_000 and st["converged"] and st["running"] is None and st["respreads"] == 1
    assert st["last"]["moved"] == 600
    offs = _offsets(q10, t0)
    assert len(offs) == 600 and max(offs) < 10_000 + 2_000  # nothing left on the 60 s spread
    assert run_job("interval_respread", s10, engine=db, redis=redis_client)["result"]["action"] == "none"

    fams = {f.name: f for f in iv.interval_families(q10)}
    assert {tuple(sm.labels.values()): sm.value for sm in fams["magpie_check_interval_seconds"].samples} == {
        ("configured",): 10.0, ("effective",): 10.0}
    assert fams["magpie_interval_respread_active"].samples[0].value == 0.0
    assert [sm.value for sm in fams["magpie_interval_respreads"].samples if sm.name.endswith("_total")] == [1.0]


def test_a_new_change_during_a_run_restarts_toward_the_newest_value(settings, db, redis_client, redis_prefix):
    s60 = _settings(settings, 60, respread_batch=20)
    q = RouteQueue.from_settings(s60, redis_client)
    q.schedule(_items(300))
    iv.record_effective(q, 60_000)
    run_job("interval_respread", _settings(settings, 10, respread_batch=20), engine=db, redis=redis_client,
            max_batches=2)
    token = iv._read(q)["run"]
    s30 = _settings(settings, 30, respread_batch=20)
    res = run_job("interval_respread", s30, engine=db, redis=redis_client)["result"]
    assert res["action"] == "done"
    st = iv.read_interval_state(RouteQueue.from_settings(s30, redis_client))
    assert st["effective_ms"] == 30_000 and st["respreads"] == 1 and iv._read(q).get("run") != token
    assert st["last"]["from_ms"] == 60_000 and st["last"]["to_ms"] == 30_000


def test_the_job_can_be_switched_off(settings, db, redis_client, redis_prefix):
    s = _settings(settings, 10, interval_respread=False)
    res = run_job("interval_respread", s, engine=db, redis=redis_client)["result"]
    assert res["action"] == "off" and "MAGPIE_INTERVAL_RESPREAD" in res["reason"]


def test_queue_respread_and_interval_commands(settings, db, redis_client, redis_prefix, monkeypatch):
    from magpie.cli import main
    from magpie.config import get_settings

    q = RouteQueue.from_settings(_settings(settings, 20), redis_client)
    q.schedule(_items(120))
    env = {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": redis_prefix,
           "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
           "MAGPIE_CHECK_INTERVAL": "20", "PROXY_QUEUE_SHARDS": "4"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        res = runner.invoke(main, ["queue", "interval"], catch_exceptions=False)
        assert res.exit_code == 0 and "effective: unknown" in res.output and "converged: no" in res.output
        res = runner.invoke(main, ["queue", "respread", "--json"], catch_exceptions=False)
        out = json.loads(res.output)["result"]
        assert out["moved"] == 120 and out["routes"] == 120 and out["interval_ms"] == 20_000
        res = runner.invoke(main, ["queue", "interval", "--json"], catch_exceptions=False)
        st = json.loads(res.output)["result"]
        assert st["effective_ms"] == 20_000 and st["converged"] is True and st["respreads"] == 1
    finally:
        get_settings.cache_clear()
