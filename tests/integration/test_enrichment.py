"""Enrichment against real PostgreSQL and Redis: GeoIP databases built here with ``mmdb-writer`` (never
downloaded), a changed file noticed and announced over pub/sub, applied at import and by the
``geo_enrichment`` job (lock, limits, run records, idempotence); the abuse client against a stub server on
loopback (key header, caching, rate limit, 429); bounded caches and their metrics."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
import typing

import pytest
import sqlalchemy as sa
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from helpers import wait_until

from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.enrich.abuse import AbuseError, AbuseIPDBClient, RateLimited, TokenBucket
from magpie.enrich.caches import CacheCollector, TTLCache
from magpie.enrich.geo import GeoDatabases, channel, listen, network_type
from magpie.importer.service import import_file
from magpie.coordination.leader import LeaderLock
from magpie.wiring.jobs import run_job
from magpie.maintenance.runner import read_job_status
from magpie.queue import RouteQueue
from magpie.base.routes import Route

JOB = "geo_enrichment"


def write_country(path, networks: dict[str, str]) -> None:
    w = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoIP2-Country")
    for net, code in networks.items():
        w.insert_network(IPSet([net]), {"country": {"iso_code": code}})
    w.to_db_file(str(path))


def write_asn(path, networks: dict[str, tuple[int, str]]) -> None:
    w = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-ASN")
    for net, (asn, org) in networks.items():
        w.insert_network(IPSet([net]), {"autonomous_system_number": asn, "autonomous_system_organization": org})
    w.to_db_file(str(path))


@pytest.fixture
def geo_files(tmp_path):
    country, asn = tmp_path / "country.mmdb", tmp_path / "asn.mmdb"
    write_country(country, {"127.0.1.0/24": "DE", "127.0.2.0/24": "US", "2001:db8::/32": "FR"})
    write_asn(asn, {"127.0.1.0/24": (64500, "Hetzner Online GmbH"), "127.0.2.0/24": (64501, "Comcast Cable")})
    return country, asn


@pytest.fixture
def s(settings, pg_url, geo_files):
    return settings.model_copy(update={"geoip_country_db": str(geo_files[0]), "geoip_asn_db": str(geo_files[1]),
                                       "enrich_allow_private": "127.0.0.0/8"})


def _enrichment(db) -> dict[str, tuple]:
    with db.connect() as c:
        return {h: (co, a, o, t, rev) for h, co, a, o, t, rev in c.execute(sa.text(
            "SELECT r.host, e.country, e.asn, e.as_org, e.network_type, e.geo_revision FROM route_enrichment e "
            "JOIN routes r ON r.id = e.route_id"))}


@pytest.mark.parametrize(("org", "kind"), [
    ("Hetzner Online GmbH", "datacenter"), ("AMAZON-02", "datacenter"), ("Example Hosting Ltd", "datacenter"),
    ("OVH SAS", "datacenter"), ("Comcast Cable Communications", "residential"), ("Vodafone GmbH", "residential"),
    ("Example Broadband", "residential"), ("Deutsche Telekom AG", "residential"),
    ("Hurricane Electric LLC", "isp"), ("University of Example", "isp"), (None, "unknown"), ("", "unknown"),
])
def test_network_type_rules(org, kind):
    assert network_type(org) == kind


def test_lookup_caches_and_notices_a_changed_file(s, geo_files, redis_client):
    geo = GeoDatabases(s, redis_client)
    other = GeoDatabases(s, redis_client)  # another process: learns of the change by announcement
    other.refresh(force=True)
    stop = threading.Event()
    th = listen(other, redis_client, stop)
    try:
        wait_until(lambda: redis_client.pubsub_numsub(channel(s.redis_prefix))[0][1] >= 1,
                   what="the listener subscribed")
        info = geo.lookup("127.0.1.9")
        assert (info.country, info.asn, info.as_org, info.network_type) == ("DE", 64500, "Hetzner Online GmbH",
                                                                          "datacenter")
        assert geo.lookup("127.0.1.9") is info and geo.cache.stats()["hits"] == 1
        assert geo.lookup("2001:db8::1").country == "FR" and geo.lookup("2001:db8::1").asn is None
        assert geo.lookup("proxy.example.net") is None and geo.lookup("127.0.9.9").country is None
        first = geo.revision
        assert redis_client.get(channel(s.redis_prefix)) == first.encode()
        other.lookup("127.0.1.9")
        assert other._next_look > time.monotonic()  # no look before its interval ...

        write_country(geo_files[0], {"127.0.1.0/24": "NL"})
        os.utime(geo_files[0], ns=(time.time_ns(), time.time_ns() + 10**9))
        assert geo.refresh(force=True) and geo.revision != first
        assert geo.lookup("127.0.1.9").country == "NL"  # the cache was emptied
        wait_until(lambda: other._next_look == 0.0, timeout=5, what="the announcement received")
        assert other._next_look == 0.0  # ... but the announcement makes the next lookup look
        assert other.lookup("127.0.1.9").country == "NL" and other.revision == geo.revision
        os.utime(geo_files[0])  # touched, same contents: same revision, nothing announced
        assert not geo.refresh(force=True)
    finally:
        stop.set()
        th.join(3)


def test_import_enriches_and_the_job_refreshes_older_rows(s, db, redis_client, geo_files, tmp_path):
    q = RouteQueue.from_settings(s, redis_client)
    proxies = tmp_path / "list.txt"
    proxies.write_text("127.0.1.5:80\n127.0.2.5:80\nproxy.example.net:80\n")
    report = import_file(str(proxies), "alpha", s, queue=q, engine=db)
    assert report.imported == 3 and report.enriched == 2
    rows = _enrichment(db)
    assert rows["127.0.1.5"][:4] == ("DE", 64500, "Hetzner Online GmbH", "datacenter")
    assert rows["127.0.2.5"][:4] == ("US", 64501, "Comcast Cable", "residential")
    upsert_routes(db, get_keyring(s.encryption_key), "alpha", [Route("http", f"127.0.2.{i}", 81) for i in range(10, 15)])

    res = run_job(JOB, s, engine=db, redis=redis_client)
    assert res["status"] == "ok" and res["result"]["enriched"] == 5 and res["result"]["complete"]
    again = run_job(JOB, s, engine=db, redis=redis_client)["result"]
    assert again["enriched"] == 0 and not again["revision_changed"]  # idempotent

    write_asn(geo_files[1], {"127.0.2.0/24": (64999, "Example Cloud Hosting")})  # a newer file
    os.utime(geo_files[1], ns=(time.time_ns(), time.time_ns() + 10**9))
    bounded = run_job(JOB, s, engine=db, redis=redis_client, batch_size=2, max_batches=2)["result"]
    assert bounded["revision_changed"] and bounded["enriched"] == 4 and not bounded["complete"]
    rest = run_job(JOB, s, engine=db, redis=redis_client, batch_size=2)["result"]
    assert rest["enriched"] == 3 and rest["complete"]
    rows = _enrichment(db)
    assert len({r[4] for r in rows.values()}) == 1  # every row at the new revision
    assert rows["127.0.2.5"][1:4] == (64999, "Example Cloud Hosting", "datacenter")
    assert rows["127.0.1.5"][1] is None  # no longer in the ASN file


def test_job_lock_failure_and_unconfigured(s, db, redis_client, geo_files, settings, pg_url):
    other = LeaderLock(redis_client, s.redis_prefix, JOB, ttl_ms=5000)
    assert other.acquire()
    assert run_job(JOB, s, engine=db, redis=redis_client)["status"] == "skipped"
    other.release()
    geo_files[0].write_bytes(b"not a database")
    bad = run_job(JOB, s, engine=db, redis=redis_client)
    assert bad["status"] == "error" and "is not a MaxMind-format database" in bad["error"]
    [row] = [r for r in read_job_status(db) if r["job"] == JOB]
    assert row["failures_total"] == 1 and row["runs_total"] == 1
    off = run_job(JOB, settings, engine=db, redis=redis_client)
    assert off["status"] == "ok" and "no GeoIP database" in off["result"]["skipped"]


class _Abuse(http.server.BaseHTTPRequestHandler):
    hits: typing.ClassVar[list] = []
    status = 200

    def do_GET(self):
        type(self).hits.append((self.path, self.headers.get("Key")))
        if self.headers.get("Key") != "test-abuse-key-123":
            self.send_response(401)
            self.end_headers()
            return
        if type(self).status == 429:
            self.send_response(429)
            self.send_header("Retry-After", "30")
            self.end_headers()
            return
        ip = self.path.split("ipAddress=", 1)[1].split("&", 1)[0]
        body = json.dumps({"data": {"ipAddress": ip, "abuseConfidenceScore": 87 if ip.endswith(".5") else 3,
                                    "totalReports": 4}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def abuse_server():
    _Abuse.hits = []
    _Abuse.status = 200
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Abuse)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/api/v2/check"
    srv.shutdown()
    srv.server_close()


def test_abuse_client_key_cache_rate_limit_and_429(s, abuse_server):
    cfg = s.model_copy(update={"abuse_api_url": abuse_server, "abuse_api_key": "test-abuse-key-123",
                               "abuse_rate_per_minute": 2})
    client = AbuseIPDBClient(cfg)
    assert client.score("127.0.1.5").score == 87 and client.score("127.0.1.6").score == 3
    assert client.score("127.0.1.5").reports == 4  # cached: no request
    assert len(_Abuse.hits) == 2 and all(k == "test-abuse-key-123" for _, k in _Abuse.hits)
    assert "maxAgeInDays=90" in _Abuse.hits[0][0]
    with pytest.raises(RateLimited) as info:
        client.score("127.0.1.7")  # the bucket (2 a minute) is empty
    assert 0 < info.value.retry_after <= 30 and len(_Abuse.hits) == 2
    fresh = AbuseIPDBClient(cfg)
    _Abuse.status = 429
    with pytest.raises(RateLimited) as info:
        fresh.score("127.0.1.8")
    assert info.value.retry_after == 30 and fresh.bucket.take() > 25
    wrong = AbuseIPDBClient(cfg.model_copy(update={"abuse_api_key": "wrong-key-000"}))
    with pytest.raises(AbuseError) as err:
        wrong.score("127.0.1.9")
    assert "HTTP 401" in str(err.value) and "wrong-key" not in str(err.value)
    guarded = AbuseIPDBClient(cfg.model_copy(update={"enrich_allow_private": "false"}))
    with pytest.raises(AbuseError, match="refused by the egress guard"):
        guarded.score("127.0.1.9")


def test_job_scores_abuse_until_the_rate_limit(s, db, redis_client, abuse_server):
    cfg = s.model_copy(update={"abuse_api_url": abuse_server, "abuse_api_key": "test-abuse-key-123",
                               "abuse_rate_per_minute": 3, "geoip_country_db": None, "geoip_asn_db": None})
    upsert_routes(db, get_keyring(s.encryption_key), "alpha", [Route("http", f"127.0.1.{i}", 80) for i in range(1, 7)])
    first = run_job(JOB, cfg, engine=db, redis=redis_client)["result"]
    assert first["abuse_scored"] == 3 and first["abuse_rate_limited"] and not first["complete"]
    with db.connect() as c:
        scores = dict(c.execute(sa.text("SELECT r.host, e.abuse_score FROM route_enrichment e "
                                        "JOIN routes r ON r.id = e.route_id")).all())
    assert len(scores) == 3 and set(scores.values()) <= {3, 87}


def test_token_bucket_refills():
    now = [0.0]
    b = TokenBucket(2, 60, clock=lambda: now[0])
    assert b.take() == 0 and b.take() == 0 and b.take() == pytest.approx(30)
    now[0] = 30.0
    assert b.take() == 0


def test_ttl_cache_bounds_and_metrics():
    now = [0.0]
    c = TTLCache("probe", max_size=2, ttl=10, clock=lambda: now[0])
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1
    c.put("c", 3)  # evicts b, the least recently used
    assert c.get("b") is None and len(c) == 2
    now[0] = 11
    assert c.get("a") is None
    st = c.stats()
    assert (st["hits"], st["misses"], st["evictions"], st["expirations"], st["size"]) == (1, 2, 1, 1, 1)
    fams = {f.name: f for f in CacheCollector().collect()}
    [sample] = [x for x in fams["magpie_enrich_cache_hits"].samples if x.labels == {"cache": "probe"}]
    assert sample.value == 1
    assert any(x.labels == {"cache": "probe"} and x.value == 2 for x in fams["magpie_enrich_cache_max_size"].samples)


def test_models_match_migration_0008(pg_url):
    from magpie.db.migrate import schema_diff

    mine = ("route_enrichment", "blacklist_sources", "blacklist_entries", "blacklist_policies", "route_blacklist")
    assert [d for d in schema_diff(pg_url) if any(t in str(d) for t in mine)] == []
