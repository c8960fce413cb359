"""``magpie queue claim | heartbeat | complete | in-flight``: leases for scripts and cron, on either provider.

``claim`` prints one lease and exits 0, or exits 3 when nothing is claimable (``--wait SECS`` polls with
jitter until the deadline; no LISTEN/NOTIFY: a poll costs one short claim transaction). The lease token it
prints (``<route>:<lease>:<previous>``) is what ``heartbeat`` and ``complete`` take; ``heartbeat`` prints the
renewed token, which replaces the old one. A stale token is refused (``lease_lost``, exit 3). Lease length
is ``MAGPIE_LEASE_SECONDS``, as for the check pool.
"""

from __future__ import annotations

import random
import time

import click

from magpie.cli.context import CliState, json_option, pass_state
from magpie.cli.output import echo_json
from magpie.errors import Refusal, RefusedError

POLL_MIN_S, POLL_MAX_S = 0.2, 2.0
"""Poll pauses of ``claim --wait`` (seconds): from the minimum, doubling to the maximum, each jittered
by +-50 % so many waiting scripts do not poll in step."""


def lease_view(lease, now_ms: int) -> dict:
    """What ``claim`` prints for ``lease``: token, route, times (ms, s) and flags; credentials masked."""
    from magpie.base.redact import mask_route_info as _masked
    from magpie.queue.provider import lease_token

    return {"token": lease_token(lease), "member": lease.member, "lease_score": lease.lease_score,
            "previous_score": lease.previous_score, "expires_at_ms": int(lease.expires_at_ms),
            "expires_in_s": round((lease.expires_at_ms - now_ms) / 1000, 3), "stalled": lease.stalled,
            "alone": lease.alone, "retry_attempts": lease.retry_attempts,
            "payload": _masked({"payload": lease.payload})["payload"]}


def claim_one(queue, wait_s: float, sleep=time.sleep, clock=time.monotonic):
    """One lease from ``queue``, polling up to ``wait_s`` seconds with jittered, growing pauses; None when
    nothing became claimable by the deadline."""
    deadline = clock() + max(0.0, wait_s)
    pause = POLL_MIN_S
    while True:
        got = queue.pop(1)
        if got:
            return got[0]
        left = deadline - clock()
        if left <= 0:
            return None
        sleep(min(left, pause * random.uniform(0.5, 1.5)))
        pause = min(POLL_MAX_S, pause * 2)


def register(group: click.Group) -> None:
    """Add the lease verbs to the ``queue`` command group."""

    @group.command("claim")
    @click.option("--wait", "wait_s", default=0.0, show_default=True, type=click.FloatRange(0, 86400),
                  help="Seconds to keep polling (with jitter) for a claimable route.")
    @json_option
    @pass_state
    def queue_claim(state: CliState, wait_s: float, as_json: bool) -> None:
        """Claim one due route and print its lease (exit 0); exit 3 when nothing is claimable."""
        lease = claim_one(state.queue, wait_s)
        if lease is None:
            raise RefusedError(Refusal.EMPTY, detail="nothing claimable")
        view = lease_view(lease, int(lease.expires_at_ms - state.queue.lease_ms))
        if as_json:
            echo_json({"ok": True, "result": view})
        else:
            click.echo(view["token"])

    @group.command("heartbeat")
    @click.argument("token")
    @json_option
    @pass_state
    def queue_heartbeat(state: CliState, token: str, as_json: bool) -> None:
        """Renew the lease of TOKEN for MAGPIE_LEASE_SECONDS; prints the renewed token (use it from now on)."""
        from magpie.queue.provider import lease_from_token, lease_token

        lease = state.queue.renew(lease_from_token(state.queue, token))
        new = lease_token(lease)
        if as_json:
            echo_json({"ok": True, "result": {"token": new, "expires_at_ms": int(lease.expires_at_ms)}})
        else:
            click.echo(new)

    @group.command("complete")
    @click.argument("token")
    @json_option
    @pass_state
    def queue_complete(state: CliState, token: str, as_json: bool) -> None:
        """Complete the lease of TOKEN: the route is next due at max(previous due, now) + interval."""
        from magpie.queue.provider import lease_from_token

        state.queue.complete_one(lease_from_token(state.queue, token))
        if as_json:
            echo_json({"ok": True, "result": "completed"})
        else:
            click.echo("completed")

    @group.command("in-flight")
    @click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 100_000))
    @json_option
    @pass_state
    def queue_in_flight(state: CliState, limit: int, as_json: bool) -> None:
        """Outstanding leases, soonest expiry first, with seconds since the holder's last heartbeat."""
        rows = state.queue.in_flight(limit)
        if as_json:
            echo_json({"ok": True, "result": rows})
            return
        if not rows:
            click.echo("no leases out")
        for r in rows:
            click.echo(f"{r['member']}  expires in {r['expires_in_s']:g} s  silent {r['silent_seconds']:g} s")
