"""The bad-input battery as a whole: each case a new user or an attacker tried ends with exit 0-3 and at
most one line on stderr (an import reports its invalid lines and exits 0), never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


@pytest.fixture
def busy():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield str(s.getsockname()[1])
    s.close()


def test_every_bad_input_case_is_one_line_and_no_traceback(settings, db, tmp_path, busy):
    env = dict(os.environ, MAGPIE_REDIS_URL=settings.redis_url, MAGPIE_REDIS_PREFIX=settings.redis_prefix,
               MAGPIE_DATABASE_URL=settings.database_url, PROXY_ENCRYPTION_KEY=settings.encryption_key,
               PROXY_QUEUE_SHARDS="4", MAGPIE_CHECK_ALLOW_PRIVATE="", MAGPIE_ENRICH_ALLOW_PRIVATE="")
    f = tmp_path / "l.txt"
    f.write_text("127.0.0.1:8080\n")
    nested = tmp_path / "n.jsonl"
    nested.write_text('{"a":' * 100000 + "1\n")
    ansi = tmp_path / "a.txt"
    ansi.write_text("u\x1b[2Jx\x00:pw@127.0.0.2:80\n")
    u16 = tmp_path / "u16.txt"
    u16.write_bytes("127.0.0.3:80\n".encode("utf-16"))
    d = tmp_path / "dir"
    d.mkdir()
    H = "0" * 24
    cases = [
        ({}, ["import", str(nested), "-w", "a"]),
        ({}, ["import", str(ansi), "-w", "a"]),
        ({}, ["import", str(u16), "-w", "a"]),
        ({}, ["import", "/nonexistent", "-w", "a"]),
        ({}, ["import", str(d), "-w", "a"]),
        ({}, ["import", str(f), "-w", ""]),
        ({}, ["import", str(f), "-w", "ws\x1b[31m"]),
        ({}, ["import", str(f), "-w", "a", "--format", "bogus"]),
        ({"MAGPIE_REDIS_URL": "redis://127.0.0.1:6379/abc"}, ["status"]),
        ({"MAGPIE_REDIS_URL": "redis://127.0.0.1:1/0"}, ["status"]),
        ({"MAGPIE_CHECK_INTERVAL": "abc"}, ["status"]),
        ({}, ["judge", "--port", busy]),
        ({"MAGPIE_ROTATOR_METRICS_PORT": busy}, ["rotator"]),
        ({}, ["metrics", "--port", busy]),
        ({}, ["web", "--port", busy]),
        ({}, ["web", "--port", "99999"]),
        ({}, ["blacklists", "refresh", "--json"]),
        ({}, ["judges", "add", "http://127.1/"]),
        ({}, ["judges", "add", "http://2130706433/"]),
        ({}, ["judges", "add", "ftp://x/"]),
        ({}, ["blacklists", "add", "x", "/etc/shadow"]),
        ({}, ["blacklists", "add", "x", "http://0x7f000001/"]),
        ({}, ["blacklists", "add", "BAD NAME", str(f)]),
        ({}, ["alerts", "rules", "edit", "999", "--threshold", "1", "--expected-revision", "1"]),
        ({}, ["queue", "inspect", "zzz"]),
        ({}, ["queue", "inspect", H]),
        ({}, ["queue", "check-now", H, "--in", "-1"]),
        ({}, ["queue", "update", H, "{}", "--expected-revision", "x"]),
        ({}, ["queue", "obliterate"]),
        ({}, ["queue", "heartbeat", "garbage"]),
        ({}, ["maintenance", "run", "nosuchjob"]),
        ({}, ["keys", "export", str(f)]),  # a file, not a directory
        ({}, ["outbox", "send", "not-an-address", "s", "b"]),
        ({}, ["alerts", "channels", "add-webhook", "x", "ftp://x/", "-w", "nosuch"]),
        ({}, ["profiles", "set", "nosuch", "--timeout", "abc"]),
        ({}, ["rotators", "add", "x", "--workspace", "nosuch"]),
        ({}, ["workspaces", "create", "bad\x1bname"]),
        ({}, ["workspaces", "delete", "nosuch", "--yes"]),
        ({}, ["bulk", "remove-routes", "--yes"]),
        ({}, ["bulk", "remove-routes", "--dead-days", "-1"]),
        ({}, ["bulk", "retry-deliveries", "--kind", "email", "--channel", "1"]),
        ({}, ["db", "downgrade", "nosuchrev", "--yes"]),
        ({}, ["check", str(f), "--judge", "http://127.0.0.1:1/", "--timeout", "0.2"]),
        ({}, ["routes", "--min-score", "abc"]),
        ({}, ["stats", "timeline", "--hours", "-5"]),
    ]
    failures = []
    for extra, args in cases:
        res = subprocess.run([sys.executable, "-m", "magpie", *args], env=dict(env, **extra), capture_output=True,
                             text=True, timeout=60)
        err = res.stderr.strip()
        if "Traceback" in err or res.returncode not in (0, 1, 2, 3) or len(err.splitlines()) > 1:
            failures.append((args, res.returncode, err[-400:]))
        if "\x1b" in res.stdout + res.stderr:
            failures.append((args, "raw escape in the output", ""))
    assert failures == []
