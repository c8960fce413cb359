"""Container healthchecks for the compose file, standard library only (no magpie import, so they are cheap).

    python docker/healthcheck.py http URL          # an HTTP GET answering 2xx within 5 s
    python docker/healthcheck.py tcp HOST:PORT     # a TCP connect within 5 s
    python docker/healthcheck.py fresh GLOB SECONDS  # a file matching GLOB modified in the last SECONDS

Exit status 0 when healthy, 1 otherwise (one line on stderr saying why).
"""

from __future__ import annotations

import glob
import os
import socket
import sys
import time
import urllib.request

TIMEOUT_S = 5.0


def main(argv: list[str]) -> int:
    """Run the check named by ``argv[0]`` with its arguments; returns the exit status (0 healthy)."""
    try:
        kind, *args = argv
        if kind == "http":
            with urllib.request.urlopen(args[0], timeout=TIMEOUT_S) as resp:  # noqa: S310 - loopback only
                return 0 if 200 <= resp.status < 300 else 1
        if kind == "tcp":
            host, _, port = args[0].rpartition(":")
            socket.create_connection((host, int(port)), TIMEOUT_S).close()
            return 0
        if kind == "fresh":
            newest = max((os.path.getmtime(p) for p in glob.glob(args[0])), default=0.0)
            if time.time() - newest <= float(args[1]):
                return 0
            print(f"unhealthy: nothing matching {args[0]} written in {args[1]} s", file=sys.stderr)
            return 1
        print(f"unknown check {kind!r}: expected http, tcp or fresh", file=sys.stderr)
        return 2
    except (OSError, ValueError, IndexError) as exc:
        print(f"unhealthy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
