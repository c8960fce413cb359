"""A check that finds no file descriptor left is the checker's fault, not the route's: it ends with
``judge_fault`` set (the pool retries the lease) instead of a dead result."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import asyncio, json, resource, socket
    from magpie.checker.engine import CheckEngine
    from magpie.base.routes import Route

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]

    async def main():
        engine = CheckEngine(f"http://127.0.0.1:{port}/", timeout=1.0, attempts=2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        held = []
        try:
            while True:
                held.append(socket.socket())
        except OSError:
            pass
        res = await engine.check(Route("http", "127.0.0.1", port))
        for s in held:
            s.close()
        again = await engine.check(Route("http", "127.0.0.1", port))  # descriptors back: a real verdict
        print(json.dumps([res.error, res.judge_fault, res.attempts, again.error, again.judge_fault]))

    asyncio.run(main())
''')


def test_a_check_without_a_free_descriptor_is_not_the_routes_fault():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    error, fault, attempts, again_error, again_fault = json.loads(out.stdout.strip().splitlines()[-1])
    assert (error, fault, attempts) == ("TooManyOpenFiles", True, 1)
    assert again_error == "ReadTimeout" and again_fault is False  # the listener never answers
    assert "no file descriptor left" in out.stderr
