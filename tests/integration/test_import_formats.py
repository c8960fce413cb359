"""``magpie import`` of a list mixing every published format, from a file and from stdin; ``--format``; the
schema hint on a database that is not migrated (real PostgreSQL and Redis)."""

from __future__ import annotations

import json
import uuid

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from magpie.cli import main
from magpie.config import get_settings

MIXED = (
    "# Free proxy list - mixed formats\n"                            # 1 skipped
    "Proxy list updated at 2026-11-29 10:00:00 UTC\n"               # 2 skipped (prose)
    "\n"                                                            # 3 skipped
    "127.0.0.1:3128\n"                                              # 4 valid
    "127.0.0.1:3128\n"                                              # 5 duplicate
    "socks5://user:p%40ss@127.0.0.2:1080\n"                         # 6 valid
    "127.0.0.3:8080 US-H-S +\n"                                     # 7 valid (annotated after a space)
    "127.0.0.4:8080:US:elite:S\n"                                   # 8 valid (three code fields)
    "127.0.0.5:8080:US:elite\n"                                     # 9 invalid: ambiguous (auto)
    "127.0.0.6:8080:alice:s3cret\n"                                 # 10 valid, credentials
    "127.0.0.7\t8081\tDE\telite\n"                                  # 11 valid (TSV, no header)
    "127.0.0.8 8082\r\n"                                            # 12 valid (CRLF)
    "ip,port,protocol,username,password\n"                          # 13 skipped (CSV header)
    '127.0.0.9,1080,socks5,bob,"pa,ss"\n'                           # 14 valid
    "127.0.0.10,99999,http,,\n"                                     # 15 invalid: bad port
    "127.0.0.11,8080,,,\n"                                          # 16 valid
    "127.0.0.12,8080,http\n"                                        # 17 invalid: row width
    '{"ip":"127.0.0.13","port":8080,"protocol":"socks4"}\n'         # 18 valid (JSON line)
    '{"ip":"127.0.0.14","port":"8443","protocols":["https"]}\n'     # 19 valid
    '{"ip":"127.0.0.15"}\n'                                         # 20 invalid: missing port
    '{"ip": "127.0.0.16", "port": 80\n'                             # 21 invalid: malformed JSON
    "Bücher.example:8080\n"                                         # 22 valid (IDN)
    "xn--bcher-kva.example:8080\n"                                  # 23 duplicate of 22
    "10.0.0.1:8080\n"                                               # 24 invalid: egress guard
    "127.0.0.17:8080\r127.0.0.18:8080\n"                            # 25 valid x2 (a lone CR)
    "127.0.0.19:abc\n"                                              # 26 invalid: bad port
    "Total: 20 proxies\n"                                           # 27 skipped
)
INVALID_LINES = [9, 15, 17, 20, 21, 24, 26]


