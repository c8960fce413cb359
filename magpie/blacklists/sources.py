"""Blacklist sources: what they may hold, reading them, and the operator's records (sources, policies).

A source is a text file or an ``http(s)`` URL (fetched through the egress guard, ``MAGPIE_ENRICH_ALLOW_PRIVATE``),
at most ``MAGPIE_BLACKLIST_MAX_BYTES``. One entry a line: an IPv4 or IPv6 address, a CIDR range
(``203.0.113.0/24``; host bits are cleared) or a dash range (``203.0.113.5-203.0.113.9``, stored as the
CIDRs covering it). Text after ``#`` or ``;`` is a comment (the DROP-list form ``192.0.2.0/24 ; SBL123``
reads as it is), as is anything after the first whitespace; blank lines are skipped; other lines are
counted as ``invalid`` and ignored. More than ``MAGPIE_BLACKLIST_MAX_ENTRIES`` distinct entries fail the
source's refresh.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.errors import MagpieError

_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class SourceError(MagpieError, ValueError):
    """A blacklist source cannot be added or read; the message says why in one line."""


@dataclass
class Parsed:
    """Entries of one source: distinct ``networks`` (input order), ``invalid`` lines, content ``digest``."""

    networks: list[Network]
    invalid: int
    digest: str


def parse_entries(data: bytes, max_entries: int) -> Parsed:
    """Parse a source's bytes (UTF-8, undecodable bytes replaced) into networks.

    Raises :class:`SourceError` when there are more than ``max_entries`` distinct entries."""
    seen: dict[Network, None] = {}
    invalid = 0
    for raw in data.decode("utf-8", errors="replace").split("\n"):
        text = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if not text:
            continue
        token = text.split()[0]
        try:
            if "-" in token and "/" not in token:
                first, last = (ipaddress.ip_address(p.strip()) for p in token.split("-", 1))
                nets = list(ipaddress.summarize_address_range(first, last))
            else:
                nets = [ipaddress.ip_network(token, strict=False)]
        except (ValueError, TypeError):
            invalid += 1
            continue
        for net in nets:
            seen[net] = None
        if len(seen) > max_entries:
            raise SourceError(f"more than {max_entries} entries (MAGPIE_BLACKLIST_MAX_ENTRIES)")
    return Parsed(list(seen), invalid, hashlib.sha256(data).hexdigest())


def is_url(location: str) -> bool:
    """True for an ``http://`` or ``https://`` location (else it is a file path)."""
    return location.lower().startswith(("http://", "https://"))


# Kernel and device trees a blacklist file is never read from
_SYSTEM_DIRS = ("/proc", "/sys", "/dev", "/boot", "/run", "/var/run")


def check_file(location: str) -> None:
    """Refuse a blacklist file path that is not an ordinary, public list file.

    The path is resolved (symbolic links followed); refused are the kernel and device trees (``/proc``,
    ``/sys``, ``/dev``, ...), hidden directories or files (``~/.ssh``), anything but a regular file, and a
    file not readable by every user (a blacklist is public data; ``/etc/shadow`` is a secret). Raises
    :class:`SourceError` naming the reason (never the file's content)."""
    import stat

    real = os.path.realpath(location)
    if any(real == d or real.startswith(d + "/") for d in _SYSTEM_DIRS):
        raise SourceError(f"refused file {location!r}: blacklists are not read from system directories")
    if any(part.startswith(".") for part in real.split("/") if part):
        raise SourceError(f"refused file {location!r}: blacklists are not read from hidden paths")
    try:
        st = os.stat(real)
    except OSError:
        return  # a missing file is reported when it is read
    if not stat.S_ISREG(st.st_mode):
        raise SourceError(f"refused file {location!r}: not a regular file")
    if not st.st_mode & stat.S_IROTH:
        raise SourceError(f"refused file {location!r}: not readable by every user (a blacklist is a public "
                          "list; chmod o+r it)")


def read_source(location: str, settings) -> bytes:
    """The bytes of a source: a file, or a URL fetched through the egress guard.

    Raises :class:`SourceError` (unreadable file, refused or failed URL, non-2xx reply, too large)."""
    limit = settings.blacklist_max_bytes
    if is_url(location):
        from magpie.base.egress import EgressPolicy
        from magpie.enrich.fetch import FetchError, get

        try:
            policy = EgressPolicy(settings.enrich_allow_private, "MAGPIE_ENRICH_ALLOW_PRIVATE")
            reply = get(location, policy=policy, timeout=settings.blacklist_fetch_timeout, max_bytes=limit)
        except FetchError as exc:
            raise SourceError(str(exc)) from None
        if not 200 <= reply.status < 300:
            raise SourceError(f"HTTP {reply.status} from the source URL")
        return reply.body
    check_file(location)
    try:
        size = os.path.getsize(location)
        if size > limit:
            raise SourceError(f"file is larger than {limit} bytes (MAGPIE_BLACKLIST_MAX_BYTES)")
        with open(location, "rb") as fh:
            return fh.read(limit + 1)
    except OSError as exc:
        raise SourceError(f"cannot read {location!r}: {exc.strerror or exc}") from None


