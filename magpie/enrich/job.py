"""Job ``geo_enrichment`` and the enrichment writes shared with the import.

A pass, under the job's leader lock, every write fenced:

1. looks at the GeoIP files now (:meth:`magpie.enrich.geo.GeoDatabases.refresh`; a new revision is
   announced to every process);
2. enriches, in batches of ``MAGPIE_MAINTENANCE_BATCH_SIZE`` by route id, every route whose host is an IP address
   and that has no ``route_enrichment`` row or one of an older revision (the cursor and the revision it
   belongs to are saved; a new revision restarts the sweep);
3. enriches the exit addresses the judges saw (``route_health.exit_ip``) the same way, into
   ``route_health.exit_country`` / ``exit_asn`` (ingestion enriches them as it writes them when the files
   are configured; this catches what it could not, and a new revision);
4. when an abuse provider is configured, scores routes never scored or scored longer ago than
   ``MAGPIE_ABUSE_CACHE_TTL``, until the provider's rate limit says wait (the rest is left to the next pass).

Unconfigured (no GeoIP file, no abuse key): the pass does nothing and says so. A file that cannot be read
fails the pass (recorded in ``maintenance_runs``). A second pass right after a complete one writes nothing.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import sqlalchemy as sa

from magpie.maintenance.base import Job, JobContext

log = logging.getLogger(__name__)

_IP_HOST = "(r.host ~ '^[0-9.]+$' OR strpos(r.host, ':') > 0)"
_UPSERT = """
    INSERT INTO route_enrichment (route_id, country, asn, as_org, network_type, geo_revision, enriched_at)
    SELECT i, c, a, o, t, :rev, now()
    FROM unnest(CAST(:ids AS bigint[]), CAST(:c AS text[]), CAST(:a AS bigint[]), CAST(:o AS text[]),
                CAST(:t AS text[])) AS x(i, c, a, o, t)
    ON CONFLICT (route_id) DO UPDATE SET country = EXCLUDED.country, asn = EXCLUDED.asn,
        as_org = EXCLUDED.as_org, network_type = EXCLUDED.network_type, geo_revision = EXCLUDED.geo_revision,
        enriched_at = now()
"""
_STALE = f"""
    SELECT r.id, r.host FROM routes r LEFT JOIN route_enrichment e ON e.route_id = r.id
    WHERE r.id > :after AND {_IP_HOST} AND (e.route_id IS NULL OR e.geo_revision IS DISTINCT FROM :rev)
    ORDER BY r.id LIMIT :batch
"""
_ABUSE_DUE = f"""
    SELECT r.id, r.host FROM routes r LEFT JOIN route_enrichment e ON e.route_id = r.id
    WHERE {_IP_HOST} AND (e.abuse_checked_at IS NULL OR e.abuse_checked_at < :before)
    ORDER BY e.abuse_checked_at NULLS FIRST, r.id LIMIT :batch
"""
_ABUSE_SET = """
    INSERT INTO route_enrichment (route_id, abuse_score, abuse_checked_at) VALUES (:i, :s, now())
    ON CONFLICT (route_id) DO UPDATE SET abuse_score = EXCLUDED.abuse_score, abuse_checked_at = now()
"""


_EXIT_STALE = """
    SELECT route_id, exit_ip FROM route_health
    WHERE route_id > :after AND exit_ip IS NOT NULL AND exit_geo_revision IS DISTINCT FROM :rev
    ORDER BY route_id LIMIT :batch
"""
_EXIT_SET = """
    UPDATE route_health AS h SET exit_country = x.c, exit_asn = x.a, exit_geo_revision = :rev
    FROM unnest(CAST(:ids AS bigint[]), CAST(:ips AS text[]), CAST(:c AS text[]), CAST(:a AS bigint[]))
         AS x(i, ip, c, a)
    WHERE h.route_id = x.i AND h.exit_ip = x.ip
