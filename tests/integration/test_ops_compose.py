"""The compose file is ready for production: validated by the compose tool when one is installed, and
its required properties checked from the YAML in any case; the image runs as a non-root user."""

from __future__ import annotations

import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
HEALTH = ROOT / "docker" / "healthcheck.py"
MAGPIE_SERVICES = ("worker-promote", "worker-checks", "worker-jobs", "beat")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _compose_tool() -> list[str] | None:
    """``docker compose`` when the plugin answers, else ``docker-compose``, else None."""
    env = dict(os.environ, PROXY_ENCRYPTION_KEY="compose-validation-key-0123")
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            res = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=30, env=env)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if res.returncode == 0:
            return cmd
    return None


def test_the_compose_tool_accepts_the_file():
    cmd = _compose_tool()
    if cmd is None:
        pytest.skip("no compose tool installed (docker compose / docker-compose)")
    env = dict(os.environ, PROXY_ENCRYPTION_KEY="compose-validation-key-0123")
    res = subprocess.run([*cmd, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60,
                         env=env)
    assert res.returncode == 0, res.stderr
    missing = dict(os.environ)
    missing.pop("PROXY_ENCRYPTION_KEY", None)
    res = subprocess.run([*cmd, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60,
                         env=missing)
    assert res.returncode != 0 and "PROXY_ENCRYPTION_KEY" in res.stderr  # the key is required, never defaulted


def test_every_long_running_service_restarts_and_has_a_healthcheck(compose):
    for name, svc in compose["services"].items():
        if name == "migrate":
            continue
        assert svc.get("restart") in ("unless-stopped", "always"), name
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), name


def test_redis_keeps_the_schedule(compose):
    redis = compose["services"]["redis"]
    cmd = redis["command"]
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags["--appendonly"] == "yes" and flags["--maxmemory-policy"] == "noeviction"
    assert any(v.split(":")[0] in compose["volumes"] and v.endswith(":/data") for v in redis["volumes"])


def test_state_is_in_named_volumes(compose):
    declared = set(compose["volumes"])
    used = {v.split(":")[0] for svc in compose["services"].values() for v in svc.get("volumes", [])}
    assert used == declared and {"pg-data", "redis-data"} <= declared
    pg = compose["services"]["postgres"]
    assert "pg-data:/var/lib/postgresql/data" in pg["volumes"]


def test_migrations_run_once_before_the_processes_that_need_them(compose):
    services = compose["services"]
    migrate = services["migrate"]
    assert migrate["command"] == ["magpie", "db", "upgrade"] and migrate["restart"] == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in MAGPIE_SERVICES:
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name


def test_secrets_are_required_not_written(compose):
    text = COMPOSE.read_text()
    assert "${PROXY_ENCRYPTION_KEY:?" in text
    env = compose["services"]["worker-checks"]["environment"]
    assert env["MAGPIE_CHECK_ALLOW_PRIVATE"].endswith("/32")


def test_the_image_is_slim_non_root_and_copies_what_exists():
    text = DOCKERFILE.read_text()
    final = text.split("\nFROM ")[-1]
    assert final.startswith("python:3.11-slim")
    user = re.findall(r"^USER\s+(\S+)", final, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert (ROOT / src).exists(), src


def _health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTH), *args], capture_output=True, text=True, timeout=30)


def test_healthcheck_script(tmp_path):
    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/ok" else 500)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        assert _health("http", f"http://127.0.0.1:{port}/ok").returncode == 0
        assert _health("http", f"http://127.0.0.1:{port}/bad").returncode == 1
        assert _health("tcp", f"127.0.0.1:{port}").returncode == 0
    finally:
        srv.shutdown()
        srv.server_close()
    assert _health("tcp", f"127.0.0.1:{port}").returncode == 1
    f = tmp_path / "celerybeat-schedule.db"
    f.write_text("x")
    assert _health("fresh", str(tmp_path / "celerybeat-schedule*"), "60").returncode == 0
    old = time.time() - 120
    os.utime(f, (old, old))
    res = _health("fresh", str(tmp_path / "celerybeat-schedule*"), "60")
    assert res.returncode == 1 and "written in 60 s" in res.stderr
    assert _health("bogus").returncode == 2
