"""Rotators as data: add, update, remove and list rows of ``rotators``, with typed refusals.

Every change bumps the row's ``revision`` in the same transaction and then publishes the rotator's id on
the Redis channel :func:`channel` (a hint only: rotator processes also reconcile on a cadence, so a lost
notification still converges). Passwords are encrypted with :meth:`magpie.base.crypto.Keyring.encrypt` and
never returned or printed; listings show ``auth: yes/no``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from magpie.config import ConfigError
from magpie.db.models import Workspace
from magpie.errors import MagpieError, Refusal, RefusedError
from magpie.rotator.models import LISTEN_PROTOCOLS, POLICIES, Rotator
from magpie.base.protocols import PROTOCOLS

FILTER_KEYS = ("protocols", "anonymity", "max_latency_ms", "reputation", "country", "allowed_ports",
               "exit_country")
ANONYMITY = ("transparent", "anonymous", "elite")
REPUTATION = ("good", "neutral", "poor")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class RotatorError(MagpieError, ValueError):
    """A malformed rotator request (bad name, protocol, filter or policy); the message names the field."""


def channel(prefix: str) -> str:
    """The Redis pub/sub channel rotator changes are announced on (``<prefix>rotators:changed``)."""
    return f"{prefix}rotators:changed"


def port_range(text: str) -> tuple[int, int]:
    """``"A-B"`` -> ``(A, B)`` (inclusive). Raises :class:`ConfigError` naming ``MAGPIE_ROTATOR_PORTS``."""
    m = re.fullmatch(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*", text or "")
    if not m:
        raise ConfigError(f"MAGPIE_ROTATOR_PORTS: expected a range such as 20000-20100, got {text!r}")
    lo, hi = int(m.group(1)), int(m.group(2))
    if not 1 <= lo <= hi <= 65535:
        raise ConfigError(f"MAGPIE_ROTATOR_PORTS: {lo}-{hi} is not a range within 1-65535")
    return lo, hi


def parse_listen(value: str | Iterable[str]) -> str:
    """Normalise listen protocols (``"http,socks5"``) to the stored form; raises :class:`RotatorError`."""
    items = [v.strip().lower() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    bad = [v for v in items if v not in LISTEN_PROTOCOLS]
    if not items or bad:
        raise RotatorError(f"listen: expected one or more of {', '.join(LISTEN_PROTOCOLS)}, got {value!r}")
    return ",".join(p for p in LISTEN_PROTOCOLS if p in items)


def check_filters(filters: dict) -> dict:
    """Validate a filter dict (keys :data:`FILTER_KEYS`); returns it normalised. ``allowed_ports`` is
    not a route filter: it replaces ``MAGPIE_ROTATOR_ALLOWED_PORTS`` as the destination ports this
    rotator tunnels to (``"80,443,8000-8100"``).

    Raises :class:`RotatorError` naming the key and the accepted values."""
    out: dict = {}
    for key, value in (filters or {}).items():
        if key not in FILTER_KEYS:
            raise RotatorError(f"filter {key!r}: unknown (accepted: {', '.join(FILTER_KEYS)})")
        if value in (None, "", []):
            continue
        if key in ("protocols", "anonymity", "country", "exit_country"):
            items = [str(v).strip().lower() for v in (value.split(",") if isinstance(value, str) else value)]
            allowed = {"protocols": PROTOCOLS, "anonymity": ANONYMITY}.get(key)
            if allowed and any(v not in allowed for v in items):
                raise RotatorError(f"filter {key}: expected values among {', '.join(allowed)}, got {value!r}")
            countries = key in ("country", "exit_country")
            if countries and any(not re.fullmatch(r"[a-z]{2}", v) for v in items):
                raise RotatorError(f"filter {key}: expected two-letter country codes, got {value!r}")
            out[key] = [v.upper() for v in items] if countries else items
        elif key == "max_latency_ms":
            try:
                ms = float(value)
            except (TypeError, ValueError):
                raise RotatorError(f"filter max_latency_ms: expected a number of ms, got {value!r}") from None
            if not 0 < ms <= 600_000:
                raise RotatorError(f"filter max_latency_ms: expected 0 < ms <= 600000, got {value!r}")
            out[key] = ms
        elif key == "allowed_ports":
            from magpie.base.egress import format_ports, parse_ports

            try:
                out[key] = format_ports(parse_ports(value if isinstance(value, str) else ",".join(map(str, value))))
            except ValueError as exc:
                raise RotatorError(f"allowed_ports: {exc}") from None
        elif key == "reputation":
            v = str(value).strip().lower()
            if v not in REPUTATION:
                raise RotatorError(f"filter reputation: expected one of {', '.join(REPUTATION)}, got {value!r}")
            out[key] = v
    return out


def _check_policy(policy: str, sticky_seconds: int) -> None:
    if policy not in POLICIES:
        raise RotatorError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    if not 0 <= int(sticky_seconds) <= 86_400:
        raise RotatorError(f"sticky_seconds: expected 0-86400, got {sticky_seconds!r}")
    if policy == "sticky" and int(sticky_seconds) <= 0:
        raise RotatorError("policy sticky needs sticky_seconds > 0")


def _workspace_id(conn, workspace: str) -> int:
    wid = conn.execute(sa.text("SELECT id FROM workspaces WHERE name = :n"), {"n": workspace}).scalar()
    if wid is None:
        raise RefusedError(Refusal.NO_SUCH_WORKSPACE, detail=f"workspace {workspace!r}")
    return int(wid)


def _free_port(conn, lo: int, hi: int) -> int:
    taken = {int(p) for p in conn.execute(sa.text("SELECT port FROM rotators WHERE port BETWEEN :lo AND :hi"),
                                          {"lo": lo, "hi": hi}).scalars()}
    for port in range(lo, hi + 1):
        if port not in taken:
            return port
    raise RefusedError(Refusal.RANGE_EXHAUSTED, detail=f"MAGPIE_ROTATOR_PORTS {lo}-{hi}")


def _notify(redis, prefix: str | None, rotator_id: int) -> None:
    if redis is None or prefix is None:
        return
    try:
        redis.publish(channel(prefix), str(rotator_id))
    except Exception:  # noqa: BLE001 - a hint only: reconciliation converges without it
        pass


def add_rotator(engine: Engine, keyring, *, name: str, workspace: str, ports: str, listen="http,socks5",
                port: int | None = None, username: str | None = None, password: str | None = None,
                filters: dict | None = None, policy: str = "next", sticky_seconds: int = 0,
                redis=None, prefix: str | None = None) -> dict:
    """Create a rotator; returns its :func:`describe` dict.

    Args:
        ports: ``MAGPIE_ROTATOR_PORTS`` (``"A-B"``); ``port`` None takes the lowest free one of it.
        username / password: client credentials (both or neither); the password is stored encrypted.
        filters: see :func:`check_filters`. policy / sticky_seconds: see :data:`POLICIES`.
        redis / prefix: where to announce the change (optional).
    Raises:
        RotatorError: a malformed field. RefusedError: ``port_taken`` (in use or outside the range),
        ``range_exhausted``, ``no_such_workspace``. Nothing is written on any error.
    """
    if not _NAME.match(name or ""):
        raise RotatorError(f"name: 1-63 letters, digits, '.', '_' or '-', got {name!r}")
    if (username is None) != (password is None):
        raise RotatorError("username and password go together (give both or neither)")
    listen = parse_listen(listen)
    filters = check_filters(filters or {})
    _check_policy(policy, sticky_seconds)
    lo, hi = port_range(ports)
    with engine.begin() as conn:
        wid = _workspace_id(conn, workspace)
        if conn.execute(sa.text("SELECT 1 FROM rotators WHERE name = :n"), {"n": name}).first():
            raise RotatorError(f"name: a rotator named {name!r} exists already")
        if port is None:
            conn.execute(sa.text("LOCK TABLE rotators IN SHARE ROW EXCLUSIVE MODE"))
            port = _free_port(conn, lo, hi)
        elif not lo <= int(port) <= hi:
            raise RefusedError(Refusal.PORT_TAKEN, detail=f"port {port} is outside MAGPIE_ROTATOR_PORTS {lo}-{hi}")
        elif conn.execute(sa.text("SELECT 1 FROM rotators WHERE port = :p"), {"p": int(port)}).first():
            raise RefusedError(Refusal.PORT_TAKEN, detail=f"port {port}")
        rid = conn.execute(sa.insert(Rotator).values(
            name=name, workspace_id=wid, listen=listen, port=int(port), username=username,
            password_enc=keyring.encrypt(password) if password is not None else None, filters=filters,
            policy=policy, sticky_seconds=int(sticky_seconds)).returning(Rotator.id)).scalar_one()
    _notify(redis, prefix, rid)
    return get_rotator(engine, name)


def update_rotator(engine: Engine, keyring, name: str, *, redis=None, prefix: str | None = None,
                   **changes) -> dict:
    """Change fields of rotator ``name`` (keys: ``listen``, ``port``, ``username``, ``password``, ``filters``
    (replaces the whole filter set), ``policy``, ``sticky_seconds``, ``enabled``, ``ports`` (the range a
    new port must be in)); bumps the revision. Returns its :func:`describe` dict.

    Raises :class:`RotatorError` (no such rotator, malformed field), :class:`RefusedError` ``port_taken``.
    """
    ports = changes.pop("ports", None)
    values: dict = {}
    if "listen" in changes:
        values["listen"] = parse_listen(changes.pop("listen"))
    if "filters" in changes:
        values["filters"] = check_filters(changes.pop("filters") or {})
    if "enabled" in changes:
        values["enabled"] = bool(changes.pop("enabled"))
    if "username" in changes or "password" in changes:
        user, pw = changes.pop("username", None), changes.pop("password", None)
        if (user is None) != (pw is None):
            raise RotatorError("username and password go together (give both, or both empty to remove)")
        values["username"] = user or None
        values["password_enc"] = keyring.encrypt(pw) if pw else None
    policy = changes.pop("policy", None)
    sticky = changes.pop("sticky_seconds", None)
    port = changes.pop("port", None)
    if changes:
        raise RotatorError(f"unknown field(s): {', '.join(sorted(changes))}")
    with engine.begin() as conn:
        row = conn.execute(sa.select(Rotator).where(Rotator.name == name).with_for_update()).first()
        if row is None:
            raise RotatorError(f"no rotator named {name!r}")
        if policy is not None or sticky is not None:
            pol = policy if policy is not None else row.policy
            sec = sticky if sticky is not None else row.sticky_seconds
            _check_policy(pol, sec)
            values.update(policy=pol, sticky_seconds=int(sec))
        if port is not None and int(port) != row.port:
            if ports is not None:
                lo, hi = port_range(ports)
                if not lo <= int(port) <= hi:
                    raise RefusedError(Refusal.PORT_TAKEN,
                                       detail=f"port {port} is outside MAGPIE_ROTATOR_PORTS {lo}-{hi}")
            if conn.execute(sa.text("SELECT 1 FROM rotators WHERE port = :p"), {"p": int(port)}).first():
                raise RefusedError(Refusal.PORT_TAKEN, detail=f"port {port}")
            values["port"] = int(port)
        conn.execute(sa.update(Rotator).where(Rotator.id == row.id).values(
            **values, revision=Rotator.revision + 1, updated_at=sa.func.now()))
    _notify(redis, prefix, row.id)
    return get_rotator(engine, name)


def remove_rotator(engine: Engine, name: str, *, redis=None, prefix: str | None = None) -> None:
    """Delete rotator ``name``; its listener stops at the next reconciliation (or at once when notified).

    Raises :class:`RotatorError` when there is no such rotator."""
    with engine.begin() as conn:
        rid = conn.execute(sa.delete(Rotator).where(Rotator.name == name).returning(Rotator.id)).scalar()
    if rid is None:
        raise RotatorError(f"no rotator named {name!r}")
    _notify(redis, prefix, rid)


def describe(row, workspace: str | None = None) -> dict:
    """A rotator row as a JSON-safe dict without secrets (``auth`` tells whether credentials are set)."""
    return {"id": row.id, "name": row.name, "workspace": workspace, "workspace_id": row.workspace_id,
            "listen": row.listen.split(","), "port": row.port, "auth": row.password_enc is not None,
            "username": row.username, "filters": dict(row.filters or {}), "policy": row.policy,
            "sticky_seconds": row.sticky_seconds, "enabled": row.enabled, "instance": row.instance_id,
            "revision": int(row.revision)}


def _rows(engine: Engine, where=sa.true()):
    q = (sa.select(Rotator, Workspace.name).join(Workspace, Workspace.id == Rotator.workspace_id)
         .where(where).order_by(Rotator.port))
    with Session(engine, expire_on_commit=False) as session:
        return [(r[0], r[1]) for r in session.execute(q)]


def get_rotator(engine: Engine, name: str) -> dict:
    """:func:`describe` of rotator ``name``; raises :class:`RotatorError` when there is none."""
    got = _rows(engine, Rotator.name == name)
    if not got:
        raise RotatorError(f"no rotator named {name!r}")
    row, ws = got[0]
    return describe(row, ws)


def list_rotators(engine: Engine) -> list[dict]:
    """Every rotator, by port, as :func:`describe` dicts."""
    return [describe(row, ws) for row, ws in _rows(engine)]


def load_rows(engine: Engine, instance_id: str | None = None) -> list:
    """Rotator ORM rows (detached), optionally only those assigned to ``instance_id``."""
    q = sa.select(Rotator).order_by(Rotator.id)
    if instance_id is not None:
        q = q.where(Rotator.instance_id == instance_id)
    with Session(engine, expire_on_commit=False) as session:
        return list(session.scalars(q))
