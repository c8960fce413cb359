"""Judges, check profiles and the check-config revision in PostgreSQL; every change raises the revision.

A change (a judge added, removed or changing health, a profile set) commits the new revision in the same
transaction and, after the commit, publishes it on the Redis channel ``<prefix>config:changed``
(:func:`notify`). Checkers keep a :class:`Snapshot` in memory (:mod:`magpie.judges.cache`) and reload it
when the revision they hold is not the persisted one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from magpie.errors import MagpieError
from magpie.checker.rules import DEFAULT_RULE, validate_rule
from magpie.base.protocols import PROTOCOLS

log = logging.getLogger(__name__)

SCOPE = "checks"
JUDGE_POOLS = ("global", "workspace")


def channel(prefix: str) -> str:
    """The pub/sub channel of config changes: ``f"{prefix}config:changed"``."""
    return f"{prefix}config:changed"


@dataclass(frozen=True, slots=True)
class JudgeInfo:
    """One judge as checkers see it (``workspace_id`` None: the global pool; ``id`` 0: the judge of
    ``MAGPIE_JUDGE_URL`` standing in for an empty global pool)."""

    id: int
    url: str
    scheme: str
    rule: str = DEFAULT_RULE
    healthy: bool = True
    workspace_id: int | None = None
    rate: float | None = None  # requests/s across the deployment; None: MAGPIE_JUDGE_RATE, 0: unlimited


@dataclass(frozen=True, slots=True)
class Profile:
    """One workspace's check profile; None fields take the deployment's default."""

    workspace_id: int
    protocols: tuple[str, ...] | None = None
    timeout: float | None = None
    attempts: int | None = None
    judge_pool: str = "global"
    rule: str | None = None
    auto_remove_after: int | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Judges and profiles at one ``revision`` (what a process caches)."""

    revision: int
    judges: tuple[JudgeInfo, ...] = ()
    profiles: dict[int, Profile] = field(default_factory=dict)


def read_revision(conn_or_engine) -> int:
    """The persisted revision (0 when the row is missing). One query. Raises ``DBAPIError``."""
    sql = sa.text("SELECT revision FROM check_config_revisions WHERE scope = :s")
    if isinstance(conn_or_engine, Engine):
        with conn_or_engine.connect() as conn:
            return int(conn.execute(sql, {"s": SCOPE}).scalar() or 0)
    return int(conn_or_engine.execute(sql, {"s": SCOPE}).scalar() or 0)


def bump(conn: sa.Connection) -> int:
    """Raise the revision inside ``conn``'s transaction; returns the new revision."""
    return int(conn.execute(sa.text(
        "INSERT INTO check_config_revisions (scope, revision) VALUES (:s, 1) "
        "ON CONFLICT (scope) DO UPDATE SET revision = check_config_revisions.revision + 1, changed_at = now() "
        "RETURNING revision"), {"s": SCOPE}).scalar_one())


def notify(redis, prefix: str, revision: int) -> None:
    """Publish ``revision`` on :func:`channel` (after the commit); a failure is logged, never raised:
    processes also reconcile against the persisted revision."""
    if redis is None:
        return
    try:
        redis.publish(channel(prefix), str(int(revision)))
    except Exception as exc:  # noqa: BLE001 - reconciliation converges without the notification
        log.warning("config change %d not published (processes will reconcile): %s", revision, exc)


def load_snapshot(engine: Engine) -> Snapshot:
    """Revision, enabled judges and profiles, read in one consistent transaction. Raises ``DBAPIError``."""
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            rev = read_revision(conn)
            judges = tuple(JudgeInfo(r.id, r.url, r.scheme, r.rule, r.healthy, r.workspace_id, r.rate)
                           for r in conn.execute(sa.text(
                               "SELECT id, url, scheme, rule, healthy, workspace_id, rate FROM judges "
                               "WHERE enabled ORDER BY id")))
            profiles = {r.workspace_id: Profile(r.workspace_id, tuple(r.protocols) if r.protocols else None,
                                                r.timeout, r.attempts, r.judge_pool, r.rule, r.auto_remove_after)
                        for r in conn.execute(sa.text(
                            "SELECT workspace_id, protocols, timeout, attempts, judge_pool, rule, "
                            "auto_remove_after FROM check_profiles"))}
    return Snapshot(rev, judges, profiles)


