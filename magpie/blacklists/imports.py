"""What an import does with listed routes: ``skip`` and ``remove`` workspaces do not take them (each line
is reported), ``flag`` workspaces take them flagged at once (the refresh job keeps the flags after that)."""

from __future__ import annotations

import ipaddress

import sqlalchemy as sa
from sqlalchemy.engine import Engine

BLACKLIST_REASON = "blacklisted: "
"""Start of the reason of an import line a blacklist kept out."""

_MATCH = """
    SELECT h, s.name, m.network FROM unnest(CAST(:hosts AS text[])) AS h
    JOIN LATERAL (
        SELECT e.source_id, e.network FROM blacklist_entries e
        JOIN blacklist_sources src ON src.id = e.source_id AND src.enabled
        WHERE e.network >>= CAST(h AS inet) ORDER BY e.source_id, masklen(e.network) DESC LIMIT 1
    ) m ON true
    JOIN blacklist_sources s ON s.id = m.source_id
"""
_FLAG = """
    INSERT INTO route_blacklist (route_id, source_id, network)
    SELECT r.id, m.source_id, m.network FROM routes r
    JOIN LATERAL (
        SELECT e.source_id, e.network FROM blacklist_entries e
        JOIN blacklist_sources s ON s.id = e.source_id AND s.enabled
        WHERE e.network >>= CAST(r.host AS inet) ORDER BY e.source_id, masklen(e.network) DESC LIMIT 1
    ) m ON true
    WHERE r.id = ANY(CAST(:ids AS bigint[]))
    ON CONFLICT (route_id) DO NOTHING
"""


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def workspace_policy(engine: Engine, workspace: str, default: str) -> str:
    """The blacklist policy of ``workspace`` (``default`` when it has none, or does not exist yet)."""
    with engine.connect() as conn:
        got = conn.execute(sa.text(
            "SELECT p.policy FROM blacklist_policies p JOIN workspaces w ON w.id = p.workspace_id "
            "WHERE w.name = :w"), {"w": workspace}).scalar()
    return got or default


def listed_hosts(engine: Engine, hosts: list[str], chunk: int = 5000) -> dict[str, tuple[str, str]]:
    """``{host: (source name, network)}`` for the IP-address ``hosts`` some enabled source lists."""
    ips = sorted({h for h in hosts if _is_ip(h)})
    out: dict[str, tuple[str, str]] = {}
    if not ips:
        return out
    with engine.connect() as conn:
        if not conn.execute(sa.text("SELECT EXISTS (SELECT 1 FROM blacklist_entries)")).scalar():
            return out
        for off in range(0, len(ips), chunk):
            for host, name, net in conn.execute(sa.text(_MATCH), {"hosts": ips[off:off + chunk]}):
                out[host] = (name, str(net))
    return out


def refusals(engine: Engine, workspace: str, routes, default: str) -> dict[int, str]:
    """Indexes of ``routes`` a ``skip``/``remove`` workspace does not take, with the line's reason."""
    policy = workspace_policy(engine, workspace, default)
    if policy == "flag":
        return {}
    hits = listed_hosts(engine, [r.host for r in routes])
    return {i: f"{BLACKLIST_REASON}{r.host} is in {hits[r.host][1]} of source '{hits[r.host][0]}' "
               f"(workspace policy {policy})"
            for i, r in enumerate(routes) if r.host in hits}


def flag_imported(engine: Engine, route_ids: list[int]) -> int:
    """Flag the just-imported routes that a source lists; returns how many were flagged now."""
    if not route_ids:
        return 0
    with engine.begin() as conn:
        if not conn.execute(sa.text("SELECT EXISTS (SELECT 1 FROM blacklist_entries)")).scalar():
            return 0
        ip_ids = [rid for rid, host in conn.execute(sa.text(
            "SELECT id, host FROM routes WHERE id = ANY(CAST(:ids AS bigint[]))"), {"ids": route_ids}) if _is_ip(host)]
        if not ip_ids:
            return 0
        return conn.execute(sa.text(_FLAG), {"ids": ip_ids}).rowcount


__all__ = ["BLACKLIST_REASON", "flag_imported", "listed_hosts", "refusals", "workspace_policy"]
