"""The built wheel works outside the source tree: scripts ship inside it, import and a check cycle run;
``magpie init DIR`` writes the deployment files; Flower needs a login with or without a flowerconfig.py;
the README's "At a glance" runs from the initialised directory (honcho and every Procfile process)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from magpie.lab.lab import start_free_lab
from helpers import checked_until, stop_group

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # builds and installs a wheel: the slow tier

CYCLE = """
import json, os, time, magpie
from magpie.wiring import runtime
from magpie.pipeline.promote import promote
from magpie.queue import Lease
pool = runtime.check_pool()
q = runtime.route_queue()
want = int(os.environ["EXPECT_ROUTES"])
claimed, deadline = 0, time.monotonic() + 60
# poll: promote claims nothing until the engine has announced its slots; a retried route is claimed again
while time.monotonic() < deadline and pool.stats().totals.completed < want:
    cap = runtime.capacity_registry().total()
    if cap:
        claimed += promote(q, lambda ds: pool.submit([Lease.from_dict(d) for d in ds]), budget=100,
                           max_inflight=100, capacity=cap)
    pool.wait_idle(0.2)
    time.sleep(0.05)  # the poll interval of this deadline loop (wait_idle returns at once when idle)
ok = pool.wait_idle(30)
t = pool.stats().totals
print(json.dumps({"file": magpie.__file__, "claimed": claimed, "idle": ok, "completed": t.completed,
                  "published": t.published}))