def workspace_id(conn: sa.Connection, name: str) -> int:
    """The id of workspace ``name``; raises :class:`MagpieError` naming it when there is none."""
    wid = conn.execute(sa.text("SELECT id FROM workspaces WHERE name = :n"), {"n": name}).scalar()
    if wid is None:
        raise MagpieError(f"no workspace named {name!r}")
    return int(wid)


def validate_judge_url(url: str) -> str:
    """``url`` if it is ``http(s)://host[:port]/path`` without credentials; else ``ValueError``."""
    u = urlsplit(url.strip())
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"judge URL must be http(s)://host[:port]/path, got {url!r}")
    if u.username or u.password:
        raise ValueError("judge URL must not carry credentials")
    try:
        _ = u.port
    except ValueError:
        raise ValueError("judge URL has a bad port") from None
    return url.strip()


# -- judges --------------------------------------------------------------------------------------------

def add_judge(engine: Engine, url: str, *, workspace: str | None = None, rule: str = DEFAULT_RULE,
              enabled: bool = True, redis=None, prefix: str = "", egress=None, rate: float | None = None) -> dict:
    """Add a judge to the global pool (``workspace`` None) or a workspace's; returns its row as a dict.

    ``egress``: the checks' :class:`magpie.base.egress.EgressPolicy`; a judge it refuses without resolving (a
    private IP literal, ``localhost``) is refused here, not at the first check.

    Raises ``ValueError`` (bad URL or rule), :class:`magpie.base.egress.EgressRefused` (a host the checks may
    not dial), :class:`MagpieError` (unknown workspace, URL already there). ``rate``: requests per
    second the judge takes from the deployment (None: ``MAGPIE_JUDGE_RATE``; 0: unlimited)."""
    url = validate_judge_url(url)
    rate = validate_rate(rate)
    rule = validate_rule(rule)
    if egress is not None:
        egress.check_host(urlsplit(url).hostname or "")
    with engine.begin() as conn:
        wid = workspace_id(conn, workspace) if workspace else None
        row = conn.execute(sa.text(
            "INSERT INTO judges (workspace_id, url, scheme, rule, enabled, rate) VALUES (:w, :u, :s, :r, :e, :q) "
            "ON CONFLICT DO NOTHING RETURNING id"),
            {"w": wid, "u": url, "s": urlsplit(url).scheme, "r": rule, "e": enabled, "q": rate}).scalar()
        if row is None:
            raise MagpieError(f"judge {url} is already in the {workspace or 'global'} pool")
        rev = bump(conn)
    notify(redis, prefix, rev)
    return _judge_rows(engine, "j.id = :id", {"id": row})[0]


