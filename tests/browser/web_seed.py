"""Seed a deployment for the dashboard tests: routes in two workspaces, health and history, a dead letter,
chart samples, an open incident, two webhook deliveries, four rotators (serving, error, not running,
unassigned) and live instances of every role.

Everything goes through the product's own paths where one exists (the importer, the schedule's scripts,
the counters, the sampler's reads); history, health and alert rows are inserted as ingestion and the
alert evaluator would leave them.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

SECRET_PASSWORD = "hunter2-Seeded-Secret"
"""The one proxy password of the seed: no page or API answer may contain it."""
WEBHOOK_SECRET_PATH = "T0KEN-in-the-path-9f8e7d"
"""A secret in a webhook URL's path: shown nowhere either."""
ROTATOR_USER = "rot-client-Q7z"
ROTATOR_PASSWORD = "rot-Secret-pa55-x81"
"""The client credentials of the seeded rotator ``front``: shown nowhere (only ``auth yes``)."""
ROTATOR_INSTANCE = "rotator-seedhost-4242-a1b2"
ANONYMITY = ("elite", "anonymous", "transparent")

_HISTORY = """
    INSERT INTO check_history (checked_at, route_id, alive, latency_ms, status, attempts, error, anonymity,
                               body, judge)
    VALUES (:t, :r, :a, :lat, :st, 1, :err, :anon, :body, 'http://127.0.0.1/judge')
"""
_HEALTH = """
    INSERT INTO route_health (route_id, last_checked_at, alive, latency_ms, status, anonymity, error,
                              attempts, checks_total, alive_total, consecutive_failures)
    VALUES (:r, :t, :a, :lat, :st, :anon, :err, 1, 6, 4, :cf)
"""
_RULE = """
    INSERT INTO alert_rules (workspace_id, name, kind, threshold, min_samples)
    VALUES (:w, 'enough usable routes', 'usable_routes', 20, 1) RETURNING id
"""
_INCIDENT = """
    INSERT INTO alert_incidents (rule_id, workspace_id, rule_revision, status, opened_at, open_value)
    VALUES (:r, :w, 1, 'open', now() - interval '12 minutes', 9) RETURNING id
"""
_CHANNEL = """
    INSERT INTO alert_channels (workspace_id, name, kind, target, secret_enc)
    VALUES (:w, 'ops-hook', 'webhook', :t, :s) RETURNING id
"""
_DELIVERY = """
    INSERT INTO alert_deliveries (delivery_id, incident_id, channel_id, event, payload, status, attempts,
                                  max_attempts, last_http_status, last_error, sent_at)
    VALUES (:d, :i, :c, :e, '{}', :s, :a, 4, :h, :err, :sent)
"""


def _result(n: int, k: int) -> dict:
    """Check ``k`` of route number ``n``: alive three times in four, latency growing with both."""
    alive = (n + k) % 4 != 0
    return {"a": alive, "lat": 40.0 + 17 * n + 9 * k if alive else None, "st": 200 if alive else None,
            "err": None if alive else "ConnectTimeout: connect to proxy timed out",
            "anon": ANONYMITY[n % 3] if alive else None}


def _dead_letter_one(settings, redis_client, queue) -> str:
    """Dead-letter the only scheduled route the way the schedule does: leases that started and expired
    (a test clock steps past each lease)."""
    from magpie.queue import QueueKeys, RouteQueue

    now = [queue.server_time_ms() + 1000]
    stalling = RouteQueue(redis_client, QueueKeys(settings.redis_prefix, settings.queue_shards),
                          interval_ms=queue.interval_ms, lease_ms=1000, max_stalled=0, clock=lambda: now[0])
    for _ in range(10):
        got = stalling.pop(1)
        if not got:
            break
        stalling.mark_started(got)
        now[0] += 1001
    dead = [d["member"] for d in queue.dead_letters()]
    assert len(dead) == 1, dead
    return dead[0]


