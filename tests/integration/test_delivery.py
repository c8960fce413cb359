"""Webhook delivery against real PostgreSQL and a real HTTP receiver on 127.0.0.1 (free port).

The receiver records every request per ``X-Magpie-Delivery-ID``, checks the HMAC signature with the
channel's secret (the channel name is the URL path) and can misbehave on demand: answer 500, stall, or
accept the body and then drop the connection without replying.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import sqlalchemy as sa

from magpie.alerts import create_rule, create_webhook_channel, evaluate_all, set_channel_enabled
from magpie.alerts import webhook
from magpie.alerts.delivery import (
    claim_deliveries,
    deliver_one,
    record_delivery,
    retry_delivery,
    run_delivery_workers,
)
from magpie.alerts.webhook import WebhookRefused, check_target

T0 = datetime(2025, 3, 1, 12, 0, 30, tzinfo=UTC)
T_OPEN = T0 + timedelta(minutes=1)  # evaluation opens the incident at the second breached minute
LATER = timedelta(seconds=700)  # beyond the default retry cap (600 s): every retry is due


class Receiver:
    """Threaded HTTP receiver. ``behaviour(delivery_id, n)`` -> ``ok`` | ``500`` | ``crash`` | ``stall``,
    where ``n`` counts that id's requests from 1."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[str, list[dict]] = defaultdict(list)
        self.inflight: Counter = Counter()
        self.max_inflight: Counter = Counter()
        self.secrets: dict[str, str] = {}
        self.behaviour = lambda did, n: "ok"
        self.delay = 0.0
        recv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                did = self.headers.get(webhook.DELIVERY_ID_HEADER)
                channel = self.path.rsplit("/", 1)[-1]
                with recv.lock:
                    recv.inflight[did] += 1
                    recv.max_inflight[did] = max(recv.max_inflight[did], recv.inflight[did])
                    n = len(recv.requests[did]) + 1
                    recv.requests[did].append({
                        "body": body, "attempt": self.headers.get("X-Magpie-Attempt"),
                        "event": self.headers.get("X-Magpie-Event"),
                        "signed": webhook.verify(recv.secrets.get(channel, ""), body,
                                                 self.headers.get(webhook.SIGNATURE_HEADER)),
                    })
                try:
                    if recv.delay:
                        time.sleep(recv.delay)  # the behaviour: a slow receiver
                    what = recv.behaviour(did, n)
                    if what == "crash":  # accepted the body, then died without a reply
                        self.connection.shutdown(socket.SHUT_RDWR)
                        self.close_connection = True
                        return
                    if what == "stall":
                        time.sleep(1.0)  # the behaviour: a receiver that answers after the timeout
                    code = 500 if what == "500" else 204
                    self.send_response(code)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                finally:
                    with recv.lock:
                        recv.inflight[did] -= 1

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # the default listen backlog (5) resets bursts of 20 parallel senders
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, channel: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook/{channel}"

    def total(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.requests.values())

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture
def hook_settings(settings):
    return settings.model_copy(update={"webhook_allow_private": True})


def open_incident(db, settings, receiver: Receiver, channels: int = 1) -> int:
    """Workspace with one dead route, ``channels`` webhook channels to ``receiver``, and an incident opened
    by real evaluation (so one delivery per channel). Returns the incident id."""
    with db.begin() as c:
        ws = c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('acme') RETURNING id")).scalar_one()
        rid = c.execute(sa.text("INSERT INTO routes (route_hash, protocol, host, port) "
                                "VALUES (:h, 'http', '10.0.0.1', 8080) RETURNING id"),
                        {"h": uuid.uuid4().hex[:24]}).scalar_one()
        c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) VALUES (:r, :w)"),
                  {"r": rid, "w": ws})
        c.execute(sa.text("INSERT INTO route_health (route_id, last_checked_at, alive) VALUES (:r, :t, false)"),
                  {"r": rid, "t": T0 - timedelta(seconds=5)})
    for i in range(channels):
        ch = create_webhook_channel(db, settings, ws, f"ch{i}", receiver.url(f"ch{i}"))
        receiver.secrets[f"ch{i}"] = ch.secret
    create_rule(db, ws, "no usable routes", "usable_routes", 1)
    evaluate_all(db, settings, now=T0)
    rep = evaluate_all(db, settings, now=T_OPEN)
    assert [t.deliveries for t in rep.transitions] == [channels]
    return rep.transitions[0].incident_id


def rows(db) -> list[dict]:
    with db.connect() as c:
        return [dict(r) for r in c.execute(sa.text(
            "SELECT id, delivery_id::text AS delivery_id, status, attempts, last_error, last_http_status "
            "FROM alert_deliveries ORDER BY id")).mappings()]


# ------------------------------------------------------------------------------------------ sending


