"""The schedule provider interface, and the factory that picks a provider by URL scheme.

Two providers implement :class:`ScheduleProvider`: :class:`magpie.queue.RouteQueue` (Redis + Lua, the default,
for large schedules) and :class:`magpie.queue.pg.PgSchedule` (one PostgreSQL table claimed with
``FOR UPDATE SKIP LOCKED``, for small deployments with the fewest moving parts). Both pass the same
conformance suite (``tests/conformance/``), which is how a new provider proves itself.

Invariants every provider keeps (``docs/design.md``, "The route schedule"):

1. **At most one holder**: a route is leased to at most one holder at a time.
2. **Only the holder's writes take effect**: renew, complete, retry, progress, log, remove and release are
   fenced on the lease token (``Lease.lease_score``); a stale holder's call changes nothing, is refused
   (``LEASE_LOST``) and fires the lease's cancellation token.
3. **No sweeper**: an expired lease is re-claimable by the next claim that meets it (claim-driven reaping);
   the claim counts the stall by the quarantine rule (below).
4. **Cadence**: a completion schedules the next due time at ``max(previous due, now) + interval``.
5. **Ordinary completion never writes the payload** (only a holder's ownership delta, ``desired`` of
   ``complete_with_results`` or ``complete_with_payload``, or an operator ``update`` do).
6. **Nothing is lost**: every imported route is scheduled, leased, dead-lettered, or removed on purpose.
7. **Due order**: claims come in due-time order (ties: shard, then route hash).

Stalls and quarantine: the check pool marks a lease as *started* (:meth:`mark_started`). A claim of an
expired lease that never started counts nothing; every started stall counts. The first
``max(max_stalled, 2) - 1`` started stalls since the last completion make the route a suspect (re-run as
usual: the crash may be a neighbour's, or a whole worker's); then the route is in quarantine (its leases
carry ``alone=True``). A check that ended without a completion the store took withdraws its mark
(:meth:`unmark_started`). More than
``max_stalled`` counted stalls, the last of them while checked alone, dead-letter it with the evidence
``{reason: "stalled", stalls, claims, alone: true}``: a route that kills its process is dead-lettered
within ``max(max_stalled + 1, 3)`` claims. The check workers instead run a quarantined check unmarked in a
process of its own and report that process's crash (:meth:`report_crash`): two in a row dead-letter the
route (``{reason: "crashed", stalls, isolated_crashes, alone: true}``). A completion clears all of it; a
release clears the start mark only.

Times are Unix ms on the provider's server clock (Redis ``TIME`` or PostgreSQL ``clock_timestamp()``);
delays and lengths are ms. Refusals raise :class:`magpie.queue.QueueError` (``LeaseLost`` for a stale
holder) whose ``code`` is a :class:`magpie.errors.Refusal`; batch calls return per-item codes (1 done, or
the refusal codes ``LEASE_LOST`` and ``GONE``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from magpie.base import redisconn
from magpie.errors import ConfigError
from magpie.queue.completion import Completion, StreamTarget
from magpie.queue.lease import Lease
from magpie.base.schedule_urls import POSTGRES_SCHEMES, REDIS_SCHEMES, SCHEMES, scheme_of  # noqa: F401



@runtime_checkable
class ScheduleProvider(Protocol):
    """Operations of a recurring, lease-fenced route schedule, by plane. See the module docstring."""

    interval_ms: int
    """Check interval (ms)."""
    lease_ms: int
    """Lease length a claim or renewal gives (ms)."""
    last_pop: dict
    """What the last :meth:`pop` saw: ``{"allowed", "paused", "dead_lettered"}``."""

    # -- worker in hand ---------------------------------------------------------------------------
    def pop(self, count: int = 1, max_inflight: int = 0, lease_ms: int | None = None) -> list[Lease]:
        """Claim up to ``count`` due routes in due order; ``max_inflight`` > 0 caps live leases. Nothing
        while paused. Expired leases met on the way are re-claimed (``stalled=True``) or dead-lettered."""
    def mark_started(self, leases: Sequence[Lease]) -> list[Lease]:
        """Record that ``leases`` started checking (stall evidence if they expire), fenced on each lease;
        returns those not to start: no longer held, or already carrying their own mark (started before by
        a process that died)."""
    def unmark_started(self, leases: Sequence[Lease]) -> int:
        """Withdraw the start mark of each lease that still carries its own (its check ended without a
        completion the schedule took, e.g. a write the store refused): its expiry then counts no stall.
        Returns the marks withdrawn."""
    def report_crash(self, lease: Lease, needed: int = 2) -> int:
        """The holder saw ``lease``'s quarantined check crash its isolated process: count it; dead-letter
        after ``needed`` in a row (2), else claimable at once. 2 dead-lettered, 1 requeued, or a refusal."""
    def renew(self, lease: Lease, lease_ms: int | None = None) -> Lease:
        """Extend (heartbeat) one lease; returns it with a new ``lease_score``. Raises ``LeaseLost``/gone."""
    def renew_many(self, leases: Sequence[Lease], lease_ms: int | None = None) -> list[int]:
        """Extend many leases; one code per lease (1, ``LEASE_LOST``, ``GONE``)."""
    def release(self, leases: Sequence[Lease]) -> list[int]:
        """Hand leases back unchecked, claimable at once with their previous due time; no stall."""
    def complete(self, leases: Sequence[Lease], interval_ms: int | None = None) -> list[int]:
        """Finish cycles (next due = max(previous due, now) + interval); one code per lease."""
    def complete_with_results(self, leases: Sequence[Lease], results: Sequence[dict[str, str] | None] | None,
                              stream: StreamTarget | None, interval_ms: int | None = None,
                              desired: Sequence[str | None] | None = None) -> Completion:
        """Complete and record each completed lease's result (stream entry fields) iff it completed, under
        the stream's bound and overflow policy, in one atomic step. ``desired[i]``: the holder's ownership
        change for lease ``i`` (only its delta is applied to the payload as stored now; with no owner left
        the route is removed, code ``REMOVED``, and records no result). The partitioned Redis schedule is
        atomic per partition: ``full`` may come with the codes of the partitions that completed filled in
        (0 for the refused leases), and the caller retries only those."""
    def complete_one(self, lease: Lease) -> None:
        """Complete one lease; raises the refusal."""
    def complete_with_payload(self, lease: Lease, desired_payload: str, interval_ms: int | None = None) -> str:
        """Complete and apply the ownership delta; ``"completed"`` or ``"removed"``."""
    def retry(self, lease: Lease, delay_ms: int) -> int:
        """End the cycle early, due again after ``delay_ms``; returns the retry count."""
    def progress(self, lease: Lease, value: str) -> None:
        """Record progress text (fenced)."""
    def log(self, lease: Lease, line: str) -> int:
        """Append a log line (fenced, bounded); returns the log length."""
    def remove(self, lease: Lease) -> None:
        """Delete the leased route, fenced on the token and the original payload."""

    # -- import and time --------------------------------------------------------------------------
    def schedule(self, items: Iterable[tuple[str, str]], total: int | None = None, start_index: int = 0,
                 batch: int = 500) -> dict[str, int]:
        """Add ``(route_hash, payload)`` pairs spread over the interval; ``{"new", "merged", "unchanged"}``."""
    def enqueue_at(self, member: str, at_ms: int) -> int:
        """Move the next check to Unix ms ``at_ms``; returns the due time (ms)."""
    def enqueue_in(self, member: str, delay_ms: int = 0) -> int:
        """Move the next check to now + ``delay_ms``; returns the due time (ms)."""
    def respread(self, interval_ms: int | None = None, batch: int = 1000) -> dict[str, int]:
        """Spread unleased routes evenly; ``{"moved", "leased", "missing"}``."""

    # -- operator ---------------------------------------------------------------------------------
    def pause(self) -> None: """Stop claiming (checked inside every claim)."""
    def resume(self) -> None: """Claim again."""
    def is_paused(self) -> bool: """True while paused."""
    def drain(self, batch: int = 1000, progress=None) -> dict[str, int]:
        """Delete due and waiting routes, sparing leased ones; ``{"due", "waiting", "leased_spared"}``;
        ``progress(done, total)`` (route counts) is called as batches finish."""
    def obliterate(self, force: bool = False, batch: int = 1000) -> tuple[str, int]:
        """Delete the schedule in batches: ``("more"|"done", deleted)``; needs a pause."""
    def remove_route(self, member: str, force: bool = False, expected: str | None = None) -> None:
        """Operator removal; ``active_leases`` under a live lease unless ``force``; ``payload_changed`` when
        ``expected`` (the payload text read) is given and no longer stored."""
    def update(self, member: str, payload: str, expected: str, force: bool = False) -> None:
        """Replace a payload, fenced on ``expected`` (``payload_changed``) and on live leases
        (``active_leases`` unless ``force``); schedule untouched."""
    def dead_letters(self, limit: int = 100) -> list[dict]:
        """``[{"member", "dead_at_ms", "reason", "stalls", "claims", "alone"}]``, oldest first."""
    def reprocess(self, member: str) -> int: """Put a dead-lettered route back, due now; returns ms."""

    # -- reads ------------------------------------------------------------------------------------
    def server_time_ms(self) -> int: """Now (Unix ms) on the provider's clock."""
    def score(self, member: str) -> str | None:
        """The route's position as a ``'%.2f'`` score (``.25`` retry, ``.5`` lease), or None."""
    def payload(self, member: str) -> str | None: """The stored payload text, or None."""
    def payloads(self, members: Sequence[str]) -> list[str | None]:
        """The stored payload texts of ``members`` in order, None where missing (one round trip)."""
    def inspect(self, member: str) -> dict: """Everything known about one route."""
    def status(self) -> dict: """``{"now_ms", "paused", "shards": [...], "totals": {...}}``."""
    def dead_count(self) -> int: """How many routes are dead-lettered."""
    def in_flight(self, limit: int = 100) -> list[dict]:
        """Outstanding leases, soonest expiry first: ``[{"member", "lease_score", "expires_in_s",
        "silent_seconds"}]`` (s; negative ``expires_in_s``: expired, not yet re-claimed). PostgreSQL records
        each heartbeat, so ``silent_seconds`` is exact there; Redis estimates it from ``lease_ms``."""
    def shard_of(self, member: str) -> str: """The shard label of a route (:attr:`Lease.shard`)."""
    def route_count(self) -> int: """Scheduled routes, leased ones included (dead letters are not)."""
    def respread_batch(self, shard: int, cursor: str = "0", *, count: int = 1000, placed: int = 0,
                       total: int = 1, interval_ms: int | None = None, progress_key: str | None = None,
                       run: str | None = None) -> dict:
        """One bounded batch of a tracked respread of shard number ``shard`` (the interval job,
        :mod:`magpie.maintenance.interval`); ``{"cursor", "moved", "leased", "placed", "superseded"}``."""

    # -- beside the schedule: state every provider keeps in Redis ---------------------------------
    # The results stream, engine capacity, promote's budget, leader locks, the interval's state and the
    # rebuild marker live in Redis on both providers; callers reach them only through these names.
    redis: object
    """redis-py client on the Redis holding that state (``MAGPIE_REDIS_URL``)."""
    prefix: str
    """The deployment's key prefix (``MAGPIE_REDIS_PREFIX``)."""
    shards: int
    """The shard count (``PROXY_QUEUE_SHARDS``)."""
    def side_key(self, name: str) -> str:
        """Key ``name`` under the schedule's hash tag in :attr:`redis` (``<prefix>{default}:<name>``)."""
    def capacity_registry(self) -> object:
        """The :class:`magpie.queue.capacity.CapacityRegistry` of this schedule's check engines."""

    # -- Redis only -------------------------------------------------------------------------------
    def migrate_payloads(self, cipher, *, encrypt: bool, batch: int = 500, retries: int = 2,
                         progress=None) -> dict:
        """Rewrite stored payloads with credentials sealed or in plaintext (:mod:`magpie.queue.migrate`).
        The PostgreSQL schedule refuses it: :class:`magpie.errors.RefusedError` ``unsupported``."""


