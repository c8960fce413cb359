"""Exporter figures an operator alerts and graphs on: zero-initialised label sets, alive routes by
protocol/anonymity/workspace, the check-latency histogram filled by real ingestion, deliveries; and the
shipped Prometheus rules and Grafana dashboard use only what the exporter really exports (scraped over
HTTP against real Redis and PostgreSQL)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from helpers import append_entries
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from magpie.config import Settings
from magpie.base.counters import CHECK_OUTCOMES, LATENCY_BUCKETS, read_counters, record_check_latency
from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.maintenance.beat import cadences
from magpie.wiring.jobs import JOBS
from magpie.observability.metrics import serve
from magpie.base.routes import Route
from magpie.stats import encode_result, ensure_group
from magpie.stats.drain import ingest_backlog

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "magpie.json"
KEY = "test-key-0123456789abcdef"


def _scrape(url: str) -> tuple[dict[tuple[str, tuple], float], dict[str, set[str]]]:
    """``(samples, labels)``: sample (name, sorted labels) -> value, and sample name -> label names."""
    resp = requests.get(url, timeout=10)
    assert resp.status_code == 200, resp.text
    samples, labels = {}, {}
    for fam in text_string_to_metric_families(resp.text):
        for smp in fam.samples:
            samples[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
            labels.setdefault(smp.name, set()).update(smp.labels)
    return samples, labels


@pytest.fixture
def exporter(settings, pg_url):
    tuned = settings.model_copy(update={"metrics_route_cache": 0.0})
    server, thread = serve(tuned, "127.0.0.1", 0, jobs=JOBS.values())
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()
    thread.join(5)


def _store_checked_routes(settings, db, redis_client, redis_prefix) -> None:
    """Routes in two workspaces, checked once each and ingested by the real consumer."""
    ring = get_keyring(KEY)
    acme = upsert_routes(db, ring, "acme", [Route("http", "10.9.1.1", 8000 + i) for i in range(3)]).routes
    beta = upsert_routes(db, ring, "beta", [Route("socks5", "10.9.2.1", 9000 + i) for i in range(2)]).routes
    shared = upsert_routes(db, ring, "beta", [Route("http", "10.9.1.1", 8000)]).routes  # also in acme
    assert shared[0].route_id == acme[0].route_id
    now = int(time.time() * 1000)
    results = [
        encode_result(route_id=acme[0].route_id, route_hash=acme[0].route_hash, alive=True, checked_at_ms=now,
                      latency_ms=80.0, anonymity="elite"),
        encode_result(route_id=acme[1].route_id, route_hash=acme[1].route_hash, alive=True, checked_at_ms=now,
                      latency_ms=1500.0, anonymity="transparent"),
        encode_result(route_id=acme[2].route_id, route_hash=acme[2].route_hash, alive=False,
                      checked_at_ms=now, error="ConnectTimeout"),
        encode_result(route_id=beta[0].route_id, route_hash=beta[0].route_hash, alive=True, checked_at_ms=now,
                      latency_ms=45_000.0, anonymity="elite"),
        encode_result(route_id=beta[1].route_id, route_hash=beta[1].route_hash, alive=True, checked_at_ms=now,
                      latency_ms=300.0),
    ]
    ensure_group(redis_client, redis_prefix)
    append_entries(redis_client, redis_prefix, results)
    assert ingest_backlog(redis_client, db, settings) == 5


def test_known_label_sets_are_exported_at_zero_before_anything_happened(settings, db, redis_client, exporter):
    m, _ = _scrape(exporter)
    for outcome in CHECK_OUTCOMES:
        assert m[("magpie_checks_total", (("outcome", outcome),))] == 0
    for policy in ("block", "drop_new", "evict_oldest"):
        assert m[("magpie_statistics_dropped_total", (("policy", policy),))] == 0
    every = cadences(settings, JOBS.values())
    for job in JOBS:
        lab = (("maintenance_job", job),)
        assert m[("magpie_maintenance_last_success_timestamp_seconds", lab)] == 0
        assert m[("magpie_maintenance_last_start_timestamp_seconds", lab)] == 0
        assert m[("magpie_maintenance_runs_total", lab)] == 0
        assert m[("magpie_maintenance_failures_total", lab)] == 0
        assert m[("magpie_maintenance_cadence_seconds", lab)] == every[job]
    assert m[("magpie_check_latency_seconds_count", ())] == 0
    assert m[("magpie_check_latency_seconds_bucket", (("le", "+Inf"),))] == 0
    for channel in ("webhook", "email"):
        for status in ("pending", "processing", "sent", "failed"):
            assert m[("magpie_deliveries", (("channel", channel), ("status", status)))] == 0
    assert m[("magpie_routes_alive_series_dropped", ())] == 0
    assert not any(n == "magpie_routes_alive" for n, _ in m)  # no route checked yet: no label set


def test_alive_routes_and_latency_come_from_stored_results(settings, db, redis_client, redis_prefix,
                                                           exporter):
    _store_checked_routes(settings, db, redis_client, redis_prefix)
    m, _ = _scrape(exporter)

    def alive(protocol, anonymity, workspace):
        return m.get(("magpie_routes_alive",
                      (("anonymity", anonymity), ("protocol", protocol), ("workspace", workspace))))

    # one route in two workspaces counts in both
    assert alive("http", "elite", "acme") == 1 and alive("http", "elite", "beta") == 1
    assert alive("http", "transparent", "acme") == 1
    assert alive("socks5", "elite", "beta") == 1 and alive("socks5", "unknown", "beta") == 1
    # the dead route is not counted
    assert sum(v for (n, _), v in m.items() if n == "magpie_routes_alive") == 5

    # four alive results with a latency; the dead one has none
    assert m[("magpie_check_latency_seconds_count", ())] == 4
    assert m[("magpie_check_latency_seconds_sum", ())] == pytest.approx((80 + 1500 + 45_000 + 300) / 1000)
    assert m[("magpie_check_latency_seconds_bucket", (("le", "0.1"),))] == 1
    assert m[("magpie_check_latency_seconds_bucket", (("le", "0.5"),))] == 2
    assert m[("magpie_check_latency_seconds_bucket", (("le", "2.0"),))] == 3
    assert m[("magpie_check_latency_seconds_bucket", (("le", "30.0"),))] == 3
    assert m[("magpie_check_latency_seconds_bucket", (("le", "60.0"),))] == 4

    # a second run finds nothing new and counts nothing more
    assert ingest_backlog(redis_client, db, settings) == 0
    assert read_counters(redis_client, redis_prefix)["latency"]["count"] == 4


def test_alive_route_label_sets_are_bounded(settings, db, redis_client, redis_prefix):
    _store_checked_routes(settings, db, redis_client, redis_prefix)
    tuned = settings.model_copy(update={"metrics_route_series": 2, "metrics_route_cache": 60.0})
    server, thread = serve(tuned, "127.0.0.1", 0, jobs=JOBS.values())
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        m, _ = _scrape(url)
        series = [k for k in m if k[0] == "magpie_routes_alive"]
        assert len(series) == 2 and m[("magpie_routes_alive_series_dropped", ())] == 1
        with db.begin() as c:  # the cache answers the next scrape: no second whole-table query
            c.exec_driver_sql("UPDATE route_health SET alive = false")
        m2, _ = _scrape(url)
        assert [k for k in m2 if k[0] == "magpie_routes_alive"] == series
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_record_check_latency_buckets_and_skips_missing_values(redis_client, redis_prefix):
    assert record_check_latency(redis_client, redis_prefix, [None, None])
    assert read_counters(redis_client, redis_prefix)["latency"]["count"] == 0
    assert record_check_latency(redis_client, redis_prefix, [10.0, None, 99_999_999.0, -3.0])
    lat = read_counters(redis_client, redis_prefix)["latency"]
    buckets = dict(lat["buckets"])
    assert lat["count"] == 3 and buckets[0.05] == 2 and buckets[LATENCY_BUCKETS[-1]] == 2
    assert buckets[float("inf")] == 3


# ------------------------------------------------------------------ rules and dashboard against the export

_NAME = re.compile(r"(?<![\w:])(magpie[_:][A-Za-z0-9_:]*)")
_MATCHER = re.compile(r"(magpie_[A-Za-z0-9_]*)\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def _rule_exprs() -> tuple[list[str], set[str]]:
    doc = yaml.safe_load(RULES.read_text())
    exprs, recorded = [], set()
    for group in doc["groups"]:
        for rule in group["rules"]:
            exprs.append(rule["expr"])
            if "record" in rule:
                recorded.add(rule["record"])
            else:
                assert rule["alert"].startswith("Magpie") and rule["annotations"]["summary"]
    return exprs, recorded


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return exprs


def _check_against_export(exprs: list[str], exported: dict[str, set[str]], recorded: set[str]) -> None:
    all_labels = set().union(*exported.values()) | {"le"}
    for expr in exprs:
        names = _NAME.findall(expr)
        assert names, f"no magpie metric in {expr!r}"
        for name in names:
            if ":" in name:
                assert name in recorded, f"{name} is not a recording rule ({expr!r})"
            else:
                assert name in exported, f"{name} is not exported ({expr!r})"
        for name, matchers in _MATCHER.findall(expr):
            for m in filter(None, (x.strip() for x in matchers.split(","))):
                label = re.split(r"=~|!=|!~|=", m)[0].strip()
                assert label in exported[name], f"{name} has no label {label!r} ({expr!r})"
        for group in _GROUPING.findall(expr):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in all_labels, f"label {label!r} is exported by no metric ({expr!r})"


@pytest.fixture
def full_export(settings, db, redis_client, redis_prefix, exporter):
    """A scrape of a deployment that has done a bit of everything (so every family has samples)."""
    from magpie.wiring.jobs import run_job

    _store_checked_routes(settings, db, redis_client, redis_prefix)
    assert run_job("token_expiry", settings, engine=db, redis=redis_client)["status"] == "ok"
    from magpie.db.keycheck import verify_key

    verify_key(db, KEY)  # records the deployment's key fingerprint (its first start)
    from magpie.queue import RouteQueue

    RouteQueue.from_settings(settings, redis_client)  # a bootstrapped schedule: shards exist
    return _scrape(exporter)


def test_every_rule_uses_exported_metrics_and_labels(full_export):
    samples, exported = full_export
    exprs, recorded = _rule_exprs()
    assert len(recorded) >= 5 and len(exprs) - len(recorded) >= 8
    _check_against_export(exprs, exported, recorded)
    alerts = yaml.safe_load(RULES.read_text())["groups"][1]["rules"]
    text = " ".join(r["expr"] for r in alerts)
    for needed in ("magpie_maintenance_last_success_timestamp_seconds",
                   "magpie_queue_oldest_lateness_seconds", "magpie_statistics_backlog", "magpie_statistics_dead_letters", "magpie_queue_dead_letters",
                   "magpie_checks_total"):
        assert needed in text, f"no alert on {needed}"
    assert ("magpie_deployment_created_timestamp_seconds", ()) in samples
    clash = {name for name, labels in exported.items() if labels & {"instance", "job"}}
    assert not clash, f"labels Prometheus sets on every scrape target: {clash}"


def test_every_dashboard_query_uses_exported_metrics_and_labels(full_export):
    _, exported = full_export
    exprs = _dashboard_exprs()
    assert len(exprs) >= 20
    _check_against_export(exprs, exported, set())
    dash = json.loads(DASHBOARD.read_text())
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for needed in ("scheduled", "leased", "due now", "lateness", "checks/s", "latency", "protocol",
                   "anonymity", "workspace", "backlog", "dead letters", "maintenance", "deliveries"):
        assert needed in titles, f"no panel about {needed}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_the_name_checker_catches_a_wrong_name_or_label(full_export):
    _, exported = full_export
    with pytest.raises(AssertionError, match="not exported"):
        _check_against_export(["rate(magpie_checks_completed_total[5m])"], exported, set())
    with pytest.raises(AssertionError, match="no label 'job'"):
        _check_against_export(['magpie_maintenance_runs_total{job="x"}'], exported, set())
    with pytest.raises(AssertionError, match="not a recording rule"):
        _check_against_export(["magpie:nope > 1"], exported, set())


def test_settings_bounds_of_the_exporter():
    from magpie.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match="MAGPIE_METRICS_ROUTE_SERIES"):
        load_settings(encryption_key=KEY, MAGPIE_METRICS_ROUTE_SERIES=0)
    assert Settings.model_fields["log_format"].default == "text"