@pytest.fixture
def cli(settings, monkeypatch):
    env = {
        "MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
        "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key,
        "PROXY_QUEUE_SHARDS": "4", "MAGPIE_CHECK_INTERVAL": "60",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    runner = CliRunner()

    def run(*args, code=0, input=None):
        res = runner.invoke(main, list(args), catch_exceptions=False, input=input)
        assert res.exit_code == code, res.output
        return res

    yield run
    get_settings.cache_clear()


def _stored(db, workspace: str) -> list[tuple[str, str, int]]:
    with db.connect() as c:
        return [tuple(r) for r in c.execute(sa.text(
            "SELECT r.protocol, r.host, r.port FROM routes r JOIN route_workspaces rw ON rw.route_id = r.id "
            "JOIN workspaces w ON w.id = rw.workspace_id WHERE w.name = :w ORDER BY r.id"), {"w": workspace})]


def test_mixed_file_reports_exact_counts(cli, db, tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes(MIXED.encode())
    out = json.loads(cli("import", str(path), "-w", "alpha", "--json").stdout)
    assert (out["valid"], out["imported"], out["duplicates"], out["skipped"]) == (14, 14, 2, 5)
    assert [x["line"] for x in out["invalid"]] == INVALID_LINES
    assert out["refused"] == 1
    reasons = {x["line"]: x["reason"] for x in out["invalid"]}
    assert "--format ip:port:country:anonymity" in reasons[9]
    assert reasons[15] == "bad port '99999'" and reasons[26] == "bad port 'abc'"
    assert reasons[17] == "row has 3 fields, its header 5"
    assert reasons[20] == "missing port" and reasons[21].startswith("malformed JSON line")
    assert reasons[24].startswith("refused by the egress guard")
    stored = _stored(db, "alpha")
    assert len(stored) == 14
    assert ("http", "xn--bcher-kva.example", 8080) in stored
    assert ("socks4", "127.0.0.13", 8080) in stored and ("https", "127.0.0.14", 8443) in stored
    assert ("socks5", "127.0.0.9", 1080) in stored and ("http", "127.0.0.18", 8080) in stored


def test_stdin_reads_the_same_as_the_file(cli, db, tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes(MIXED.encode())
    from_file = json.loads(cli("import", str(path), "-w", "alpha", "--dry-run", "--json").stdout)
    from_stdin = json.loads(cli("import", "-", "-w", "alpha", "--json", input=MIXED.encode()).stdout)
    assert {**from_file, "imported": 14, "stored": 14, "scheduled": 14} == from_stdin
    text = cli("import", "-", "-w", "alpha", input=MIXED.encode())
    assert "valid=14 duplicates=16 skipped=5 invalid=7" in text.stdout
    assert "line 9: fields after host:port look like country:anonymity codes" in text.stderr


@pytest.mark.parametrize(
    ("fmt", "valid", "invalid_lines"),
    [
        ("ip:port:country:anonymity", 15, [15, 17, 20, 21, 24, 26]),
        ("ip:port:user:pass", 14, [8, 15, 17, 20, 21, 24, 26]),
    ],
)
def test_format_option_says_what_the_fields_are(cli, db, tmp_path, fmt, valid, invalid_lines):
    path = tmp_path / "mixed.txt"
    path.write_bytes(MIXED.encode())
    out = json.loads(cli("import", str(path), "-w", "alpha", "--format", fmt, "--json").stdout)
    assert out["valid"] == valid and out["imported"] == valid
    assert [x["line"] for x in out["invalid"]] == invalid_lines


def test_missing_file_is_one_line(cli, db, tmp_path):
    res = cli("import", str(tmp_path / "nope.txt"), "-w", "alpha", code=2)
    assert "no such file" in res.output and "Traceback" not in res.output


@pytest.fixture
def empty_database(pg_url):
    name = f"magpie_empty_{uuid.uuid4().hex[:8]}"
    admin_url = pg_url.rsplit("/", 1)[0] + "/postgres"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield pg_url.rsplit("/", 1)[0] + "/" + name
    from magpie.db.session import dispose_engines

    dispose_engines()
    with admin.connect() as c:
        c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


def test_unmigrated_database_names_db_upgrade(cli, empty_database, tmp_path, monkeypatch):
    path = tmp_path / "list.txt"
    path.write_text("127.0.0.1:3128\n")
    monkeypatch.setenv("MAGPIE_DATABASE_URL", empty_database)
    get_settings.cache_clear()
    res = cli("import", str(path), "-w", "alpha", code=2)
    assert "run `magpie db upgrade`" in res.output
    assert "not migrated (no workspaces table)" in res.output
    assert "Traceback" not in res.output and "sqlalchemy" not in res.output.lower()
    dry = json.loads(cli("import", str(path), "-w", "alpha", "--dry-run", "--json").stdout)
    assert dry["valid"] == 1  # a dry run needs no database


def test_missing_database_names_db_upgrade(cli, pg_url, tmp_path, monkeypatch):
    path = tmp_path / "list.txt"
    path.write_text("127.0.0.1:3128\n")
    monkeypatch.setenv("MAGPIE_DATABASE_URL", pg_url.rsplit("/", 1)[0] + f"/magpie_nope_{uuid.uuid4().hex[:6]}")
    get_settings.cache_clear()
    res = cli("import", str(path), "-w", "alpha", code=2)
    assert "does not exist: run `magpie db upgrade` (it creates the database)" in res.output
