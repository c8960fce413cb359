"""The deployment key fingerprint: recorded on first use, every process refuses another PROXY_ENCRYPTION_KEY.

Real PostgreSQL (the session database, or a throwaway one for the migration), the CLI in-process and real
Celery worker / beat subprocesses.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from magpie.cli import main
from magpie.config import get_settings
from magpie.base.crypto import KeyMismatchError, get_keyring, key_fingerprint
from magpie.db import migrate
from magpie.db.keycheck import read_status, verify_key
from magpie.db.repo import upsert_routes
from magpie.base.routes import Route

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-0123456789abcdef"
OTHER_KEY = "another-secret-key-9876543210"
PASSWORD = "s3cr:et p@ss"
PG_ADMIN_URL = os.environ.get("MAGPIE_TEST_PG_ADMIN_URL",
                              "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")

LIST = f"""\
socks5://alice:{PASSWORD.replace(':', '%3A').replace(' ', '%20').replace('@', '%40')}@127.0.0.2:1080
http://127.0.0.3:8080
[::1]:8888
"""


def recorded(db) -> list[str]:
    with db.connect() as c:
        return c.execute(sa.text("SELECT fingerprint FROM deployment_keys")).scalars().all()


@pytest.fixture
def cli(settings, db, monkeypatch):
    """Run ``magpie`` in-process against the test database; ``key=`` switches PROXY_ENCRYPTION_KEY."""
    assert settings.encryption_key == KEY
    base = {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
            "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_QUEUE_SHARDS": "4",
            "MAGPIE_BROKER_URL": settings.redis_url, "MAGPIE_BROKER_KEY_PREFIX": settings.redis_prefix + "b:"}
    for k, v in base.items():
        monkeypatch.setenv(k, v)

    def run(*args, key=KEY, code=0, **env):
        monkeypatch.setenv("PROXY_ENCRYPTION_KEY", key)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        get_settings.cache_clear()
        res = CliRunner().invoke(main, list(args), catch_exceptions=False)
        assert res.exit_code == code, res.output
        return res

    yield run
    get_settings.cache_clear()


def assert_one_line_refusal(output: str, key: str = OTHER_KEY) -> None:
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("Error: PROXY_ENCRYPTION_KEY does not match"), output
    assert "Traceback" not in output and key not in output


def test_fingerprint_is_an_hmac_of_a_constant_never_the_key():
    fp = key_fingerprint(KEY)
    assert fp == key_fingerprint(KEY) and fp != key_fingerprint(OTHER_KEY)
    assert fp.startswith("v1:") and len(fp) == 3 + 64 and KEY not in fp
    # its own subkey: not the route-hash key's output for the same bytes
    assert fp[3:27] != get_keyring(KEY).route_hash(Route("http", "127.0.0.1", 1))


def test_first_use_records_the_fingerprint_and_the_same_key_passes(cli, db):
    assert recorded(db) == []
    cli("routes", "--json")
    assert recorded(db) == [key_fingerprint(KEY)]
    cli("routes", "--json")
    assert recorded(db) == [key_fingerprint(KEY)]


def test_a_different_key_stops_database_commands_before_they_duplicate_routes(cli, db, tmp_path):
    f = tmp_path / "list.txt"
    f.write_text(LIST)
    assert json.loads(cli("import", str(f), "-w", "alpha", "--json").stdout)["imported"] == 3
    for args in (["import", str(f), "-w", "alpha"], ["routes"], ["queue", "rebuild"],
                 ["alerts", "rules", "list"], ["maintenance", "run", "token_expiry"], ["keys", "export", "x"]):
        res = cli(*args, key=OTHER_KEY, code=2)
        assert_one_line_refusal(res.output)
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM routes")).scalar() == 3  # nothing duplicated
    assert recorded(db) == [key_fingerprint(KEY)]
    cli("import", str(f), "-w", "alpha")  # the right key still works


def test_db_upgrade_records_when_absent_and_refuses_another_key(cli, db):
    assert "database at revision" in cli("db", "upgrade").output
    assert recorded(db) == [key_fingerprint(KEY)]
    cli("db", "upgrade")
    assert_one_line_refusal(cli("db", "upgrade", key=OTHER_KEY, code=2).output)


def test_an_older_database_with_routes_gets_a_fingerprint_only_for_their_key(db):
    upsert_routes(db, get_keyring(KEY), "old", [Route("socks5", "127.0.0.9", 1080, "bob", PASSWORD),
                                               Route("http", "127.0.0.10", 3128)])
    with pytest.raises(KeyMismatchError, match="PROXY_ENCRYPTION_KEY") as err:
        verify_key(db, OTHER_KEY)
    assert OTHER_KEY not in str(err.value)
    assert recorded(db) == []  # a wrong first key is not recorded
    st = verify_key(db, KEY)
    assert st.created and st.state == "match" and recorded(db) == [key_fingerprint(KEY)]
    assert not verify_key(db, KEY).created


def test_keys_status_shows_the_comparison_never_the_key(cli, db):
    out = cli("keys", "status", "--json").stdout
    assert json.loads(out)["state"] == "unrecorded" and recorded(db) == []  # status records nothing
    cli("db", "upgrade")
    assert "matches" in cli("keys", "status").output
    res = cli("keys", "status", "--json", key=OTHER_KEY, code=1)
    doc = json.loads(res.stdout)
    assert doc["state"] == "mismatch" and doc["recorded"] != doc["current"]
    assert OTHER_KEY not in res.output and KEY not in res.output
    assert "does NOT match" in cli("keys", "status", key=OTHER_KEY, code=1).output


def test_health_reports_the_key_probe(cli, db):
    cli("db", "upgrade")
    rep = json.loads(cli("health", "--json").stdout)
    assert rep["checks"]["key"]["ok"] and "matches" in rep["checks"]["key"]["detail"]
    res = cli("health", "--json", key=OTHER_KEY, code=1)
    rep = json.loads(res.stdout)
    assert not rep["ready"] and not rep["checks"]["key"]["ok"]
    assert "PROXY_ENCRYPTION_KEY" in rep["checks"]["key"]["detail"] and OTHER_KEY not in res.output


def test_export_then_import_under_a_new_key_in_a_new_deployment(cli, db, tmp_path, settings):
    f = tmp_path / "list.txt"
    f.write_text(LIST)
    cli("import", str(f), "-w", "alpha")
    cli("import", str(f), "-w", "be/ta")
    out_dir = tmp_path / "export"
    res = cli("keys", "export", str(out_dir))
    assert PASSWORD not in res.output and "exported 6 routes of 2 workspaces" in res.output
    files = sorted(p.name for p in out_dir.iterdir())
    assert files == ["alpha.txt", "be%2Fta.txt"]
    for p in out_dir.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    text = (out_dir / "alpha.txt").read_text()
    assert "socks5://alice:s3cr%3Aet%20p%40ss@127.0.0.2:1080" in text and "[::1]:8888" in text
    assert "refusing to overwrite" in cli("keys", "export", str(out_dir), code=2).output
    assert_one_line_refusal(cli("keys", "export", str(tmp_path / "other"), key=OTHER_KEY, code=2).output)

    # the new deployment: empty database, a fresh schedule prefix, a new key
    with db.begin() as c:
        c.execute(sa.text("TRUNCATE routes, check_history, workspaces, deployment_keys RESTART IDENTITY CASCADE"))
    new = {"MAGPIE_REDIS_PREFIX": settings.redis_prefix + "new:"}
    cli("db", "upgrade", key=OTHER_KEY, **new)
    for name, file in (("alpha", "alpha.txt"), ("be/ta", "be%2Fta.txt")):
        res = cli("import", str(out_dir / file), "-w", name, "--json", key=OTHER_KEY, **new)
        doc = json.loads(res.stdout)
        assert doc["valid"] == 3 and not doc["invalid"], doc
    rows = json.loads(cli("routes", "--json", key=OTHER_KEY, **new).stdout)
    assert sorted((r["host"], r["username"]) for r in rows) == [
        ("127.0.0.2", "alice"), ("127.0.0.3", None), ("::1", None)]
    assert recorded(db) == [key_fingerprint(OTHER_KEY)]


def test_the_fingerprint_migration_upgrades_and_downgrades_cleanly():
    def admin_url(name: str) -> str:
        return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name

    url = admin_url(f"magpie_test_keys_{uuid.uuid4().hex[:8]}")
    migrate.ensure_database(url)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        migrate.upgrade(url, "0003", encryption_key=KEY)  # below the table: nothing to record, no error
        assert sa.inspect(engine).has_table("deployment_keys") is False
        migrate.upgrade(url, encryption_key=KEY)
        assert migrate.current_revision(url) == migrate.head_revision()
        assert read_status(engine, KEY).state == "match"
        from alembic import command

        command.downgrade(migrate.alembic_config(url), "0003")
        assert sa.inspect(engine).has_table("deployment_keys") is False
        assert migrate.current_revision(url) == "0003"
        migrate.upgrade(url)
        assert read_status(engine, KEY).state == "unrecorded"
    finally:
        engine.dispose()
        admin = sa.create_engine(admin_url("postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}"'))
        admin.dispose()


def _celery(args, env, tmp_path, name):
    log = tmp_path / f"{name}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "magpie", *args], cwd=ROOT, env=env,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


@pytest.mark.parametrize("kind", ["worker-checks", "worker-jobs", "beat"])
def test_a_celery_process_with_another_key_exits_at_once_with_one_line(kind, settings, db, pg_url, tmp_path):
    verify_key(db, KEY)
    env = dict(os.environ, MAGPIE_REDIS_URL=settings.redis_url, MAGPIE_REDIS_PREFIX=settings.redis_prefix,
               MAGPIE_BROKER_URL=settings.redis_url, MAGPIE_BROKER_KEY_PREFIX=settings.redis_prefix + "b:",
               MAGPIE_DATABASE_URL=pg_url, PROXY_ENCRYPTION_KEY=OTHER_KEY)
    quiet = ["--pool=solo", "--without-mingle", "--without-gossip"]
    args = {"worker-checks": ["worker", "-Q", "checks", *quiet],
            "worker-jobs": ["worker", "-Q", "stats,alerts", *quiet],
            "beat": ["beat", f"--schedule={tmp_path / 'beat'}"]}[kind]
    proc, log = _celery(args, env, tmp_path, kind)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        pytest.fail(f"{kind} with another key kept running:\n{log.read_text()[-2000:]}")
    out = log.read_text()
    assert code != 0, out
    hits = [ln for ln in out.splitlines() if "PROXY_ENCRYPTION_KEY" in ln]
    assert len(hits) == 1 and hits[0].startswith("Error: PROXY_ENCRYPTION_KEY does not match"), out
    assert "Traceback" not in out and OTHER_KEY not in out


def test_a_worker_gives_up_on_an_unreachable_database_with_one_line(settings, tmp_path):
    env = dict(os.environ, MAGPIE_REDIS_URL=settings.redis_url, MAGPIE_BROKER_URL=settings.redis_url,
               MAGPIE_BROKER_KEY_PREFIX=settings.redis_prefix + "b:", PROXY_ENCRYPTION_KEY=KEY,
               MAGPIE_DATABASE_URL="postgresql+psycopg2://postgres:pw-never-shown@127.0.0.1:1/magpie",
               MAGPIE_KEY_CHECK_WAIT="0")
    proc, log = _celery(["worker", "-Q", "checks", "--pool=solo"], env, tmp_path, "nodb")
    t0 = time.monotonic()
    code = proc.wait(timeout=30)
    out = log.read_text()
    assert code == 2 and time.monotonic() - t0 < 30, out
    assert "Error: cannot reach PostgreSQL (MAGPIE_DATABASE_URL)" in out and "pw-never-shown" not in out
    assert "Traceback" not in out
