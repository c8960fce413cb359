"""The built wheel works outside the source tree: scripts ship inside it, import and a check cycle run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from magpie.lab.lab import start_free_lab

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # builds and installs a wheel: the slow tier

CYCLE = """
import json, os, time, magpie
from magpie import runtime
from magpie.cycle import promote
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


def run_installed(installed, env, *args, code=None):
    env = {**env, "PYTHONPATH": str(installed / "site")}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-c", "from magpie.cli import main; main()",
                                                    *args]
    return subprocess.run(cmd, cwd=installed, env=env, capture_output=True, text=True, timeout=120)


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