"""


def write_exit_geo(conn: sa.Connection, geo, rows) -> int:
    """Look up and store the exit enrichment of ``rows`` (``(route_id, exit_ip)``) at ``geo``'s revision
    (a row whose exit address changed meanwhile is left alone); returns the rows looked up. Raises
    :class:`magpie.enrich.geo.GeoError` for an unreadable file."""
    ids, ips, c, a = [], [], [], []
    for rid, ip in rows:
        info = geo.lookup(ip)
        ids.append(rid)
        ips.append(ip)
        c.append(info.country if info else None)
        a.append(info.asn if info else None)
    if ids:
        conn.execute(sa.text(_EXIT_SET), {"ids": ids, "ips": ips, "c": c, "a": a, "rev": geo.revision})
    return len(ids)


def write_geo(conn: sa.Connection, geo, rows) -> int:
    """Look up and store the enrichment of ``rows`` (``(route_id, host)``) at ``geo``'s revision; returns
    the rows written. Raises :class:`magpie.enrich.geo.GeoError` for an unreadable file."""
    ids, c, a, o, t = [], [], [], [], []
    for rid, host in rows:
        info = geo.lookup(host)
        if info is None:
            continue
        ids.append(rid)
        c.append(info.country)
        a.append(info.asn)
        o.append(info.as_org)
        t.append(info.network_type)
    if ids:
        conn.execute(sa.text(_UPSERT), {"ids": ids, "c": c, "a": a, "o": o, "t": t, "rev": geo.revision})
    return len(ids)


def enrich_imported(engine, settings, route_ids: list[int], redis=None) -> int:
    """Enrich just-imported routes when GeoIP files are configured; returns the routes enriched.

    Never fails an import: an unreadable file is logged (one line) and left to the ``geo_enrichment`` job."""
    from magpie.enrich.geo import GeoError, shared

    geo = shared(settings, redis)
    if not geo.configured or not route_ids:
        return 0
    try:
        geo.refresh()
        with engine.begin() as conn:
            rows = conn.execute(sa.text("SELECT id, host FROM routes r WHERE id = ANY(CAST(:ids AS bigint[])) "
                                        f"AND {_IP_HOST}"), {"ids": list(route_ids)}).all()
            return write_geo(conn, geo, rows)
    except GeoError as exc:
        log.warning("import: enrichment left to the geo_enrichment job: %s", exc)
        return 0


def _abuse(ctx: JobContext, client, out: dict) -> None:
    from magpie.enrich.abuse import AbuseError, RateLimited

    before = ctx.now - timedelta(seconds=ctx.settings.abuse_cache_ttl)
    while not ctx.should_stop():
        with ctx.engine.connect() as conn:
            rows = conn.execute(sa.text(_ABUSE_DUE), {"before": before,
                                                      "batch": ctx.batch_size}).all()
        if not rows:
            return
        scored = []
        for rid, host in rows:
            try:
                scored.append((rid, client.score(host).score))
            except RateLimited:
                out["abuse_rate_limited"] = True
                break
            except AbuseError as exc:
                out["abuse_errors"] += 1
                out["abuse_last_error"] = str(exc)[:300]
        if scored:
            with ctx.engine.begin() as conn:
                ctx.fence(conn)
                for rid, score in scored:
                    conn.execute(sa.text(_ABUSE_SET), {"i": rid, "s": score})
            out["abuse_scored"] += len(scored)
        ctx.tick()
        if out["abuse_rate_limited"] or len(scored) < len(rows):
            return


class GeoEnrichmentJob(Job):
    name = "geo_enrichment"
    every = 86400.0
    description = "country, ASN and network type from the GeoIP files (new file: re-enrich); abuse scores"

    def run(self, ctx: JobContext) -> dict:
        from magpie.enrich.abuse import provider
        from magpie.enrich.geo import shared

        geo = shared(ctx.settings, ctx.redis)
        client = provider(ctx.settings)
        out: dict = {"enriched": 0, "abuse_scored": 0, "abuse_errors": 0, "abuse_rate_limited": False}
        if not geo.configured and client is None:
            return {**out, "skipped": "no GeoIP database and no abuse provider configured", "complete": True}
        complete = True
        if geo.configured:
            out["revision_changed"] = geo.refresh(force=True)
            out["revision"] = geo.revision
            after = int(ctx.state.get("after", 0)) if ctx.state.get("revision") == geo.revision else 0
            complete = False
            while not ctx.should_stop():
                with ctx.engine.begin() as conn:
                    ctx.fence(conn)
                    rows = conn.execute(sa.text(_STALE), {"after": after, "rev": geo.revision,
                                                          "batch": ctx.batch_size}).all()
                    out["enriched"] += write_geo(conn, geo, rows)
                    if rows:
                        after = rows[-1][0]
                    complete = len(rows) < ctx.batch_size
                    ctx.save_state({"after": 0 if complete else after, "revision": geo.revision}, conn)
                ctx.tick()
                if complete:
                    break
            out["exits_enriched"] = 0
            exit_after = int(ctx.state.get("exit_after", 0)) if ctx.state.get("revision") == geo.revision else 0
            exits_done = False
            while complete and not ctx.should_stop():
                with ctx.engine.begin() as conn:
                    ctx.fence(conn)
                    rows = conn.execute(sa.text(_EXIT_STALE), {"after": exit_after, "rev": geo.revision,
                                                               "batch": ctx.batch_size}).all()
                    out["exits_enriched"] += write_exit_geo(conn, geo, rows)
                    if rows:
                        exit_after = rows[-1][0]
                    exits_done = len(rows) < ctx.batch_size
                    ctx.save_state({"after": 0, "exit_after": 0 if exits_done else exit_after,
                                    "revision": geo.revision}, conn)
                ctx.tick()
                if exits_done:
                    break
            complete = complete and exits_done
        if client is not None:
            _abuse(ctx, client, out)
            complete = complete and not out["abuse_rate_limited"]
        out["complete"] = complete
        return out


JOB = GeoEnrichmentJob()
