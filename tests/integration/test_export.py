"""``magpie export`` and :func:`magpie.admin.export.stream_export` against real PostgreSQL.

Routes, health, enrichment and reputation are seeded straight into their tables; the formats are read back
with the importer's parser, the csv and json modules.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import stat

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from magpie.base.crypto import get_keyring
from magpie.admin.export import ExportError, ExportFilter, stream_export
from magpie.importer.parse import parse_line
from magpie.base.routes import Route

SECRET = "p@ss:w0rd/%"

# (protocol, host, port, user, password, alive, latency, anonymity, country, score, exit_ip, exit_country)
ROUTES = [
    ("http", "203.0.113.1", 8080, None, None, True, 120.0, "elite", "DE", 90.0, "203.0.113.101", "NL"),
    ("socks5", "203.0.113.2", 1080, "alice", SECRET, True, 900.0, "anonymous", "NL", 40.0, "203.0.113.2", "NL"),
    ("socks4", "2001:db8::3", 1081, None, None, False, None, None, "US", 10.0, None, None),
    ("https", "203.0.113.4", 3128, None, None, None, None, None, None, None, None, None),  # never checked
    ("http", "203.0.113.5", 80, "bob", None, True, 50.0, "transparent", "DE", 75.5, "198.51.100.9", "FR"),
]


def seed(db, keyring, workspace="ws", routes=ROUTES) -> dict[int, int]:
    """The routes in ``workspace`` (and route 0 also in a second workspace ``other``); returns index -> id."""
    ids = {}
    with db.begin() as c:
        wid = c.execute(sa.text("INSERT INTO workspaces (name) VALUES (:n) RETURNING id"), {"n": workspace}).scalar()
        other = c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('other') RETURNING id")).scalar()
        for i, (proto, host, port, user, pw, alive, lat, anon, country, score, exit_ip, exit_cc) in enumerate(routes):
            rid = c.execute(sa.text(
                "INSERT INTO routes (route_hash, protocol, host, port, username_enc, password_enc) "
                "VALUES (:h, :p, :host, :port, :u, :pw) RETURNING id"),
                {"h": keyring.route_hash(Route(proto, host, port, user, pw)), "p": proto, "host": host, "port": port,
                 "u": keyring.encrypt(user) if user else None, "pw": keyring.encrypt(pw) if pw else None}).scalar()
            ids[i] = rid
            c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) VALUES (:r, :w)"),
                      {"r": rid, "w": wid})
            if alive is not None:
                c.execute(sa.text(
                    "INSERT INTO route_health (route_id, alive, latency_ms, anonymity, last_checked_at, exit_ip, "
                    "exit_country) VALUES (:r, :a, :l, :an, now(), :x, :xc)"),
                    {"r": rid, "a": alive, "l": lat, "an": anon, "x": exit_ip, "xc": exit_cc})
            if country:
                c.execute(sa.text("INSERT INTO route_enrichment (route_id, country) VALUES (:r, :c)"),
                          {"r": rid, "c": country})
            if score is not None:
                c.execute(sa.text(
                    "INSERT INTO route_reputation (route_id, score, label, uptime, recency, latency, anonymity, "
                    "streak, checks) VALUES (:r, :s, 'good', 1, 1, 1, 1, 1, 10)"), {"r": rid, "s": score})
        c.execute(sa.text("INSERT INTO route_workspaces (route_id, workspace_id) VALUES (:r, :w)"),
                  {"r": ids[0], "w": other})
    return ids


@pytest.fixture
def keyring(settings):
    return get_keyring(settings.encryption_key)


def text_of(settings, fmt="txt", creds=False, **flt) -> str:
    return "".join(stream_export(settings, ExportFilter(workspace=flt.pop("workspace", "ws"), **flt), fmt, creds))


def hosts(settings, **flt) -> list[str]:
    return [parse_line(line).host for line in text_of(settings, "url", **flt).splitlines()]


def test_filters_select_the_matching_routes(db, settings, keyring):
    seed(db, keyring)
    h = [r[1] for r in ROUTES]
    assert hosts(settings) == h  # route order, the never-checked one too
    assert hosts(settings, alive=True) == [h[0], h[1], h[4]]
    assert hosts(settings, alive=False) == [h[2]]  # failed newest check; never checked is neither
    assert hosts(settings, protocol="http") == [h[0], h[4]]
    assert hosts(settings, protocol="SOCKS4, socks5") == [h[1], h[2]]
    assert hosts(settings, anonymity="elite,anonymous") == [h[0], h[1]]
    assert hosts(settings, country="de") == [h[0], h[4]]
    assert hosts(settings, max_latency_ms=120) == [h[0], h[4]]
    assert hosts(settings, min_score=75.5) == [h[0], h[4]]
    assert hosts(settings, exit_country="nl") == [h[0], h[1]]
    assert hosts(settings, alive=True, country="DE", min_score=80) == [h[0]]
    assert hosts(settings, workspace="other") == [h[0]]
    assert text_of(settings, "json", country="JP") == "[]\n"
    assert text_of(settings, "csv", country="JP").count("\n") == 1  # the header alone


def test_every_format_reads_back_without_credentials(db, settings, keyring):
    seed(db, keyring)
    txt = text_of(settings, "txt").splitlines()
    assert txt[0] == "203.0.113.1:8080" and txt[2] == "[2001:db8::3]:1081"
    urls = [parse_line(line) for line in text_of(settings, "url").splitlines()]
    assert [(u.protocol, u.host, u.port, u.username) for u in urls] == [(r[0], r[1], r[2], None) for r in ROUTES]

    rows = list(csv.DictReader(io.StringIO(text_of(settings, "csv"))))
    assert "username" not in rows[0] and "password" not in rows[0]
    assert rows[0] == {"protocol": "http", "host": "203.0.113.1", "port": "8080", "alive": "true",
                       "latency_ms": "120.0", "anonymity": "elite", "country": "DE", "exit_ip": "203.0.113.101",
                       "exit_country": "NL", "score": "90.0", "last_checked_at": rows[0]["last_checked_at"]}
    assert rows[2]["alive"] == "false" and rows[3]["alive"] == "" and rows[3]["last_checked_at"] == ""

    arr = json.loads(text_of(settings, "json"))
    lines = [json.loads(line) for line in text_of(settings, "jsonl").splitlines()]
    assert arr == lines and len(arr) == len(ROUTES)
    assert arr[1]["url"] == "socks5://203.0.113.2:1080" and "password" not in arr[1]
    assert arr[4]["exit_ip"] == "198.51.100.9" and arr[4]["score"] == 75.5 and arr[3]["alive"] is None
    assert SECRET not in text_of(settings, "jsonl") and "alice" not in text_of(settings, "csv")


def test_credentials_only_when_asked_and_the_asking_is_audited(db, settings, keyring, caplog):
    seed(db, keyring)
    caplog.set_level(logging.INFO, logger="magpie.audit")
    assert not [r for r in caplog.records if r.name == "magpie.audit"]
    got = [parse_line(line) for line in text_of(settings, "txt", creds=True, alive=True).splitlines()]
    assert [(g.username, g.password) for g in got] == [(None, None), ("alice", SECRET), ("bob", None)]
    assert [(u.username, u.password) for u in map(parse_line, text_of(settings, "url", True).splitlines())][1] == \
        ("alice", SECRET)
    row = list(csv.DictReader(io.StringIO(text_of(settings, "csv", True))))[1]
    assert (row["username"], row["password"]) == ("alice", SECRET)
    assert json.loads(text_of(settings, "json", True))[1]["password"] == SECRET

    lines = [r.getMessage() for r in caplog.records if r.name == "magpie.audit"]
    assert len(lines) == 8  # requested + done, per export with credentials
    assert "workspace 'ws'" in lines[1] and "3 routes exported" in lines[1] and lines[1].startswith(
        "export with credentials done")
    assert all(SECRET not in m and "alice" not in m for m in lines)

    # a route whose credentials another key encrypted is left out, and counted
    with db.begin() as c:
        c.execute(sa.text("UPDATE routes SET password_enc = :p WHERE host = '203.0.113.2'"),
                  {"p": get_keyring("another-key-0123456789").encrypt("x")})
    caplog.clear()
    assert "203.0.113.2" not in text_of(settings, "txt", True)
    [done] = [r.getMessage() for r in caplog.records if "done" in r.getMessage()]
    assert "4 routes exported, 1 left out" in done


def test_the_stream_uses_a_server_side_cursor_and_releases_it(db, settings, keyring, monkeypatch):
    import magpie.admin.export as export

    many = [("http", f"203.0.113.{i}", 8000 + i, None, None, True, float(i), "elite", "DE", 50.0, None, None)
            for i in range(1, 11)]
    seed(db, keyring, routes=many)
    monkeypatch.setattr(export, "FETCH_ROWS", 3)
    it = stream_export(settings, ExportFilter("ws", alive=True), "txt")
    first = next(it)
    assert first.count("\n") == 3  # one fetch of 3 rows, not the whole result

    def export_backend():
        with db.connect() as c:
            return c.execute(sa.text(
                "SELECT state, query FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE 'FETCH FORWARD 3 FROM \"magpie_export\"%'")).all()

    [(state, _q)] = export_backend()
    assert state == "idle in transaction"  # the cursor's transaction holds the rest in PostgreSQL
    rest = list(it)
    assert [c.count("\n") for c in rest] == [3, 3, 1]
    it2 = stream_export(settings, ExportFilter("ws"), "txt")
    next(it2)
    it2.close()  # stopped early: the cursor's transaction ends, the connection goes back idle
    assert all(s == "idle" for s, _ in export_backend())


@pytest.mark.parametrize("flt, fmt, message", [
    (ExportFilter("nope"), "txt", "no workspace named 'nope'"),
    (ExportFilter("ws"), "xml", "unknown export format 'xml'"),
    (ExportFilter("ws", protocol="ftp"), "txt", "protocol: expected one or more of http"),
    (ExportFilter("ws", anonymity="stealthy"), "txt", "anonymity: expected one or more of"),
    (ExportFilter("ws", country="Germany"), "txt", "country: expected two-letter country codes"),
    (ExportFilter("ws", exit_country="1"), "txt", "exit_country: expected two-letter"),
    (ExportFilter("ws", max_latency_ms=0), "txt", "max_latency_ms: expected 0 < ms"),
    (ExportFilter("ws", max_latency_ms=float("nan")), "txt", "max_latency_ms"),
    (ExportFilter("ws", min_score=101), "txt", "min_score: expected 0 to 100"),
    (ExportFilter("ws", min_score="lots"), "txt", "min_score: expected a number"),
])
def test_bad_requests_raise_before_streaming(db, settings, keyring, flt, fmt, message):
    seed(db, keyring)
    with pytest.raises(ExportError, match=message.replace("(", r"\(")):
        stream_export(settings, flt, fmt)


@pytest.fixture
def cli_env(settings, monkeypatch):
    from magpie.config import get_settings

    for k, v in {"MAGPIE_REDIS_URL": settings.redis_url, "MAGPIE_REDIS_PREFIX": settings.redis_prefix,
                 "MAGPIE_DATABASE_URL": settings.database_url, "PROXY_ENCRYPTION_KEY": settings.encryption_key}.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def _cli(args):
    from magpie.cli import main

    return CliRunner().invoke(main, args)


@pytest.mark.parametrize("args, message", [
    (["--workspace", "nope", "--format", "txt"], "Error: no workspace named 'nope'"),
    (["--workspace", "ws", "--format", "xml"], "Error: Invalid value for '--format'"),
    (["--workspace", "ws", "--format", "txt", "--min-score", "-1"], "Error: min_score: expected 0 to 100"),
    (["--workspace", "ws", "--format", "txt", "--max-latency", "fast"], "Error: Invalid value for '--max-latency'"),
    (["--workspace", "ws", "--format", "txt", "--country", "xyz"], "Error: country: expected two-letter"),
])
def test_cli_errors_are_one_line_and_exit_2(db, keyring, cli_env, args, message):
    seed(db, keyring)
    res = _cli(["export", *args])
    assert res.exit_code == 2, res.output
    assert res.output.strip().count("\n") == 0 and res.output.startswith(message), res.output


def test_cli_writes_stdout_or_a_private_file(db, keyring, cli_env, tmp_path):
    seed(db, keyring)
    res = _cli(["export", "--workspace", "ws", "--alive", "--protocol", "http", "--format", "txt"])
    assert res.exit_code == 0, res.output
    assert res.output == "203.0.113.1:8080\n203.0.113.5:80\n"
    out = tmp_path / "alive.jsonl"
    res = _cli(["export", "--workspace", "ws", "--alive", "--format", "jsonl",
                                       "--with-credentials", "-o", str(out)])
    assert res.exit_code == 0 and res.output == "", res.output
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert [json.loads(line).get("username") for line in out.read_text().splitlines()] == [None, "alice", "bob"]
    assert not (tmp_path / "alive.jsonl.partial").exists()