def add_source(engine: Engine, name: str, location: str, settings=None) -> dict:
    """Add (or re-point and re-enable) the source ``name``. The next refresh reads it.

    Args:
        name: ``[a-z0-9][a-z0-9_.-]*``, at most 64 characters.
        location: a file path (made absolute) or an ``http(s)://`` URL without credentials.
        settings: when given, a URL's host is checked against ``MAGPIE_ENRICH_ALLOW_PRIVATE`` now (IP
            literals in any spelling, ``localhost``), not only at the first refresh.
    Returns:
        the source as :func:`list_sources` gives it.
    Raises:
        SourceError: bad name, URL with credentials, a file that does not exist or is not one a blacklist
        may be read from (:func:`check_file`). :class:`magpie.base.egress.EgressRefused`: a refused URL host.
    """
    if not _NAME.fullmatch(name or ""):
        raise SourceError(f"bad source name {name!r}: lower-case letters, digits, '_', '.', '-' (at most 64)")
    if is_url(location):
        from urllib.parse import urlsplit

        parts = urlsplit(location)
        if parts.username is not None or parts.password is not None:
            raise SourceError("source URL must not carry credentials")
        if not parts.hostname:
            raise SourceError("source URL has no host")
        if settings is not None:
            from magpie.base.egress import EgressPolicy

            EgressPolicy(settings.enrich_allow_private, "MAGPIE_ENRICH_ALLOW_PRIVATE").check_host(parts.hostname)
    else:
        location = os.path.abspath(location)
        if not os.path.isfile(location):
            raise SourceError(f"no such file: {location!r}")
        check_file(location)
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO blacklist_sources (name, location) VALUES (:n, :l) "
            "ON CONFLICT (name) DO UPDATE SET location = EXCLUDED.location, enabled = true, "
            "content_hash = CASE WHEN blacklist_sources.location = EXCLUDED.location "
            "THEN blacklist_sources.content_hash END"), {"n": name, "l": location})
    return next(s for s in list_sources(engine) if s["name"] == name)


def list_sources(engine: Engine) -> list[dict]:
    """Every source, by id: ``id``, ``name``, ``location`` (a URL's query is cut), ``enabled``,
    ``entries``, ``flagged`` (routes listed through it), ``refreshed_at``, ``last_error``, ``last_error_at``."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT s.id, s.name, s.location, s.enabled, s.entries, s.refreshed_at, s.last_error, "
            "s.last_error_at, (SELECT count(*) FROM route_blacklist b WHERE b.source_id = s.id) AS flagged "
            "FROM blacklist_sources s ORDER BY s.id")).mappings().all()
    out = []
    for r in rows:
        d = dict(r)
        if is_url(d["location"]):
            d["location"] = d["location"].split("?", 1)[0]  # a query may hold a token
        out.append(d)
    return out


def remove_source(engine: Engine, name: str) -> bool:
    """Delete source ``name`` with its entries and flags; True when it existed. Routes it had taken off
    the schedule go back on at the next refresh pass."""
    with engine.begin() as conn:
        return conn.execute(sa.text("DELETE FROM blacklist_sources WHERE name = :n"), {"n": name}).rowcount > 0


def set_policy(engine: Engine, workspace: str, policy: str) -> None:
    """Set what listed routes become in ``workspace``: ``flag``, ``skip`` or ``remove``.

    Raises :class:`SourceError` for an unknown workspace or policy."""
    from magpie.blacklists.models import POLICIES

    if policy not in POLICIES:
        raise SourceError(f"policy must be one of {', '.join(POLICIES)}")
    with engine.begin() as conn:
        wid = conn.execute(sa.text("SELECT id FROM workspaces WHERE name = :w"), {"w": workspace}).scalar()
        if wid is None:
            raise SourceError(f"no workspace {workspace!r}")
        conn.execute(sa.text(
            "INSERT INTO blacklist_policies (workspace_id, policy) VALUES (:w, :p) ON CONFLICT (workspace_id) "
            "DO UPDATE SET policy = EXCLUDED.policy, updated_at = now()"), {"w": wid, "p": policy})


def policies(engine: Engine, default: str) -> list[dict]:
    """``[{"workspace", "policy", "default": bool}]`` for every workspace (``default``: no row of its own)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT w.name, p.policy FROM workspaces w LEFT JOIN blacklist_policies p ON p.workspace_id = w.id "
            "ORDER BY w.name")).all()
    return [{"workspace": n, "policy": p or default, "default": p is None} for n, p in rows]


__all__ = ["Parsed", "SourceError", "add_source", "is_url", "list_sources", "parse_entries", "policies",
           "read_source", "remove_source", "set_policy"]