runtime.close_check_pool()
"""

@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                    str(tmp / "dist"), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp / "dist").glob("magpie-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp / "site"),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    return tmp


def run_installed(installed, env, *args, code=None, cwd=None):
    env = {**env, "PYTHONPATH": str(installed / "site")}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-c", "from magpie.cli import main; main()",
                                                    *args]
    return subprocess.run(cmd, cwd=cwd or installed, env=env, capture_output=True, text=True, timeout=120)


def _bin(installed) -> Path:
    """A bin folder whose ``magpie``, ``celery`` and ``honcho`` run the installed copy (the wheel was
    installed with --target, which leaves the console scripts to us)."""
    out = installed / "bin"
    out.mkdir(exist_ok=True)
    for name, target in (("magpie", "-c 'from magpie.cli import main; main()'"), ("celery", "-m celery"),
                         ("honcho", "-c 'import sys; from honcho.command import main; sys.exit(main())'")):
        script = out / name
        script.write_text(f'#!/bin/sh\nPYTHONPATH={installed / "site"} exec {sys.executable} {target} "$@"\n')
        script.chmod(0o755)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str, deadline_s: float, proc, **kw) -> requests.Response:
    """The first answer of ``url`` within ``deadline_s`` seconds (fails if ``proc`` exits first)."""
    deadline = time.monotonic() + deadline_s
    while True:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            return requests.get(url, timeout=2, **kw)
        except requests.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_wheel_carries_the_scripts_and_runs_import_and_a_check_cycle(installed, settings, pg_url, db,
                                                                   redis_prefix, redis_client):
    assert len(list((installed / "site" / "magpie" / "lua").glob("*.lua"))) >= 17
    lab = start_free_lab(slow_delay=0.2)
    try:
        env = dict(os.environ, MAGPIE_REDIS_URL=settings.redis_url, MAGPIE_REDIS_PREFIX=redis_prefix,
                   MAGPIE_DATABASE_URL=pg_url, MAGPIE_JUDGE_URL=lab.judge_url, MAGPIE_CHECK_TIMEOUT="10",
                   PROXY_ENCRYPTION_KEY=settings.encryption_key, MAGPIE_CHECKS_PER_PROCESS="100")
        lst = installed / "lab.txt"
        lab.write_list(lst)
        imp = run_installed(installed, env, "import", str(lst), "--workspace", "wheel", "--json")
        assert imp.returncode == 0, imp.stderr
        assert json.loads(imp.stdout)["imported"] == len(lab.proxies)
        st = run_installed(installed, env, "status", "--json")
        assert st.returncode == 0, st.stderr
        health = run_installed(installed, env, "health", "--json")
        assert json.loads(health.stdout)["checks"]["scripts"]["ok"], health.stdout
        redis_client.delete(redis_prefix + "{default}:proxy_queue_heads")  # nothing else due: make all due
        for n in range(16):
            shard = f"{redis_prefix}{{default}}:proxy_queue:{n}"
            members = redis_client.zrange(shard, 0, -1)
            if members:
                redis_client.zadd(shard, {m: 1000 for m in members})
                redis_client.zadd(redis_prefix + "{default}:proxy_queue_heads", {shard: 1000})
        cyc = run_installed(installed, dict(env, EXPECT_ROUTES=str(len(lab.proxies))), code=CYCLE)
        assert cyc.returncode == 0, cyc.stderr
        out = json.loads(cyc.stdout.strip().splitlines()[-1])
    finally:
        lab.stop()
    assert out["file"].startswith(str(installed / "site")), out  # the installed copy, not the checkout
    assert out["claimed"] >= len(lab.proxies) and out["idle"]
    assert out["completed"] == out["published"] == len(lab.proxies)


def _env(settings, redis_prefix, pg_url, **extra) -> dict:
    env = dict(os.environ)
    for name in ("MAGPIE_FLOWER_BASIC_AUTH", "MAGPIE_FLOWER_ALLOW_NO_AUTH", "FLOWER_BASIC_AUTH",
                 "FLOWER_AUTH"):
        env.pop(name, None)
    return dict(env, MAGPIE_REDIS_URL=settings.redis_url, MAGPIE_REDIS_PREFIX=redis_prefix,
                MAGPIE_DATABASE_URL=pg_url, PROXY_ENCRYPTION_KEY=settings.encryption_key,
                MAGPIE_BROKER_URL=settings.redis_url, MAGPIE_BROKER_KEY_PREFIX=redis_prefix + "broker:",
                **extra)


def test_magpie_init_writes_the_deployment_files_the_wheel_carries(installed, settings, redis_prefix, pg_url):
    env = _env(settings, redis_prefix, pg_url)
    target = installed / "deployment"
    res = run_installed(installed, env, "init", str(target), "--json")
    assert res.returncode == 0, res.stderr
    written = [Path(p).relative_to(target).as_posix() for p in json.loads(res.stdout)["written"]]
    assert written == ["Procfile", "celeryconfig.py", "flowerconfig.py", "alembic.ini",
                       "deploy/prometheus/rules.yml", "deploy/grafana/magpie.json"]
    for name in written:  # the checkout's files, byte for byte
        assert (target / name).read_bytes() == (ROOT / name).read_bytes(), name
    (target / "Procfile").write_text("mine\n")
    again = run_installed(installed, env, "init", str(target))
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"Error: {target / 'Procfile'} exists; nothing written (--force overwrites)"], again.stderr
    assert (target / "Procfile").read_text() == "mine\n"  # nothing overwritten
    assert run_installed(installed, env, "init", str(target), "--force").returncode == 0
    assert (target / "Procfile").read_bytes() == (ROOT / "Procfile").read_bytes()
    # the written alembic.ini finds the migrations inside the installed package
    heads = run_installed(installed, env, code="import sys; from alembic.config import main; "
                          "main(['-c', 'alembic.ini', 'heads'])", cwd=target)
    assert heads.returncode == 0 and "(head)" in heads.stdout, heads.stdout + heads.stderr


@pytest.mark.parametrize("where", ["an empty directory", "the initialised directory"])
def test_flower_from_the_wheel_refuses_to_run_without_a_login_and_serves_loopback_with_one(
        installed, settings, redis_prefix, pg_url, where, tmp_path):
    cwd = tmp_path / "empty"
    cwd.mkdir()
    if where != "an empty directory":
        init = run_installed(installed, _env(settings, redis_prefix, pg_url), "init", str(cwd))
        assert init.returncode == 0, init.stderr
    port = _free_port()
    celery = [str(_bin(installed) / "celery"), "-A", "magpie", "flower", f"--port={port}"]
    env = _env(settings, redis_prefix, pg_url)
    bare = subprocess.run(celery, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0
    assert "flower: refusing to start without authentication" in bare.stderr, bare.stderr[-2000:]
    env["MAGPIE_FLOWER_BASIC_AUTH"] = "ops:a long password"
    log = open(tmp_path / "flower.log", "w")
    proc = subprocess.Popen(celery, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        assert _answers(f"http://127.0.0.1:{port}/", 60, proc).status_code == 401
        assert _answers(f"http://127.0.0.1:{port}/workers", 5, proc,
                        auth=("ops", "a long password")).status_code == 200
    finally:
        stop_group(proc)
    text = (tmp_path / "flower.log").read_text()
    assert re.search(rf"Visit me at https?://127\.0\.0\.1:{port}", text), text[-2000:]  # loopback only
    assert "a long password" not in text


@pytest.mark.slow
@pytest.mark.e2e
def test_the_readme_at_a_glance_runs_from_an_initialised_directory(installed, settings, redis_prefix, pg_url,
                                                                   db, tmp_path):
    lab = start_free_lab(slow_delay=0.2)
    deployment = tmp_path / "acme-deployment"
    flower_port, web_port = _free_port(), _free_port()
    env = _env(settings, redis_prefix, pg_url, MAGPIE_JUDGE_URL=lab.judge_url, MAGPIE_CHECK_TIMEOUT="3",
               MAGPIE_CHECK_INTERVAL="5", MAGPIE_CHECKS_PER_PROCESS="100", MAGPIE_CHECK_CONCURRENCY="1",
               MAGPIE_FLOWER_BASIC_AUTH="admin:a long password", MAGPIE_FLOWER_PORT=str(flower_port),
               MAGPIE_WEB_PORT=str(web_port))
    env["PATH"] = f"{_bin(installed)}{os.pathsep}{env['PATH']}"
    honcho = None
    try:
        def run(*args):
            res = subprocess.run(list(args), cwd=deployment if deployment.exists() else tmp_path, env=env,
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, (args, res.stdout[-1000:], res.stderr[-2000:])
            return res.stdout

        run("magpie", "init", str(deployment))
        lst = deployment / "proxies.txt"
        lab.write_list(lst)
        run("magpie", "db", "upgrade")
        imported = json.loads(run("magpie", "import", "proxies.txt", "--workspace", "acme", "--json"))
        assert imported["imported"] == len(lab.proxies)
        log = open(tmp_path / "honcho.log", "w")
        honcho = subprocess.Popen(["honcho", "start"], cwd=deployment, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        rows = checked_until([honcho], db, settings, tmp_path / "honcho.log", lambda p: None,
                             workspace="acme", rounds=1, timeout=120)
        assert rows and all((r["checks_total"] or 0) >= 1 for r in rows), \
            (tmp_path / "honcho.log").read_text()[-3000:]
        assert _answers(f"http://127.0.0.1:{flower_port}/", 30, honcho).status_code == 401
        assert _answers(f"http://127.0.0.1:{web_port}/", 30, honcho).status_code == 200
        status = json.loads(run("magpie", "status", "--json"))
        assert status, status
        routes = run("magpie", "routes", "--workspace", "acme", "--json")
        assert len(json.loads(routes)) == len(lab.proxies), routes
        one_shot = run("magpie", "check", "proxies.txt", "--json", "--timeout", "3", "--attempts", "1")
        assert sum(r["alive"] for r in json.loads(one_shot)["results"]) >= 1, one_shot
    finally:
        if honcho is not None:
            stop_group(honcho)
        lab.stop()
    out = (tmp_path / "honcho.log").read_text()
    for process in ("worker-promote", "worker-checks", "worker-jobs", "beat", "flower", "rotator", "web"):
        assert re.search(rf"{process}\.1 +\| ", out), process  # every Procfile process ran