def test_delivery_posts_signed_json_with_stable_delivery_id(db, hook_settings, receiver):
    inc = open_incident(db, hook_settings, receiver)
    assert run_delivery_workers(db, hook_settings, 2, now=T_OPEN) == Counter(sent=1)
    [row] = rows(db)
    assert (row["status"], row["attempts"], row["last_http_status"]) == ("sent", 1, 204)
    [req] = receiver.requests[row["delivery_id"]]
    payload = json.loads(req["body"])
    assert req["signed"] and req["event"] == "incident.opened" and req["attempt"] == "1"
    assert payload["delivery_id"] == row["delivery_id"] and payload["incident"]["id"] == inc
    assert payload["rule"]["description"] == "usable routes < 1" and payload["measurement"]["value"] == 0.0
    assert run_delivery_workers(db, hook_settings, 2, now=T_OPEN + LATER) == Counter()  # nothing more to send


def test_two_instances_never_send_the_same_row_at_once(db, hook_settings, receiver):
    n = 40
    open_incident(db, hook_settings, receiver, channels=n)
    receiver.delay = 0.02
    engines = [sa.create_engine(db.url), sa.create_engine(db.url)]  # two instances, separate connections
    results: list[Counter] = []
    try:
        threads = [threading.Thread(target=lambda e=e: results.append(run_delivery_workers(e, hook_settings, 10,
                                                                                           now=T_OPEN)))
                   for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for e in engines:
            e.dispose()
    assert sum(results, Counter()) == Counter(sent=n), [r["last_error"] for r in rows(db) if r["last_error"]]
    assert all(r["sent"] > 0 for r in results), results  # both instances took part
    got = rows(db)
    assert len(got) == n and {r["status"] for r in got} == {"sent"} and {r["attempts"] for r in got} == {1}
    assert {did: len(reqs) for did, reqs in receiver.requests.items()} == {r["delivery_id"]: 1 for r in got}
    assert set(receiver.max_inflight.values()) == {1}
    assert all(req["signed"] for reqs in receiver.requests.values() for req in reqs)


def test_stale_worker_cannot_record_after_its_claim_expired_and_was_reclaimed(db, hook_settings, receiver):
    open_incident(db, hook_settings, receiver)
    posted, release = threading.Event(), threading.Event()

    def slow_poster(*a, **kw):  # worker A posts, then hangs past its claim expiry
        res = webhook.post(*a, **kw)
        posted.set()
        release.wait(10)
        return res

    out_a: list = []
    a = threading.Thread(target=lambda: out_a.append(deliver_one(db, hook_settings, now=T_OPEN, poster=slow_poster)))
    a.start()
    assert posted.wait(10)
    expired = T_OPEN + timedelta(seconds=hook_settings.delivery_claim_seconds + 1)
    assert deliver_one(db, hook_settings, now=expired) == "sent"  # worker B re-claims and delivers
    release.set()
    a.join(10)
    assert out_a == ["stale"]
    [row] = rows(db)
    assert (row["status"], row["attempts"], row["last_error"]) == ("sent", 2, None)
    assert [r["attempt"] for r in receiver.requests[row["delivery_id"]]] == ["1", "2"]

    # the same fencing at the API level: an old token records nothing, in either direction
    with db.begin() as c:
        c.execute(sa.text("UPDATE alert_deliveries SET status = 'pending', sent_at = NULL"))
    [c1] = claim_deliveries(db, hook_settings, now=T_OPEN)
    [c2] = claim_deliveries(db, hook_settings, now=expired)
    assert c1.id == c2.id and c1.token != c2.token
    assert record_delivery(db, c1, ok=False, error="late failure", retry_delay_s=5, now=expired) is None
    assert record_delivery(db, c1, ok=True, now=expired) is None
    assert rows(db)[0]["status"] == "processing"
    assert record_delivery(db, c2, ok=True, now=expired) == "sent"


def test_receiver_that_accepts_then_crashes_gets_a_duplicate_with_the_same_id(db, hook_settings, receiver):
    open_incident(db, hook_settings, receiver)
    receiver.behaviour = lambda did, n: "crash" if n == 1 else "ok"
    assert run_delivery_workers(db, hook_settings, 1, now=T_OPEN) == Counter(retry=1)
    [row] = rows(db)
    assert row["status"] == "pending" and row["last_error"]
    assert run_delivery_workers(db, hook_settings, 1, now=T_OPEN) == Counter()  # retry is not due yet
    assert run_delivery_workers(db, hook_settings, 1, now=T_OPEN + LATER) == Counter(sent=1)
    [row] = rows(db)
    assert (row["status"], row["attempts"]) == ("sent", 2)
    reqs = receiver.requests[row["delivery_id"]]
    assert len(reqs) == 2 and reqs[0]["body"] == reqs[1]["body"]  # a duplicate: dedupe by the delivery id
    assert list(receiver.requests) == [row["delivery_id"]]


def test_four_attempts_on_the_backoff_curve_then_failed_with_last_error(db, hook_settings, receiver):
    open_incident(db, hook_settings, receiver)
    receiver.behaviour = lambda did, n: "500"
    outcomes = []
    now = T_OPEN
    for _ in range(5):
        outcomes.append(dict(run_delivery_workers(db, hook_settings, 3, now=now)))
        with db.connect() as c:
            nxt = c.execute(sa.text("SELECT next_attempt_at FROM alert_deliveries")).scalar_one()
        if len(outcomes) < 4:  # next retry lies on the curve: within [base/2, base*2^(k-1)] seconds
            k = len(outcomes)
            assert hook_settings.webhook_backoff_base / 2 <= (nxt - now).total_seconds() <= \
                hook_settings.webhook_backoff_base * 2 ** (k - 1)
        now += LATER
    assert outcomes == [{"retry": 1}, {"retry": 1}, {"retry": 1}, {"failed": 1}, {}]
    [row] = rows(db)
    assert (row["status"], row["attempts"], row["last_error"]) == ("failed", 4, "HTTP 500")
    assert row["last_http_status"] == 500
    assert len(receiver.requests[row["delivery_id"]]) == 4

    receiver.behaviour = lambda did, n: "ok"  # operator retries the failed row: same delivery id
    assert retry_delivery(db, row["id"], now=now)
    assert run_delivery_workers(db, hook_settings, 1, now=now) == Counter(sent=1)
    assert len(receiver.requests[row["delivery_id"]]) == 5


def test_timeout_counts_as_a_failed_attempt(db, hook_settings, receiver):
    open_incident(db, hook_settings, receiver)
    receiver.behaviour = lambda did, n: "stall"
    fast = hook_settings.model_copy(update={"webhook_timeout": 0.3})
    started = time.monotonic()
    assert run_delivery_workers(db, fast, 1, now=T_OPEN) == Counter(retry=1)
    assert time.monotonic() - started < 1.0
    assert "timed out" in rows(db)[0]["last_error"].lower()


def test_expired_claim_on_the_final_attempt_becomes_failed(db, hook_settings, receiver):
    one = hook_settings.model_copy(update={"webhook_max_attempts": 1})
    open_incident(db, one, receiver)
    assert len(claim_deliveries(db, one, now=T_OPEN)) == 1  # the worker dies holding it
    later = T_OPEN + timedelta(seconds=one.delivery_claim_seconds + 1)
    assert deliver_one(db, one, now=later) is None
    [row] = rows(db)
    assert row["status"] == "failed" and "final attempt" in row["last_error"]
    assert receiver.total() == 0


# ------------------------------------------------------------------------------------------ targets


def test_private_targets_are_refused_at_creation(db, settings):
    with db.begin() as c:
        c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('acme')"))
    for url in ("http://127.0.0.1:9/hook", "http://10.1.2.3/", "http://169.254.169.254/latest", "http://[::1]/",
                "http://[fe80::1]/", "http://[::ffff:192.168.1.1]/", "http://100.64.0.1/", "http://localhost:9/",
                "http://[2002:a9fe:a9fe::1]/", "http://[64:ff9b::a00:1]/", "http://[fd00::1]/"):
        with pytest.raises(WebhookRefused):
            create_webhook_channel(db, settings, "acme", "hook", url)
    for url in ("ftp://example.test/", "http://user:pw@93.184.216.34/", "http:///nohost"):
        with pytest.raises(WebhookRefused):
            create_webhook_channel(db, settings, "acme", "hook", url)
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM alert_channels")).scalar_one() == 0


def test_every_resolved_address_is_checked(monkeypatch):
    monkeypatch.delenv("MAGPIE_EGRESS_ONLY")  # the private-range rules alone; nothing is dialled here

    def resolver(*addrs):
        return lambda host, port, **kw: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addrs]

    t = check_target("https://hooks.example.test/x?y=1", allow_private=False, resolve=resolver("93.184.216.34"))
    assert (t.addresses, t.port, t.path, t.host_header) == (("93.184.216.34",), 443, "/x?y=1", "hooks.example.test")
    with pytest.raises(WebhookRefused, match="10.0.0.7"):
        check_target("https://hooks.example.test/", allow_private=False,
                     resolve=resolver("93.184.216.34", "10.0.0.7"))
    assert check_target("http://hooks.example.test:8080/", allow_private=True,
                        resolve=resolver("10.0.0.7")).host_header == "hooks.example.test:8080"
    with pytest.raises(WebhookRefused):  # unspecified and multicast are never allowed
        check_target("http://0.0.0.0/", allow_private=True)


def test_target_refused_again_at_send_time(db, hook_settings, receiver):
    open_incident(db, hook_settings, receiver)  # created while private targets were allowed
    strict = hook_settings.model_copy(update={"webhook_allow_private": False})
    assert run_delivery_workers(db, strict, 1, now=T_OPEN) == Counter(failed=1)
    [row] = rows(db)
    assert row["status"] == "failed" and row["last_error"].startswith("target refused") and row["attempts"] == 1
    assert receiver.total() == 0


def test_disabled_channel_fails_its_queued_delivery(db, hook_settings, receiver):
    open_incident(db, hook_settings, receiver)
    with db.connect() as c:
        cid = c.execute(sa.text("SELECT id FROM alert_channels")).scalar_one()
    set_channel_enabled(db, cid, False)
    assert run_delivery_workers(db, hook_settings, 1, now=T_OPEN) == Counter(failed=1)
    assert rows(db)[0]["last_error"] == "channel disabled" and receiver.total() == 0