def _samples(settings, redis_client, queue) -> None:
    """Chart history: check batches recorded as check workers record them, each followed by a sample
    taken as the sampler takes it (dated 10 s apart, ending now)."""
    from magpie.base.counters import record_check_batch
    from magpie.observability.samples import ring_key, take_sample

    base = queue.server_time_ms() - 40 * 10_000
    for i in range(40):
        done = 40 + 25 * (i % 7) + 3 * i
        lateness = [300.0] * (done // 2) + [800.0 + 50 * (i % 4)] * (done - done // 2)
        outcomes = {"alive": done - i % 3, "dead": i % 3}
        record_check_batch(redis_client, settings.redis_prefix, outcomes, 0, lateness)
        sample = take_sample(redis_client, settings.redis_prefix, queue)
        sample.update(t_ms=base + i * 10_000, leased=i % 4, due_now=(i * 3) % 9,
                      oldest_lateness_s=round(0.3 * (i % 6), 2))
        redis_client.lpush(ring_key(settings.redis_prefix), json.dumps(sample))


def _alerts(settings, conn) -> None:
    from magpie.base.crypto import get_keyring

    ws = conn.execute(sa.text("SELECT id FROM workspaces WHERE name = 'acme'")).scalar_one()
    rule = conn.execute(sa.text(_RULE), {"w": ws}).scalar_one()
    inc = conn.execute(sa.text(_INCIDENT), {"r": rule, "w": ws}).scalar_one()
    target = f"http://127.0.0.1:9/hooks/{WEBHOOK_SECRET_PATH}"
    secret = get_keyring(settings.encryption_key).encrypt("hmac-secret-value")
    chan = conn.execute(sa.text(_CHANNEL), {"w": ws, "t": target, "s": secret}).scalar_one()
    sent_at = datetime.now(UTC)
    for event, status, http, err in (("incident.opened", "sent", 200, None),
                                     ("incident.recovered", "failed", 502, f"HTTP 502 from {target}")):
        conn.execute(sa.text(_DELIVERY), {
            "d": str(uuid.uuid4()), "i": inc, "c": chan, "e": event, "s": status,
            "a": 1 if status == "sent" else 4, "h": http, "err": err,
            "sent": sent_at if status == "sent" else None})


def _fleet(settings, engine, redis_client) -> dict[str, int]:
    """Rotators added as ``magpie rotators add`` adds them, assigned as the assigner writes it, their
    listener state published as a rotator process publishes it; instance records refreshed by
    :class:`magpie.coordination.instances.Heartbeat` (a TTL of an hour, so they outlive a browser test)."""
    from magpie.base.crypto import get_keyring
    from magpie.coordination.instances import Heartbeat
    from magpie.rotator.process import state_key
    from magpie.rotator.service import add_rotator

    keyring = get_keyring(settings.encryption_key)
    ports = "20000-20100"
    ids = {}
    front = {"port": 20000, "username": ROTATOR_USER, "password": ROTATOR_PASSWORD,
             "filters": {"protocols": "http,socks5", "anonymity": "elite"}}
    sticky = {"port": 20001, "listen": "socks5", "policy": "sticky", "sticky_seconds": 300,
              "filters": {"max_latency_ms": 400}}
    for name, ws, kw in (("front", "acme", front), ("sticky-beta", "beta", sticky),
                         ("stale", "acme", {"port": 20002, "listen": "http"}), ("spare", "beta", {"port": 20003})):
        ids[name] = add_rotator(engine, keyring, name=name, workspace=ws, ports=ports, **kw)["id"]
    with engine.begin() as conn:
        for name, inst in (("front", ROTATOR_INSTANCE), ("sticky-beta", ROTATOR_INSTANCE),
                           ("stale", "rotator-gonehost-1-dead")):
            conn.execute(sa.text("UPDATE rotators SET instance_id = :i, assigned_at = now(),"
                                 " revision = revision + 1 WHERE id = :r"), {"i": inst, "r": ids[name]})
    states = {
        ids["front"]: {"instance": ROTATOR_INSTANCE, "state": "serving", "pool": 7, "port": 20000,
                       "connections": 1234, "active": 3, "refused": 2, "no_route": 0, "upstream_failures": 17,
                       "bytes_up": 5_242_880, "bytes_down": 987_654_321, "revision": 2},
        ids["sticky-beta"]: {"instance": ROTATOR_INSTANCE, "state": "error",
                             "error": "cannot listen on 127.0.0.1:20001: Address already in use"},
    }
    for rid, st in states.items():
        redis_client.set(state_key(settings.redis_prefix, rid), json.dumps(st), ex=3600)
    beats = [
        Heartbeat("worker", redis_client, settings.redis_prefix, interval=3600, ttl=3600,
                  instance_id="worker-seedhost-101-c0de", fields={"queues": ["checks"], "node": "w1@seedhost"},
                  dynamic={"checks": lambda: {"in_flight": 37, "slots": 64, "processes": 2}}),
        Heartbeat("worker", redis_client, settings.redis_prefix, interval=3600, ttl=3600,
                  instance_id="worker-seedhost-102-beef", fields={"queues": ["ingest", "maintenance"]},
                  dynamic={"checks": lambda: {"in_flight": 0, "slots": 0, "processes": 0}}),
        Heartbeat("beat", redis_client, settings.redis_prefix, interval=3600, ttl=3600,
                  instance_id="beat-seedhost-103-f00d",
                  dynamic={"schedule": lambda: {"entries": 9, "bootstrapped": True, "last_tick_age_s": 1.5}}),
        Heartbeat("rotator", redis_client, settings.redis_prefix, interval=3600, ttl=3600,
                  instance_id=ROTATOR_INSTANCE, dynamic={"rotators": lambda: ["front"], "connections": lambda: 3}),
    ]
    for hb in beats:
        hb.beat_once()
    return ids


def seed(settings, engine, redis_client) -> dict:
    """Fill ``settings``' Redis prefix and database. Returns ``{"dead": hash, "routes": [hashes],
    "with_password": hash, "alive": hash, "rotators": {name: id}}``."""
    from magpie.importer.service import import_file
    from magpie.queue import RouteQueue

    queue = RouteQueue.from_settings(settings, redis_client)
    lines = [f"http://127.0.0.{i}:{3100 + i}" for i in range(1, 9)]
    lines += [f"socks5://127.0.1.{i}:{1080 + i}" for i in range(1, 5)]
    lines.append(f"http://operator:{SECRET_PASSWORD}@127.0.2.1:8888")
    with tempfile.TemporaryDirectory(prefix="magpie-web-seed-") as tmp:
        lists = {name: Path(tmp) / f"{name}.txt" for name in ("victim", "acme", "beta")}
        lists["victim"].write_text("socks5://127.0.0.9:1090\n")
        lists["acme"].write_text("\n".join(lines) + "\n")
        lists["beta"].write_text("\n".join(lines[8:]) + "\n")
        import_file(str(lists["victim"]), "acme", settings, queue=queue, engine=engine)
        dead = _dead_letter_one(settings, redis_client, queue)
        import_file(str(lists["acme"]), "acme", settings, queue=queue, engine=engine)
        import_file(str(lists["beta"]), "beta", settings, queue=queue, engine=engine)

    t0 = datetime.now(UTC) - timedelta(minutes=30)
    with engine.begin() as conn:
        rows = conn.execute(sa.text("SELECT id, route_hash, host FROM routes ORDER BY id")).all()
        for n, (rid, _h, host) in enumerate(rows):
            if host == "127.0.0.9":
                continue  # the dead letter was never checked
            for k in range(6):
                at = t0 + timedelta(minutes=5 * k, seconds=n)
                conn.execute(sa.text(_HISTORY), dict(_result(n, k), r=rid, t=at,
                                                     body=f"Proxy-Authorization: Basic {SECRET_PASSWORD}"))
            last = _result(n, 5)
            conn.execute(sa.text(_HEALTH), dict(last, r=rid, t=t0 + timedelta(minutes=25, seconds=n),
                                                cf=0 if last["a"] else 1))
        _alerts(settings, conn)
    _samples(settings, redis_client, queue)
    rotators = _fleet(settings, engine, redis_client)
    by_host = {host: h.strip() for _rid, h, host in rows}
    return {"dead": dead, "routes": sorted(by_host.values()), "with_password": by_host["127.0.2.1"],
            "alive": by_host["127.0.0.2"], "rotators": rotators}
