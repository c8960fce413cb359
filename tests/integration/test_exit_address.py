"""The exit address: a lab proxy entered at 127.0.0.2 that connects out from 127.0.0.7 (pproxy's bind after
the path) is recorded with exit 127.0.0.7 apart from its entry, through the check, the results stream,
ingestion (history and current health, with GeoIP country and ASN), the ``geo_enrichment`` job, export and
the rotator's filter. GeoIP databases are built here with ``mmdb-writer``."""

from __future__ import annotations

import socket

import pytest
import sqlalchemy as sa
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from helpers import append_entries

from magpie.checker.check import Checker, LoopThread
from magpie.checker.judge import start_judge
from magpie.base.crypto import get_keyring
from magpie.db.repo import upsert_routes
from magpie.enrich.geo import GeoDatabases
from magpie.admin.export import ExportFilter, stream_export
from magpie.wiring.jobs import run_job
from magpie.base.routes import Route
from magpie.stats.consumer import ingest
from magpie.stats.entry import entry_fields

ENTRY, EXIT = "127.0.0.2", "127.0.0.7"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def exit_lab():
    """A judge on 127.0.0.1 and one pproxy (http and socks5 on one port) on 127.0.0.2 dialling out from
    127.0.0.7; yields ``(judge_url, port)``."""
    import pproxy

    loop = LoopThread("exit-lab")
    servers = []

    async def up():
        judge = await start_judge("127.0.0.1", 0)
        servers.append(judge)
        for _ in range(10):
            port = _free_port(ENTRY)
            try:
                server = await pproxy.Server(f"http+socks5://{ENTRY}:{port}/@{EXIT}").start_server(
                    {"rserver": [], "authtime": -1})
            except OSError:
                continue
            servers.append(server)
            return f"http://127.0.0.1:{judge.sockets[0].getsockname()[1]}/", port
        raise RuntimeError("no free port on 127.0.0.2")

    try:
        yield loop.run(up(), timeout=10)
    finally:
        async def down():
            for s in servers:
                s.close()

        loop.run(down(), timeout=10)
        loop.stop()


def _write_geo(tmp_path) -> tuple[str, str]:
    country, asn = tmp_path / "country.mmdb", tmp_path / "asn.mmdb"
    w = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoIP2-Country")
    w.insert_network(IPSet([f"{EXIT}/32"]), {"country": {"iso_code": "NL"}})
    w.insert_network(IPSet([f"{ENTRY}/32"]), {"country": {"iso_code": "DE"}})
    w.to_db_file(str(country))
    w = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-ASN")
    w.insert_network(IPSet([f"{EXIT}/32"]), {"autonomous_system_number": 64510,
                                             "autonomous_system_organization": "Example Exit Hosting"})
    w.to_db_file(str(asn))
    return str(country), str(asn)


@pytest.fixture
def geo_settings(settings, pg_url, tmp_path):
    country, asn = _write_geo(tmp_path)
    return settings.model_copy(update={"geoip_country_db": country, "geoip_asn_db": asn})


def _check(exit_lab, protocol: str):
    judge_url, port = exit_lab
    checker = Checker(judge_url, timeout=5.0, attempts=1)
    try:
        return checker.check(Route(protocol, ENTRY, port))
    finally:
        checker.close()


@pytest.mark.parametrize("protocol", ["http", "socks5"])
def test_the_judge_sees_the_exit_address_not_the_entry(exit_lab, protocol):
    res = _check(exit_lab, protocol)
    assert res.alive and res.anonymity == "elite", res
    assert res.exit_ip == EXIT
    assert entry_fields(res)["exit_ip"] == EXIT


def test_a_failed_check_has_no_exit_address():
    res = Checker("http://127.0.0.1:9/", timeout=1.0, attempts=1).check(Route("http", ENTRY, _free_port(ENTRY)))
    assert not res.alive and res.exit_ip is None and "exit_ip" not in entry_fields(res)


def _health(db) -> tuple:
    with db.connect() as c:
        return c.execute(sa.text(
            "SELECT r.host, h.exit_ip, h.exit_country, h.exit_asn, h.exit_geo_revision IS NOT NULL, h.alive "
            "FROM route_health h JOIN routes r ON r.id = h.route_id")).one()


def _route_id(db) -> int:
    with db.connect() as c:
        return c.execute(sa.text("SELECT id FROM routes")).scalar()


