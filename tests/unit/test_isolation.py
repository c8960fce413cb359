"""The isolated check process: an answer is a result, a death is a crash, a hang is killed."""

from __future__ import annotations

import asyncio
import json
import sys

import psutil
import pytest

from magpie.checker.result import CheckResult
from magpie.pipeline.isolation import IsolatedCrash, check_isolated

ANSWER = {"alive": True, "latency_ms": 12.5, "status": 200, "attempts": 1, "error": None, "body": "{}",
          "anonymity": "elite", "judge": "http://127.0.0.1:1/", "checked_at_ms": 1}


def child(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", "import json, os, signal, sys, time\nreq = json.loads(sys.stdin.readline())\n" + code)


def test_the_answer_line_is_the_check_result():
    code = f"assert req['payload'] == 'p:secret'\nprint(json.dumps({ANSWER!r}), flush=True)"
    res = asyncio.run(check_isolated("p:secret", 20, child(code)))
    assert res == CheckResult(**ANSWER)


def test_a_process_killed_under_the_check_is_a_crash_with_its_signal():
    with pytest.raises(IsolatedCrash) as err:
        asyncio.run(check_isolated("p", 20, child("os.kill(os.getpid(), signal.SIGKILL)")))
    assert err.value.returncode == -9


def test_a_garbled_answer_is_a_crash_not_a_result():
    with pytest.raises(IsolatedCrash):
        asyncio.run(check_isolated("p", 20, child("print('not json', flush=True)\nsys.exit(1)")))


def test_a_hung_process_is_killed_at_the_timeout(tmp_path):
    pidfile = tmp_path / "pid"

    async def run():
        code = f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
        with pytest.raises(TimeoutError):
            await check_isolated("p", 2.0, child(code))
    asyncio.run(run())
    pid = int(pidfile.read_text())  # the child ran; it must be gone (or a zombie not yet reaped)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_child_given_no_request_exits_without_an_answer():
    """The real child: its stdin closed before a request ends it (exit status 3, no answer)."""
    import subprocess

    p = subprocess.run([sys.executable, "-m", "magpie.wiring.runtime"], input=b"", capture_output=True, timeout=60)
    assert p.returncode == 3 and p.stdout == b""