def validate_rate(rate) -> float | None:
    """A judge rate as stored: None (the default), or requests per second >= 0.
    Raises ``ValueError`` naming the value otherwise."""
    if rate is None:
        return None
    try:
        value = float(rate)
    except (TypeError, ValueError):
        raise ValueError(f"judge rate must be a number of requests per second, got {rate!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"judge rate must be >= 0 requests per second, got {rate!r}")
    return value


def set_judge_rate(engine: Engine, ident: str, rate: float | None, *, workspace: str | None = None, redis=None,
                   prefix: str = "") -> dict:
    """Set the rate of a judge (id, or URL within ``workspace``'s pool): requests per second across the
    deployment, 0 unlimited, None back to ``MAGPIE_JUDGE_RATE``. Returns its row. Raises ``ValueError``
    (bad rate), :class:`MagpieError` (no such judge)."""
    rate = validate_rate(rate)
    with engine.begin() as conn:
        wid = workspace_id(conn, workspace) if workspace else None
        if ident.isdigit():
            row = conn.execute(sa.text("UPDATE judges SET rate = :q WHERE id = :i RETURNING id"),
                               {"q": rate, "i": int(ident)}).scalar()
        else:
            row = conn.execute(sa.text(
                "UPDATE judges SET rate = :q WHERE url = :u AND coalesce(workspace_id, 0) = :w RETURNING id"),
                {"q": rate, "u": ident, "w": wid or 0}).scalar()
        if row is None:
            raise MagpieError(f"no judge {ident!r} in the {workspace or 'global'} pool")
        rev = bump(conn)
    notify(redis, prefix, rev)
    return _judge_rows(engine, "j.id = :id", {"id": row})[0]


def remove_judge(engine: Engine, ident: str, *, workspace: str | None = None, redis=None, prefix: str = "") -> int:
    """Remove a judge by id or URL (within ``workspace``'s pool, or the global one); returns its id.
    Raises :class:`MagpieError` when there is no such judge."""
    with engine.begin() as conn:
        wid = workspace_id(conn, workspace) if workspace else None
        if ident.isdigit():
            row = conn.execute(sa.text("DELETE FROM judges WHERE id = :i RETURNING id"), {"i": int(ident)}).scalar()
        else:
            row = conn.execute(sa.text(
                "DELETE FROM judges WHERE url = :u AND coalesce(workspace_id, 0) = :w RETURNING id"),
                {"u": ident, "w": wid or 0}).scalar()
        if row is None:
            raise MagpieError(f"no judge {ident!r} in the {workspace or 'global'} pool")
        rev = bump(conn)
    notify(redis, prefix, rev)
    return int(row)


def _judge_rows(engine: Engine, where: str = "TRUE", params: dict | None = None) -> list[dict]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT j.id, j.url, j.scheme, j.rule, j.enabled, j.healthy, j.last_error, j.last_checked_at, "
            "j.last_ok_at, j.addresses, j.addresses_until, j.rate, w.name AS workspace FROM judges j "
            f"LEFT JOIN workspaces w ON w.id = j.workspace_id WHERE {where} ORDER BY j.id"), params or {})
        out = [dict(r._mapping) for r in rows]
    for row in out:  # a judge no probe has answered yet is not known to be healthy
        if row["last_checked_at"] is None:
            row["healthy"] = None
        row["health"] = {None: "unknown", True: "healthy", False: "unhealthy"}[row["healthy"]]
    return out


def list_judges(engine: Engine, workspace: str | None = None) -> list[dict]:
    """Every judge (or those of ``workspace``'s pool) as dicts: id, url, scheme, rule, enabled, healthy
    (None until a probe answered), health (``"unknown"``, ``"healthy"``, ``"unhealthy"``), last_error,
    last_checked_at, last_ok_at, addresses, addresses_until, workspace (None: global)."""
    if workspace is None:
        return _judge_rows(engine)
    with engine.connect() as conn:
        wid = workspace_id(conn, workspace)
    return _judge_rows(engine, "j.workspace_id = :w", {"w": wid})


def record_health(conn: sa.Connection, judge_id: int, ok: bool, reason: str | None,
                  addresses: list[str] | None, ttl_s: float | None) -> bool:
    """Store one probe's verdict (and resolved addresses with their TTL); True when ``healthy`` changed."""
    before = conn.execute(sa.text("SELECT healthy FROM judges WHERE id = :i FOR UPDATE"), {"i": judge_id}).scalar()
    if before is None:
        return False
    conn.execute(sa.text(
        "UPDATE judges SET healthy = :ok, last_error = :e, last_checked_at = now(), "
        "last_ok_at = CASE WHEN :ok THEN now() ELSE last_ok_at END, "
        "addresses = CASE WHEN :a IS NULL THEN addresses ELSE CAST(:a AS jsonb) END, "
        "addresses_until = CASE WHEN :a IS NULL THEN addresses_until "
        "ELSE now() + make_interval(secs => :ttl) END WHERE id = :i"),
        {"ok": ok, "e": None if ok else (reason or "unhealthy")[:300], "i": judge_id,
         "a": None if addresses is None else json.dumps(addresses), "ttl": float(ttl_s or 0)})
    return bool(before) != bool(ok)