def test_the_exit_is_recorded_apart_from_the_entry_enriched_exported_and_filtered(
        exit_lab, db, geo_settings, redis_client):
    s = geo_settings
    keyring = get_keyring(s.encryption_key)
    upsert_routes(db, keyring, "ws", [Route("socks5", ENTRY, exit_lab[1])])
    rid = _route_id(db)
    res = _check(exit_lab, "socks5")
    append_entries(redis_client, s.redis_prefix, [entry_fields(res, rid, None)])
    rep = ingest(redis_client, db, s.redis_prefix, "c1", geo=GeoDatabases(s))
    assert rep.committed == 1
    assert _health(db) == (ENTRY, EXIT, "NL", 64510, True, True)  # enriched as it was written
    with db.connect() as c:
        assert c.execute(sa.text("SELECT exit_ip FROM check_history")).scalar() == EXIT

    # a later failed check sees no exit: the last one seen is kept
    dead = _check((exit_lab[0], _free_port(ENTRY)), "socks5")
    dead.checked_at_ms = res.checked_at_ms + 1000
    append_entries(redis_client, s.redis_prefix, [entry_fields(dead, rid, None)])
    assert ingest(redis_client, db, s.redis_prefix, "c1", geo=GeoDatabases(s)).committed == 1
    assert _health(db) == (ENTRY, EXIT, "NL", 64510, True, False)

    def exported(**flt):
        return "".join(stream_export(s, ExportFilter("ws", **flt), "jsonl"))

    assert f'"exit_ip":"{EXIT}"' in exported(exit_country="NL") and f'"host":"{ENTRY}"' in exported()
    assert exported(exit_country="DE") == ""

    from magpie.db.repo import latest_health
    from magpie.web.data import RouteFilter, list_routes

    [row] = latest_health(db, "ws")  # `magpie routes` and the dashboard's route pages show the exit
    assert (row["host"], row["exit_ip"], row["exit_country"]) == (ENTRY, EXIT, "NL")
    [page_row] = list_routes(db, RouteFilter("ws"))["routes"]
    assert (page_row["exit_ip"], page_row["exit_country"]) == (EXIT, "NL")

    from magpie.rotator.pool import load_pool
    from magpie.rotator.service import check_filters

    with db.begin() as c:  # the rotator serves alive routes only
        c.execute(sa.text("UPDATE route_health SET alive = true"))
        wid = c.execute(sa.text("SELECT id FROM workspaces WHERE name = 'ws'")).scalar()
    assert [u.host for u in load_pool(db, keyring, wid, check_filters({"exit_country": "nl"}))] == [ENTRY]
    assert load_pool(db, keyring, wid, check_filters({"exit_country": "de"})) == []


def test_without_geoip_at_ingestion_the_job_enriches_the_exit(exit_lab, db, geo_settings, redis_client):
    s = geo_settings
    upsert_routes(db, get_keyring(s.encryption_key), "ws", [Route("http", ENTRY, exit_lab[1])])
    res = _check(exit_lab, "http")
    append_entries(redis_client, s.redis_prefix, [entry_fields(res, _route_id(db), None)])
    assert ingest(redis_client, db, s.redis_prefix, "c1").committed == 1
    assert _health(db) == (ENTRY, EXIT, None, None, False, True)
    out = run_job("geo_enrichment", s, engine=db, redis=redis_client)
    assert out["status"] == "ok" and out["result"]["exits_enriched"] == 1 and out["result"]["complete"], out
    assert _health(db) == (ENTRY, EXIT, "NL", 64510, True, True)
    assert run_job("geo_enrichment", s, engine=db, redis=redis_client)["result"]["exits_enriched"] == 0


def test_the_rotator_exit_country_filter_is_checked():
    from magpie.rotator.service import RotatorError, check_filters

    assert check_filters({"exit_country": "nl, de"}) == {"exit_country": ["NL", "DE"]}
    with pytest.raises(RotatorError, match="filter exit_country: expected two-letter country codes"):
        check_filters({"exit_country": "Netherlands"})


def test_the_check_pool_publishes_the_exit_address(exit_lab, redis_client, redis_prefix):
    from magpie.checker.engine import CheckEngine
    from magpie.pipeline.checkpool import CheckPool
    from magpie.queue import Payload, QueueKeys, RouteQueue
    from magpie.queue.completion import StreamTarget

    q = RouteQueue(redis_client, QueueKeys(redis_prefix, 4), interval_ms=60_000, lease_ms=60_000)
    h = "e" * 24
    q.schedule([(h, Payload(1, Route("http", ENTRY, exit_lab[1]), h, [1]).encode())])
    shard = q.keys.shard_of(h)
    q.r.zadd(shard, {h: 1000})
    q.r.zadd(q.keys.heads, {shard: 1000})
    key = redis_prefix + "results"
    pool = CheckPool(q, CheckEngine(exit_lab[0], timeout=5.0, attempts=1), StreamTarget(key, "g", 1000, "evict_oldest"),
                     capacity=10, renew_below_ms=0, complete_interval=0.05).start()
    try:
        assert pool.submit(q.pop(1)) == 1
        assert pool.wait_idle(15)
    finally:
        pool.close()
    [(_sid, fields)] = redis_client.xrange(key)
    assert fields[b"alive"] == b"1" and fields[b"exit_ip"] == EXIT.encode()
