"""``magpie import``: parse a proxy list, store routes in PostgreSQL, schedule them in Redis.

Order matters for "nothing already stored is lost": PostgreSQL first (routes, encrypted credentials,
workspace membership), then the Redis schedule, whose script never resets a stored route's due time and
only merges the importing workspace into an existing payload.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from magpie.config import Settings
from magpie.base.crypto import get_keyring
from magpie.errors import MagpieError
from magpie.importer.parse import Refuse, parse_file
from magpie.queue.payload import schedule_item

CHUNK = 5000


class ImportIncomplete(MagpieError, RuntimeError):
    """PostgreSQL took the routes but the schedule did not take them all; re-running the import (or the
    rebuild job) completes it. ``report`` is the :class:`ImportReport` of what was done (``stored``,
    ``scheduled``, ``schedule_error``)."""

    def __init__(self, message: str, report: ImportReport | None = None):
        super().__init__(message)
        self.report = report


@dataclass
class ImportReport:
    """What an import did. ``valid``: unique good routes in the file; ``imported``: routes newly stored
    for the workspace (0 on a dry run); ``duplicates``: repeats within the file plus routes the workspace
    already had; ``skipped``: blank, comment and prose lines; ``invalid``: ``[{"line", "reason"}]``, malformed
    lines and lines the egress guard refuses; ``refused``: how many of ``invalid`` the guard refused;
    ``blacklisted``: how many of ``invalid`` a blacklist kept out (workspace policy ``skip`` or ``remove``;
    not counted in ``valid``); ``flagged``: imported routes a blacklist lists (policy ``flag``);
    ``enriched``: routes new to the workspace given country/ASN from the GeoIP files (when configured);
    ``stored``: routes of the file now stored for the workspace in PostgreSQL (new or already there);
    ``scheduled``: of those, how many the schedule took; ``schedule_error``: one line naming why the rest
    were not scheduled (e.g. ``Redis refuses writes: used_memory ... over maxmemory ...``), else None."""

    valid: int = 0
    imported: int = 0
    duplicates: int = 0
    skipped: int = 0
    invalid: list[dict] = field(default_factory=list)
    refused: int = 0
    blacklisted: int = 0
    flagged: int = 0
    enriched: int = 0
    stored: int = 0
    scheduled: int = 0
    schedule_error: str | None = None

    def as_json(self) -> dict:
        return asdict(self)


EGRESS_REASON = "refused by the egress guard: "


def egress_refusal(settings: Settings) -> Refuse:
    """The import's egress check, for :func:`magpie.importer.parse.parse_file`'s ``refuse``.

    A route whose host is an IP literal (or a ``localhost`` name) outside ``MAGPIE_CHECK_ALLOW_PRIVATE``
    gets a reason starting with :data:`EGRESS_REASON` (one line, naming the address and the setting); other
    host names pass here and are checked after resolution, before any connection. Cached per host.
    Raises ``ValueError`` for a malformed setting.
    """
    from magpie.base.egress import EgressPolicy, EgressRefused

    policy = EgressPolicy(settings.check_allow_private, "MAGPIE_CHECK_ALLOW_PRIVATE")
    seen: dict[str, str | None] = {}

    def refuse(route) -> str | None:
        host = route.host
        if host not in seen:
            try:
                policy.check_host(host)
                seen[host] = None
            except EgressRefused as exc:
                why = str(exc).removeprefix("destination refused: ")
                seen[host] = EGRESS_REASON + (why if why.startswith(host) else f"{host}: {why}")
            if len(seen) > 65536:
                seen.clear()
        return seen.get(host)

    return refuse


class SchemaMissing(MagpieError, RuntimeError):
    """The database has no (or an outdated) magpie schema; the message says to run ``magpie db upgrade``."""


_IMPORT_TABLES = ("workspaces", "routes", "route_workspaces", "blacklist_entries", "blacklist_policies",
                  "route_blacklist")


def require_schema(engine) -> None:
    """Check that the tables an import writes exist, before anything is read from the list's routes.

    Raises :class:`SchemaMissing` (one line: which table, and ``run magpie db upgrade``) when one is
    missing, and when the database itself does not exist (``magpie db upgrade`` creates it too).
    """
    import sqlalchemy as sa
    from sqlalchemy import exc as sa_exc

    try:
        with engine.connect() as conn:
            for table in _IMPORT_TABLES:
                if conn.execute(sa.text("SELECT to_regclass(:t)"), {"t": f"public.{table}"}).scalar() is None:
                    raise SchemaMissing(f"the database is not migrated (no {table} table): "
                                        "run `magpie db upgrade`")
    except sa_exc.OperationalError as exc:
        first = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        if "does not exist" in first:
            raise SchemaMissing(f"{first}: run `magpie db upgrade` (it creates the database)") from None
        raise


def import_file(path, workspace: str, settings: Settings, *, protocol: str = "http", dry_run: bool = False,
                progress: Callable[[int, int], None] | None = None, queue=None, engine=None,
                fmt: str = "auto", on_stored: Callable[[list[int]], None] | None = None) -> ImportReport:
    """Import the proxy list at ``path`` (a file name, or an open binary stream such as stdin) into
    ``workspace``.

    Args:
        protocol: scheme for lines without one (one of :data:`magpie.base.protocols.PROTOCOLS`).
        fmt: what ``host:port:a:b`` means (:data:`magpie.importer.formats.FORMATS`; ``auto`` refuses the
            line when a field looks like a country or anonymity code).
        progress: called as ``progress(done, total)`` after each chunk of routes is stored and scheduled.
        queue / engine: a :class:`RouteQueue` and SQLAlchemy engine (default: from ``settings``).
        on_stored: called with the route ids of each chunk once PostgreSQL stored it for the workspace.
    Raises ``ValueError`` for an unknown default protocol or format, an empty workspace name or one with
    control characters; ``OSError``
    when the file cannot be read; :class:`SchemaMissing` when the database is not migrated (checked
    before anything is stored); :class:`ImportIncomplete` (carrying the report) when the schedule refused
    routes PostgreSQL stored (e.g. Redis at ``maxmemory``): every chunk is still stored, none after the
    refusal is scheduled, and the rebuild job or a re-run schedules them. Malformed lines never raise: they
    are reported in ``invalid``,
    and so are routes the egress guard refuses (:func:`egress_refusal`), on a dry run too.
    """
    if not workspace or not workspace.strip():
        raise ValueError("workspace name must not be empty")
    if any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in workspace):
        raise ValueError("workspace name must not hold control characters (NUL, terminal escapes)")
    parsed = parse_file(path, default_protocol=protocol, refuse=egress_refusal(settings), fmt=fmt)
    report = ImportReport(
        valid=parsed.valid, duplicates=parsed.duplicates, skipped=parsed.skipped,
        invalid=[{"line": x.line, "reason": x.reason} for x in parsed.invalid],
        refused=sum(x.reason.startswith(EGRESS_REASON) for x in parsed.invalid),
    )
    if dry_run or not parsed.routes:
        return report

    from magpie.blacklists.imports import flag_imported
    from magpie.blacklists.imports import refusals as blacklist_refusals
    from magpie.db.repo import upsert_routes
    from magpie.enrich.job import enrich_imported
    from magpie.derived.sources import record_import_source
    from magpie.db.session import get_engine
    from magpie.queue.payload import write_cipher
    from magpie.queue.provider import create_provider

    engine = engine or get_engine(settings.database_url)
    require_schema(engine)
    routes = parsed.routes
    kept_out = blacklist_refusals(engine, workspace.strip(), routes, settings.blacklist_policy)
    if kept_out:  # workspace policy skip / remove: listed routes are not taken, each line says why
        report.invalid.extend({"line": parsed.lines[i], "reason": why} for i, why in kept_out.items())
        report.invalid.sort(key=lambda x: x["line"])
        report.blacklisted = len(kept_out)
        report.valid -= len(kept_out)
        routes = [r for i, r in enumerate(routes) if i not in kept_out]
        if not routes:
            return report
    queue = queue or create_provider(settings.schedule_url, settings)
    keyring = get_keyring(settings.encryption_key)
    cipher = write_cipher(settings)  # PROXY_QUEUE_ENCRYPT_CREDENTIALS: seal credentials in new payloads
    total = len(routes)
    fresh = _fresh_deployment(engine, queue)
    for off in range(0, total, CHUNK):
        chunk = routes[off: off + CHUNK]
        store = upsert_routes(engine, keyring, workspace.strip(), chunk)
        record_import_source(engine, store.workspace_id, [r.route_id for r in store.routes], path)
        if on_stored is not None:
            on_stored([r.route_id for r in store.routes])
        report.imported += len(store.new_members)
        report.duplicates += len(store.already_members)
        report.flagged += flag_imported(engine, [row.route_id for row in store.routes])
        report.enriched += enrich_imported(engine, settings, [row.route_id for row in store.new_members])
        report.stored += len(store.routes)
        if report.schedule_error is None:  # once the schedule refused, the rest is only stored
            items = [schedule_item(row, cipher) for row in store.routes]
            try:
                queue.schedule(items, total=total, start_index=off)
                report.scheduled += len(items)
            except Exception as exc:  # noqa: BLE001 - reported with the counts below
                report.schedule_error = _schedule_refusal(queue, exc)
        if progress:
            progress(min(off + CHUNK, total), total)
    if report.schedule_error is not None:
        raise ImportIncomplete(
            f"stored {report.stored} routes in PostgreSQL, scheduled {report.scheduled}: "
            f"{report.schedule_error}; "
            "re-run the same import (it is idempotent) or `magpie queue rebuild` once the schedule takes "
            "writes",
            report)
    if fresh:  # the schedule now holds everything PostgreSQL owns: nothing for the rebuild job to restore
        from magpie.maintenance.marker import mark_bootstrapped

        mark_bootstrapped(queue)
    return report


def _schedule_refusal(queue, exc: BaseException) -> str:
    """One line for a failed schedule write, naming Redis's memory state when Redis refused it."""
    client = getattr(queue, "r", None)
    if client is not None:
        from magpie.queue.redis_policy import refusal_line

        return refusal_line(client, exc)
    first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
    return f"schedule error: {exc.__class__.__name__}: {first}"


def _fresh_deployment(engine, queue) -> bool:
    """True when the schedule has no rebuild marker and PostgreSQL owns no route yet (a new deployment):
    the first import is then the whole schedule, and marking it bootstrapped keeps the ``rebuild`` job from
    restoring routes an operator removes later. A lost schedule (no marker, owned routes) stays unmarked."""
    from magpie.maintenance.marker import marker_key, owned_routes

    r = getattr(queue, "r", None)
    if r is None or getattr(queue, "keys", None) is None or r.exists(marker_key(queue)):
        return False
    return owned_routes(engine) == 0
