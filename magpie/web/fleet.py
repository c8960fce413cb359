"""The dashboard's view of the running fleet: rotators with their listener state, and live instances.

Rotators are :func:`magpie.rotator.process.list_with_state` (the same merge as ``magpie rotators list``)
cut down to what a page may show: ``auth`` tells whether client credentials are set; the user name and
the password never leave this module. Instances are the heartbeat records of
:meth:`magpie.coordination.instances.InstanceRegistry.list_live`, reduced to a fixed set of fields (a record can carry
extras registered by any module; only the known ones are shown).
"""

from __future__ import annotations

from datetime import UTC, datetime

from magpie.base.redact import mask_url_passwords

STATES = ("serving", "error", "not running", "unassigned")
"""Listener states of a rotator, as ``magpie rotators list`` shows them."""
ROTATOR_KEYS = ("id", "name", "workspace", "port", "listen", "auth", "policy", "sticky_seconds", "filters",
                "enabled", "instance", "revision", "state", "error", "pool", "connections", "active",
                "upstream_failures", "bytes_up", "bytes_down")
"""The fields of a rotator in the dashboard (never ``username``, never a password)."""


def rotator_view(row: dict) -> dict:
    """One :func:`~magpie.rotator.process.list_with_state` dict reduced to :data:`ROTATOR_KEYS`.

    ``error`` is None unless the state is ``error`` (its text with URL passwords masked); counters are
    None when the listener publishes nothing (bytes in bytes, counts since the listener started).
    """
    out = {k: row.get(k) for k in ROTATOR_KEYS}
    out["listen"] = list(out["listen"] or [])
    out["filters"] = dict(out["filters"] or {})
    out["auth"] = bool(out["auth"])
    if out["state"] not in STATES:
        out["state"] = "not running"
    out["error"] = mask_url_passwords(str(out["error"])) if out["error"] else None
    return out


def rotator_counts(rows: list[dict]) -> dict:
    """``{"total": n, "serving": m, "by_state": {state: count}}`` over :func:`rotator_view` dicts."""
    by_state = {s: 0 for s in STATES}
    for r in rows:
        by_state[r["state"]] = by_state.get(r["state"], 0) + 1
    return {"total": len(rows), "serving": by_state["serving"], "by_state": by_state}


def _int(value) -> int | None:
    try:
        return int(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


def _when(value) -> datetime | None:
    try:
        got = datetime.fromisoformat(str(value)) if value else None
    except ValueError:
        return None
    return got.replace(tzinfo=UTC) if got is not None and got.tzinfo is None else got


def _strings(value) -> list[str] | None:
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else None


def instance_view(rec: dict, now: datetime | None = None) -> dict:
    """One heartbeat record as the dashboard shows it.

    Returns ``{"id", "role", "host", "pid", "version", "queues" ([str]), "checks_in_flight",
    "check_slots", "check_processes" (workers; None otherwise), "rotators" ([names] | None),
    "connections" (rotators' open client connections | None), "schedule" (beat: ``{"entries",
    "bootstrapped", "last_tick_age_s"}`` | None), "cache_revisions" ({name: text}), "started_at",
    "refreshed_at" (aware datetimes | None), "heartbeat_age_s" (s since the last refresh | None),
    "ttl_s" (record lifetime, s | None)}``. Malformed fields become None rather than failing the page.
    """
    now = now or datetime.now(UTC)
    checks = rec.get("checks") if isinstance(rec.get("checks"), dict) else {}
    sched = rec.get("schedule") if isinstance(rec.get("schedule"), dict) else None
    refreshed = _when(rec.get("refreshed_at"))
    revs = rec.get("cache_revisions") if isinstance(rec.get("cache_revisions"), dict) else {}
    try:
        ttl = float(rec["ttl_s"]) if rec.get("ttl_s") is not None else None
    except (TypeError, ValueError):
        ttl = None
    return {
        "id": str(rec.get("id")), "role": str(rec.get("role") or "?"),
        "host": str(rec["host"]) if rec.get("host") is not None else None, "pid": _int(rec.get("pid")),
        "version": str(rec["version"]) if rec.get("version") is not None else None,
        "queues": _strings(rec.get("queues")) or [],
        "checks_in_flight": _int(checks.get("in_flight")), "check_slots": _int(checks.get("slots")),
        "check_processes": _int(checks.get("processes")),
        "rotators": _strings(rec.get("rotators")), "connections": _int(rec.get("connections")),
        "schedule": None if sched is None else {
            "entries": _int(sched.get("entries")), "bootstrapped": bool(sched.get("bootstrapped")),
            "last_tick_age_s": sched.get("last_tick_age_s") if isinstance(
                sched.get("last_tick_age_s"), (int, float)) else None},
        "cache_revisions": {str(k): str(v) for k, v in revs.items()},
        "started_at": _when(rec.get("started_at")), "refreshed_at": refreshed,
        "heartbeat_age_s": round(max(0.0, (now - refreshed).total_seconds()), 1) if refreshed else None,
        "ttl_s": ttl,
    }


def by_role(views: list[dict]) -> dict[str, int]:
    """``{role: live count}``, roles sorted."""
    out: dict[str, int] = {}
    for v in views:
        out[v["role"]] = out.get(v["role"], 0) + 1
    return dict(sorted(out.items()))


__all__ = ["ROTATOR_KEYS", "STATES", "by_role", "instance_view", "rotator_counts", "rotator_view"]
