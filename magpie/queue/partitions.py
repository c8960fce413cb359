"""Partitions of the Redis schedule (``MAGPIE_SCHEDULE_PARTITIONS``): names, the route -> partition function,
and the per-partition results and dead-letter streams.

A partition is one whole :class:`magpie.queue.RouteQueue` (its shards, lease index, dead letters, ...) under
its own Redis Cluster hash tag, so N partitions can live on up to N cluster masters while every script call
stays single-slot. One partition is today's layout, tag ``{default}``, unchanged. N > 1 are tagged
``{p0}`` .. ``{p<N-1>}``.

A route's partition is :func:`partition_of` its hash; within the partition its shard is the usual
``fnv1a_32(hash) % shards``. The two functions are independent (different hash functions), so every
partition spreads its routes over all its shards.

Deployment-wide side state (engine capacity, promote's budget, leader locks, the interval job's state, the
rebuild marker, the partition layout record) stays in ONE place whatever N is: the ``{default}`` tag
(``<prefix>{default}:<name>``), where it has always been.
"""

from __future__ import annotations

import hashlib

from magpie.errors import Refusal
from magpie.queue.keys import QueueKeys
from magpie.queue.lease import text as _s
from magpie.queue.refusals import QueueError

MAX_PARTITIONS = 1024
DEFAULT = "default"
"""The name (hash tag) of the single partition of an unpartitioned schedule, and of the side state."""


def _check(n: int) -> int:
    n = int(n)
    if not 1 <= n <= MAX_PARTITIONS:
        raise ValueError(f"MAGPIE_SCHEDULE_PARTITIONS must be within 1..{MAX_PARTITIONS}, got {n}")
    return n


def partition_names(n: int) -> list[str]:
    """Hash-tag names of ``n`` partitions: ``["default"]`` for 1 (today's keys), else ``["p0", .., "p<n-1>"]``.

    Raises ``ValueError`` when ``n`` is outside 1..1024."""
    n = _check(n)
    return [DEFAULT] if n == 1 else [f"p{i}" for i in range(n)]


def partition_of(route_hash: str, n: int) -> int:
    """The partition index (0..n-1) of route ``route_hash`` among ``n`` partitions.

    The first 8 bytes of BLAKE2b (digest size 8, personalised ``magpie-part``) of the hash's UTF-8 bytes,
    as a big-endian integer, modulo ``n``. Stable across processes and versions (no Python ``hash``), and
    independent of the shard function (FNV-1a 32 modulo the shard count), so partition and shard do not
    correlate. Raises ``ValueError`` when ``n`` is outside 1..1024.
    """
    n = _check(n)
    if n == 1:
        return 0
    d = hashlib.blake2b(route_hash.encode(), digest_size=8, person=b"magpie-part").digest()
    return int.from_bytes(d, "big") % n


def results_stream_key(prefix: str, name: str, tagged: bool) -> str:
    """The results stream of partition ``name``.

    Untagged (one partition on plain Redis): ``f"{prefix}stats:results"``, today's key. Tagged:
    ``f"{prefix}{{{name}}}:stats:results"``, in the partition's slot so ``complete.lua`` stays single-slot
    (a Redis Cluster deployment forces ``tagged`` on even for one partition)."""
    return f"{prefix}{{{name}}}:stats:results" if tagged else f"{prefix}stats:results"


def dead_stream_key(prefix: str, name: str, tagged: bool) -> str:
    """The dead-letter stream beside :func:`results_stream_key` (written with it in one ``MULTI`` and read
    with it by the redrive script): ``f"{prefix}stats:dead"`` or ``f"{prefix}{{{name}}}:stats:dead"``."""
    return f"{prefix}{{{name}}}:stats:dead" if tagged else f"{prefix}stats:dead"


def is_tagged(n: int, cluster: bool = False) -> bool:
    """Whether the streams of an ``n``-partition schedule carry the partition's tag (n > 1, or a cluster)."""
    return bool(cluster) or _check(n) > 1


