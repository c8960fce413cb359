"""Proxy checking: one check of one route against a judge, anonymity grading, and the judge server.

Public API::

    Checker(judge_url, timeout=10.0, attempts=2, body_cap=2048).check(route) -> CheckResult
    check_many(routes, checker, concurrency=16) -> list[CheckResult]
    classify(echo, own_addresses) -> "transparent" | "anonymous" | "elite" | None
    make_judge_server(host, port) / run_judge(host, port)
"""

from magpie.checker.anonymity import PROXY_HEADERS, classify, normalize_ip
from magpie.checker.check import CONNECTION_ERRORS, Checker, CheckResult, check_many, proxy_url
from magpie.checker.judge import make_judge_server, run_judge

__all__ = [
    "CONNECTION_ERRORS",
    "PROXY_HEADERS",
    "CheckResult",
    "Checker",
    "check_many",
    "classify",
    "make_judge_server",
    "normalize_ip",
    "proxy_url",
    "run_judge",
]
