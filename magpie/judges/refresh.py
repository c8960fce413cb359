"""Job ``judge_refresh``: re-resolve every judge's host name and probe each judge directly.

Under its leader lock, every pass takes the enabled judges (at most ``MAGPIE_MAINTENANCE_BATCH_SIZE``),
resolves their host names (addresses stored with their TTL, ``MAGPIE_DNS_TTL``), and probes them all at
once with one direct GET each (``MAGPIE_JUDGE_PROBE_TIMEOUT``; the egress guard applies, as for checks).
A judge that fails is marked unhealthy with the reason (error class, HTTP status); one that answers by
its rule is healthy again. When any verdict changed, the config revision is raised and published in the
same fenced transaction, so checkers drop (or take back) the judge within a reconcile cadence.
"""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

import sqlalchemy as sa

from magpie.maintenance.base import Job, JobContext

_JUDGES = "SELECT id, url, scheme, rule FROM judges WHERE enabled AND id > :after ORDER BY id LIMIT :batch"


async def probe_judge(url: str, rule: str, settings) -> tuple[bool, str | None, list[str] | None]:
    """``(ok, reason, addresses)`` of one direct probe of the judge at ``url`` (see the module doc)."""
    from magpie.checker.engine import CheckEngine
    from magpie.checker.tls import judge_ssl_context
    from magpie.base.egress import EgressPolicy, is_ip_literal

    host = urlsplit(url).hostname or ""
    addresses: list[str] | None = None
    if is_ip_literal(host):
        addresses = [host]
    else:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
            addresses = list(dict.fromkeys(i[4][0] for i in infos))
        except OSError as exc:
            return False, f"DNS: {exc}"[:300], []
    tls = judge_ssl_context(settings.judge_ca_bundle) if url.startswith("https:") else None
    eng = CheckEngine(url, settings.judge_probe_timeout, 1, 0, rule=rule, ssl_context=tls,
                      egress=EgressPolicy(settings.check_allow_private, "MAGPIE_CHECK_ALLOW_PRIVATE"))
    ok, reason = await eng.probe()
    return ok, reason, addresses


async def probe_all(rows, settings) -> list[tuple[bool, str | None, list[str] | None]]:
    """:func:`probe_judge` of every row (``url``, ``rule`` attributes) at once, in row order."""
    return list(await asyncio.gather(*(probe_judge(r.url, r.rule, settings) for r in rows)))


class JudgeRefreshJob(Job):
    name = "judge_refresh"
    every = 30.0
    description = "re-resolve judge host names, probe each judge, mark failing ones unhealthy and back"

    def run(self, ctx: JobContext) -> dict:
        from magpie.judges.store import bump, notify, record_health

        after, probed, unhealthy, changed = 0, 0, 0, 0
        while not ctx.should_stop():
            with ctx.engine.connect() as conn:
                rows = conn.execute(sa.text(_JUDGES), {"after": after, "batch": ctx.batch_size}).all()
            if not rows:
                break
            after = rows[-1].id

            verdicts = asyncio.run(probe_all(rows, ctx.settings))
            rev = None
            with ctx.engine.begin() as conn:
                ctx.fence(conn)
                moved = 0
                for r, (ok, reason, addrs) in zip(rows, verdicts):
                    moved += record_health(conn, r.id, ok, reason, addrs, ctx.settings.dns_ttl)
                    unhealthy += not ok
                if moved:
                    rev = bump(conn)
            if rev is not None:
                notify(ctx.redis, ctx.settings.redis_prefix, rev)
            probed += len(rows)
            changed += moved
            ctx.tick()
            if len(rows) < ctx.batch_size:
                return {"probed": probed, "unhealthy": unhealthy, "changed": changed, "complete": True}
        return {"probed": probed, "unhealthy": unhealthy, "changed": changed, "complete": not rows}


JOB = JudgeRefreshJob()