def stream_pairs(prefix: str, n: int, tagged: bool | None = None, cluster: bool = False) -> list[tuple[str, str]]:
    """``[(results stream, dead-letter stream)]`` the ingestion reads for an ``n``-partition schedule.

    A tagged layout on one Redis server also lists the untagged pair first (entries written before a
    repartition from one partition drain from there) and, for N > 1, the ``{default}`` pair (where leases
    of the old ``{default}`` partition complete while a repartition from one partition runs); reading an
    empty stream costs one command. On a Redis Cluster (``cluster``) nothing was ever written untagged, so
    the untagged pair is left out (ingestion would create it)."""
    tagged = is_tagged(n) if tagged is None else bool(tagged)
    names = partition_names(n)
    if tagged and n > 1:
        names = [DEFAULT] + names
    pairs = [(results_stream_key(prefix, name, tagged), dead_stream_key(prefix, name, tagged)) for name in names]
    if tagged and not cluster:
        pairs.insert(0, (results_stream_key(prefix, DEFAULT, False), dead_stream_key(prefix, DEFAULT, False)))
    return pairs


def settings_stream_pairs(settings) -> list[tuple[str, str]]:
    """:func:`stream_pairs` of a :class:`magpie.config.Settings` (``redis_prefix``,
    ``schedule_partitions``; a ``redis_cluster`` setting, when present and true, forces tags on)."""
    n = int(getattr(settings, "schedule_partitions", 1) or 1)
    cluster = bool(getattr(settings, "redis_cluster", False))
    return stream_pairs(settings.redis_prefix, n, is_tagged(n, cluster), cluster)


def layout_key(prefix: str) -> str:
    """Where the partition count is recorded: ``<prefix>{default}:schedule_partitions`` (absent: 1)."""
    return f"{prefix}{{{DEFAULT}}}:schedule_partitions"


def repartition_key(prefix: str) -> str:
    """The running repartition's state (hash ``from``, ``to``, progress): ``<prefix>{default}:repartition``."""
    return f"{prefix}{{{DEFAULT}}}:repartition"


def check_partition_layout(client: redis.Redis, prefix: str, n: int) -> int | None:
    """Check ``MAGPIE_SCHEDULE_PARTITIONS=n`` against the partition count recorded in Redis.

    The record (:func:`~magpie.queue.partitions.layout_key`) is written on the first use of a partitioned
    layout (an absent record means one partition: today's schedule, which writes nothing new). Returns the
    old partition count while a repartition to ``n`` is running (claims then see both layouts), else None.
    Raises :class:`QueueError` ``layout_mismatch`` with a one-line detail when ``n`` differs from the record,
    when a repartition to another count runs, or when ``n`` > 1 meets a stored one-partition schedule.
    """
    have, mig = client.get(layout_key(prefix)), client.hgetall(repartition_key(prefix))
    mig = {_s(k): _s(v) for k, v in mig.items()}
    if mig.get("to"):
        if int(mig["to"]) != n:
            raise QueueError(Refusal.LAYOUT_MISMATCH, detail=(
                f"a repartition from {mig['from']} to {mig['to']} partitions is running, "
                f"MAGPIE_SCHEDULE_PARTITIONS={n}; set {mig['to']}"))
        return int(mig["from"])
    if have is None:
        if n == 1:
            return None
        old = QueueKeys(prefix, 1, DEFAULT)
        if client.exists(old.layout):  # a one-partition schedule was used here
            shards = int(_s(client.get(old.layout)) or 1)
            keys = QueueKeys(prefix, shards, DEFAULT)
            pipe = client.pipeline(transaction=False)
            for sh in keys.all_shards():
                pipe.exists(sh)
            pipe.exists(keys.dead)
            if any(pipe.execute()):
                raise QueueError(Refusal.LAYOUT_MISMATCH, detail=(
                    f"schedule has 1 partition, MAGPIE_SCHEDULE_PARTITIONS={n}; keep 1, or run "
                    f"`magpie queue repartition --to {n}`"))
        client.set(layout_key(prefix), str(n), nx=True)
        have = client.get(layout_key(prefix))
    have_n = int(_s(have))
    if have_n != n:
        raise QueueError(Refusal.LAYOUT_MISMATCH, detail=(
            f"schedule has {have_n} partitions, MAGPIE_SCHEDULE_PARTITIONS={n}; keep {have_n}, or run "
            f"`magpie queue repartition --to {n}`"))
    return None
