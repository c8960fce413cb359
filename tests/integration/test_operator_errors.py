"""What an operator meets first: a removal that stays removed, one-line errors for the PostgreSQL schedule,
refusals at the moment a bad value is given (a judge the checks may not dial, a port range, a route hash).
"""

from __future__ import annotations

import psycopg2
import pytest
from click.testing import CliRunner

from magpie.config import ConfigError, load_settings
from magpie.errors import storage_error
from magpie.importer.service import import_file
from magpie.maintenance.rebuild import needs_rebuild
from magpie.queue import RouteQueue


def test_the_first_import_bootstraps_the_schedule_so_a_removal_is_not_rebuilt(settings, pg_url, db, redis_client,
                                                                              tmp_path):
    q = RouteQueue.from_settings(settings, redis_client)
    f = tmp_path / "list.txt"
    f.write_text("127.0.9.1:8080\n127.0.9.2:8080\n")
    assert import_file(str(f), "ops", settings, queue=q, engine=db).imported == 2
    assert not needs_rebuild(db, q)  # the schedule holds what PostgreSQL owns
    gone = q.status()["totals"]["scheduled"]
    member = next(m for m in (r.decode() for s in q.keys.all_shards() for r in redis_client.zrange(s, 0, -1)))
    q.remove_route(member, force=True)
    assert q.status()["totals"]["scheduled"] == gone - 1 and not needs_rebuild(db, q)


def test_a_lost_schedule_is_not_marked_by_a_later_import(settings, pg_url, db, redis_client, tmp_path):
    q = RouteQueue.from_settings(settings, redis_client)
    f = tmp_path / "a.txt"
    f.write_text("127.0.9.3:8080\n")
    import_file(str(f), "ops", settings, queue=q, engine=db)
    redis_client.delete(*[k for k in redis_client.scan_iter(match=settings.redis_prefix + "*")])  # Redis lost it
    f.write_text("127.0.9.4:8080\n")
    import_file(str(f), "ops", settings, queue=q, engine=db)
    assert needs_rebuild(db, q)  # the route imported before the loss still needs the rebuild


def test_postgresql_schedule_failures_are_one_line():
    with pytest.raises(psycopg2.OperationalError) as exc:
        psycopg2.connect("postgresql://postgres:s3cret@127.0.0.1:1/x", connect_timeout=2)
    line = storage_error(exc.value)
    assert line.startswith("cannot reach the PostgreSQL schedule (MAGPIE_SCHEDULE_URL)") and "s3cret" not in line
    missing = psycopg2.errors.UndefinedTable('relation "schedule_meta" does not exist')
    assert "run `magpie db upgrade`" in storage_error(missing)


def test_bad_values_are_refused_when_given(settings, pg_url, db, monkeypatch):
    from magpie.cli import main
    from magpie.config import get_settings

    with pytest.raises(ConfigError, match="MAGPIE_ROTATOR_PORTS"):
        load_settings(rotator_ports="70000-70010")
    with pytest.raises(ConfigError, match="MAGPIE_ROTATOR_PORTS"):
        load_settings(rotator_ports="30000-20000")
    for k, v in {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
                 "MAGPIE_DATABASE_URL": pg_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
                 "MAGPIE_CHECK_ALLOW_PRIVATE": "false"}.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(main, ["judges", "add", "http://10.1.2.3/"])
        assert res.exit_code == 2 and "MAGPIE_CHECK_ALLOW_PRIVATE" in res.output
        res = CliRunner().invoke(main, ["judges", "list", "--json"])
        assert res.exit_code == 0 and "10.1.2.3" not in res.output
        res = CliRunner().invoke(main, ["queue", "inspect", "nothex"])
        assert res.exit_code == 2 and "24 hex characters" in res.output
    finally:
        get_settings.cache_clear()