# -- profiles ------------------------------------------------------------------------------------------

PROFILE_FIELDS = ("protocols", "timeout", "attempts", "judge_pool", "rule", "auto_remove_after",
                  "check_interval", "dead_after", "dead_factor")
CADENCE_FIELDS = ("check_interval", "dead_after", "dead_factor")
"""Profile fields the schedule follows (:func:`profile_cadence_ms`); the Redis schedule only."""
DEFAULT_DEAD_FACTOR = 4
_MAX_INTERVAL_S = 30 * 86400


def get_profile(engine: Engine, workspace: str) -> dict:
    """``workspace``'s profile as a dict of :data:`PROFILE_FIELDS` (None: the default) plus ``workspace``
    and ``custom`` (False when it has no row). Raises :class:`MagpieError` for an unknown workspace."""
    with engine.connect() as conn:
        wid = workspace_id(conn, workspace)
        row = conn.execute(sa.text(
            f"SELECT {', '.join(PROFILE_FIELDS)} FROM check_profiles WHERE workspace_id = :w"), {"w": wid}).first()
    out = {"workspace": workspace, "custom": row is not None}
    out.update(dict(row._mapping) if row is not None else dict.fromkeys(PROFILE_FIELDS))
    if out["judge_pool"] is None:
        out["judge_pool"] = "global"
    return out


def profile_bounds(settings) -> tuple[float, int]:
    """``(max timeout s, max attempts)`` a profile may set: ``MAGPIE_PROFILE_MAX_TIMEOUT`` /
    ``MAGPIE_PROFILE_MAX_ATTEMPTS``, by default the deployment's own timeout and attempts."""
    return (float(settings.profile_max_timeout or settings.check_timeout),
            int(settings.profile_max_attempts or settings.check_attempts))


def validate_profile(changes: dict, *, max_timeout: float, max_attempts: int) -> dict:
    """``changes`` (a subset of :data:`PROFILE_FIELDS`; None resets a field) checked and normalised.
    Raises ``ValueError`` naming the bad field."""
    out = {}
    for key, value in changes.items():
        if key not in PROFILE_FIELDS:
            raise ValueError(f"unknown profile field {key!r}")
        if value is None:
            out[key] = "global" if key == "judge_pool" else None
        elif key == "protocols":
            protos = [p.strip() for p in (value.split(",") if isinstance(value, str) else value) if p.strip()]
            bad = [p for p in protos if p not in PROTOCOLS]
            if bad or not protos:
                raise ValueError(f"protocols must be a list of {', '.join(PROTOCOLS)}, got {value!r}")
            out[key] = list(dict.fromkeys(protos))
        elif key == "timeout":
            if not 0 < float(value) <= max_timeout:
                raise ValueError(f"timeout must be > 0 and <= {max_timeout:g} s (MAGPIE_PROFILE_MAX_TIMEOUT)")
            out[key] = float(value)
        elif key == "attempts":
            if not 1 <= int(value) <= max_attempts:
                raise ValueError(f"attempts must be 1..{max_attempts} (MAGPIE_PROFILE_MAX_ATTEMPTS)")
            out[key] = int(value)
        elif key == "judge_pool":
            if value not in JUDGE_POOLS:
                raise ValueError(f"judge_pool must be one of {', '.join(JUDGE_POOLS)}, got {value!r}")
            out[key] = value
        elif key == "rule":
            out[key] = validate_rule(value)
        elif key == "auto_remove_after":
            if int(value) < 1:
                raise ValueError("auto_remove_after must be >= 1 failures")
            out[key] = int(value)
        elif key == "check_interval":
            if not 1 <= float(value) <= _MAX_INTERVAL_S:
                raise ValueError(f"check_interval must be 1 s .. 30 days, got {value!r}")
            out[key] = float(value)
        elif key == "dead_after":
            if not 1 <= int(value) <= 1_000_000:
                raise ValueError(f"dead_after must be 1..1000000 dead checks, got {value!r}")
            out[key] = int(value)
        elif key == "dead_factor":
            if not 2 <= int(value) <= 1000:
                raise ValueError(f"dead_factor must be 2..1000, got {value!r}")
            out[key] = int(value)
    return out


