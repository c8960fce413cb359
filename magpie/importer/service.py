"""``magpie import``: parse a proxy list, store routes in PostgreSQL, schedule them in Redis.

Order matters for "nothing already stored is lost": PostgreSQL first (routes, encrypted credentials,
workspace membership), then the Redis schedule, whose script never resets a stored route's due time and
only merges the importing workspace into an existing payload.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from magpie.config import Settings
from magpie.crypto import get_keyring
from magpie.errors import MagpieError
from magpie.importer.parse import Refuse, parse_file

CHUNK = 5000


class ImportIncomplete(MagpieError, RuntimeError):
    """PostgreSQL took the routes but Redis did not schedule them all; re-running the import completes it."""


@dataclass
class ImportReport:
    """What an import did. ``valid``: unique good routes in the file; ``imported``: routes newly stored
    for the workspace (0 on a dry run); ``duplicates``: repeats within the file plus routes the workspace
    already had; ``skipped``: blank, comment and prose lines; ``invalid``: ``[{"line", "reason"}]``, malformed
    lines and lines the egress guard refuses; ``refused``: how many of ``invalid`` the guard refused."""

    valid: int = 0
    imported: int = 0
    duplicates: int = 0
    skipped: int = 0
    invalid: list[dict] = field(default_factory=list)
    refused: int = 0

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
    from magpie.egress import EgressPolicy, EgressRefused

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


def schedule_item(record, cipher=None) -> tuple[str, str]:
    """The schedule entry of a stored route, as :meth:`magpie.queue.RouteQueue.schedule` takes it.

    Args:
        record: a :class:`magpie.db.repo.RouteRecord` (or :class:`~magpie.db.repo.StoredRoute`).
        cipher: a :class:`magpie.crypto.QueueCipher` to seal the credentials with, or None for plaintext;
            pass :func:`magpie.queue.payload.write_cipher` of the settings
            (``PROXY_QUEUE_ENCRYPT_CREDENTIALS``).
    Returns:
        ``(route_hash, payload JSON text)`` (see :mod:`magpie.queue.payload`).
    """
    from magpie.queue.payload import Payload

    payload = Payload(record.route_id, record.route, record.route_hash, list(record.workspace_ids))
    return record.route_hash.strip(), payload.encode(cipher)


def import_file(path, workspace: str, settings: Settings, *, protocol: str = "http", dry_run: bool = False,
                progress: Callable[[int, int], None] | None = None, queue=None, engine=None) -> ImportReport:
    """Import the proxy list at ``path`` into ``workspace``.

    Args:
        protocol: scheme for lines without one (http, https, socks4, socks5).
        progress: called as ``progress(done, total)`` after each chunk of routes is stored and scheduled.
        queue / engine: a :class:`RouteQueue` and SQLAlchemy engine (default: from ``settings``).
    Raises ``ValueError`` for an unknown default protocol or an empty workspace name; ``OSError`` when the
    file cannot be read; :class:`ImportIncomplete` when Redis failed after PostgreSQL stored routes (Redis is
    checked before anything is stored, so this needs Redis to fail mid-import). Malformed lines never raise: they are reported in ``invalid``,
    and so are routes the egress guard refuses (:func:`egress_refusal`), on a dry run too.
    """
    if not workspace or not workspace.strip():
        raise ValueError("workspace name must not be empty")
    parsed = parse_file(path, default_protocol=protocol, refuse=egress_refusal(settings))
    report = ImportReport(
        valid=parsed.valid, duplicates=parsed.duplicates, skipped=parsed.skipped,
        invalid=[{"line": x.line, "reason": x.reason} for x in parsed.invalid],
        refused=sum(x.reason.startswith(EGRESS_REASON) for x in parsed.invalid),
    )
    if dry_run or not parsed.routes:
        return report

    from magpie.db.repo import upsert_routes
    from magpie.db.session import get_engine
    from magpie.queue import RouteQueue
    from magpie.queue.payload import write_cipher

    engine = engine or get_engine(settings.database_url)
    queue = queue or RouteQueue.from_settings(settings)
    keyring = get_keyring(settings.encryption_key)
    cipher = write_cipher(settings)  # PROXY_QUEUE_ENCRYPT_CREDENTIALS: seal credentials in new payloads
    total = len(parsed.routes)
    for off in range(0, total, CHUNK):
        chunk = parsed.routes[off: off + CHUNK]
        store = upsert_routes(engine, keyring, workspace.strip(), chunk)
        report.imported += len(store.new_members)
        report.duplicates += len(store.already_members)
        items = [schedule_item(row, cipher) for row in store.routes]
        try:
            queue.schedule(items, total=total, start_index=off)
        except Exception as exc:
            raise ImportIncomplete(
                f"{off + len(chunk)} of {total} routes are stored in PostgreSQL but not all are scheduled in Redis "
                f"({exc.__class__.__name__}: {exc}); re-run the same import (it is idempotent) or "
                "`magpie queue rebuild` once Redis is back") from exc
        if progress:
            progress(min(off + CHUNK, total), total)
    return report
