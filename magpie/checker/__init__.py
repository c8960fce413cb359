"""Proxy checking: the asyncio check engine, anonymity grading, and the judge server.

Public API::

    CheckEngine(judge_url, timeout=10.0, attempts=2, body_cap=2048).check(route)  # coroutine -> CheckResult
    Checker(judge_url, ...).check(route) -> CheckResult          # synchronous face (own loop thread)
    check_many(routes, checker, concurrency=512) -> list[CheckResult]
    classify(echo, own_addresses) -> "transparent" | "anonymous" | "elite" | None
    make_judge_server(host, port) / run_judge(host, port)
"""

from magpie.checker.anonymity import PROXY_HEADERS, classify, normalize_ip
from magpie.checker.check import Checker, check_many
from magpie.checker.engine import CheckEngine
from magpie.checker.limits import checks_within_fd_limit
from magpie.checker.judge import make_judge_server, run_judge
from magpie.checker.result import CONNECTION_ERRORS, CheckResult, parse_echo, proxy_url

__all__ = [
    "CONNECTION_ERRORS",
    "PROXY_HEADERS",
    "CheckEngine",
    "CheckResult",
    "Checker",
    "check_many",
    "checks_within_fd_limit",
    "classify",
    "make_judge_server",
    "normalize_ip",
    "parse_echo",
    "proxy_url",
    "run_judge",
]