def create_provider(url: str | None, settings, *, redis_client=None) -> ScheduleProvider:
    """The schedule provider for ``url``.

    Args:
        url: ``redis://``, ``rediss://``, ``unix://`` -> :class:`~magpie.queue.RouteQueue`, or with
            ``MAGPIE_SCHEDULE_PARTITIONS`` > 1 (or a repartition under way) a
            :class:`~magpie.queue.partitioned.PartitionedSchedule`;
            ``postgresql://`` or ``postgresql+psycopg2://`` -> :class:`~magpie.queue.pg.PgSchedule`.
            None or empty: the settings' ``schedule_url``, else their Redis URL.
        settings: a :class:`magpie.config.Settings` (or its ``schedule`` slice): prefix, shards, interval,
            lease, stall limit.
        redis_client: an existing redis-py client to reuse for a Redis URL equal to the settings' one.
    Raises :class:`magpie.errors.ConfigError` naming the accepted schemes for any other scheme;
    ``QueueError`` ``layout_mismatch`` as the providers' ``from_settings`` do.
    """
    sched = getattr(settings, "schedule", settings)
    url = url or getattr(settings, "schedule_url", None) or sched.redis_url
    scheme = scheme_of(url)
    if scheme in REDIS_SCHEMES:
        import redis

        from magpie.queue.routequeue import RouteQueue

        from magpie.queue.partitioned import PartitionedSchedule
        from magpie.queue.partitions import check_partition_layout

        client = redis_client if redis_client is not None and url == sched.redis_url else redisconn.connect(url)
        if int(getattr(sched, "partitions", 1) or 1) > 1 or check_partition_layout(client, sched.prefix, 1):
            return PartitionedSchedule.from_settings(sched, client)  # N > 1, or a repartition to 1 runs
        return RouteQueue.from_settings(sched, client)
    if scheme in POSTGRES_SCHEMES:
        from magpie.queue.pg import PgSchedule

        return PgSchedule.from_settings(sched, url, redis_client=redis_client)
    shown = f"{scheme}://" if scheme else "a URL without a scheme"
    raise ConfigError(f"MAGPIE_SCHEDULE_URL: {shown} is not served; accepted schemes: "
                      + ", ".join(f"{s}://" for s in SCHEMES))


# -- leases held by scripts (``magpie queue claim``): a token string stands for the lease -------------
def lease_token(lease: Lease) -> str:
    """The text a script keeps for ``lease``: ``<route hash>:<lease token>:<previous score>``."""
    return f"{lease.member}:{lease.lease_score}:{lease.previous_score}"


def lease_from_token(provider: ScheduleProvider, token: str) -> Lease:
    """The :class:`Lease` a :func:`lease_token` text stands for (payload as stored now).

    Raises :class:`magpie.errors.ConfigError` for text of another shape; the fenced call made with the
    lease then refuses a stale or unknown one (``lease_lost``, ``gone``).
    """
    parts = (token or "").strip().split(":")
    if len(parts) != 3 or not all(parts):
        raise ConfigError("lease token: expected <route>:<lease>:<previous> as `magpie queue claim` prints it")
    member, lease_score, previous = parts
    try:
        float(lease_score), float(previous)
    except ValueError:
        raise ConfigError("lease token: the lease and previous parts must be numbers") from None
    return Lease(member, provider.payload(member) or "", previous, lease_score, provider.shard_of(member))