def _dead_policy(fields: dict, stored: dict) -> dict:
    """Keep ``dead_after`` and ``dead_factor`` both set or both unset: resetting ``dead_after`` resets the
    factor, a new ``dead_after`` without a factor takes the stored one or :data:`DEFAULT_DEAD_FACTOR`.
    Raises ``ValueError`` for a factor with no ``dead_after`` set or given."""
    out = dict(fields)
    if "dead_after" in out and out["dead_after"] is None:
        out["dead_factor"] = None
    elif out.get("dead_after") is not None and out.get("dead_factor", stored.get("dead_factor")) is None:
        out["dead_factor"] = DEFAULT_DEAD_FACTOR
    if out.get("dead_factor") is not None and out.get("dead_after", stored.get("dead_after")) is None:
        raise ValueError("dead_factor needs dead_after (dead checks in a row before backing off)")
    if "dead_factor" in out and out["dead_factor"] is None and out.get("dead_after", stored.get("dead_after")):
        out["dead_factor"] = DEFAULT_DEAD_FACTOR  # a reset factor goes back to the default, the policy stays
    return out


def profile_cadence_ms(profile: dict) -> dict:
    """The schedule's form of a profile's cadence (:func:`magpie.queue.cadence.set_profile_cadence`
    keywords): ``{"interval_ms", "dead_after", "dead_factor"}``, 0 where the profile sets nothing."""
    iv = profile.get("check_interval")
    return {"interval_ms": int(round(float(iv) * 1000)) if iv else 0,
            "dead_after": int(profile.get("dead_after") or 0),
            "dead_factor": int(profile.get("dead_factor") or 0) if profile.get("dead_after") else 0}


def set_profile(engine: Engine, workspace: str, changes: dict, *, max_timeout: float = 30.0,
                max_attempts: int = 3, redis=None, prefix: str = "") -> dict:
    """Change ``workspace``'s profile fields (see :func:`validate_profile`), raise the revision, publish;
    returns the profile as :func:`get_profile` shows it. Raises ``ValueError`` or :class:`MagpieError`.

    The cadence fields (:data:`CADENCE_FIELDS`) are stored here only; the caller applies them to the
    schedule (:func:`magpie.queue.cadence.set_profile_cadence` with :func:`profile_cadence_ms`), as
    ``magpie profiles set`` does."""
    fields = validate_profile(changes, max_timeout=max_timeout, max_attempts=max_attempts)
    with engine.begin() as conn:
        wid = workspace_id(conn, workspace)
        conn.execute(sa.text("INSERT INTO check_profiles (workspace_id) VALUES (:w) ON CONFLICT DO NOTHING"),
                     {"w": wid})
        if {"dead_after", "dead_factor"} & set(fields):
            stored = conn.execute(sa.text("SELECT dead_after, dead_factor FROM check_profiles WHERE workspace_id = :w "
                                          "FOR UPDATE"), {"w": wid}).mappings().one()
            fields = _dead_policy(fields, dict(stored))
        if fields:
            sets = ", ".join(f"{k} = :{k}" for k in fields)
            conn.execute(sa.text(f"UPDATE check_profiles SET {sets}, updated_at = now() WHERE workspace_id = :w"),
                         {**fields, "w": wid})
        rev = bump(conn)
    notify(redis, prefix, rev)
    return get_profile(engine, workspace)
