"""Names on the results stream: its key, the dead-letter stream's key, the consumer group, the
ingestion's shared "database refuses writes" state.

Every module of :mod:`magpie.stats` takes its names from here, so the producer, the consumer, the status
read and the upkeep job cannot disagree on them.
"""

from __future__ import annotations

GROUP = "magpie-stats"
"""Consumer group name on the results stream."""

DEAD_MAXLEN = 100_000
"""Approximate cap on the dead-letter stream's length."""


SCHEDULE_TAG = "{default}"
"""Hash tag of the default schedule (:class:`magpie.queue.keys.QueueKeys`); the stream keys share it on a
cluster so that ``complete.lua`` (schedule keys + stream key) runs in one slot."""


def stats_base(prefix: str, tagged: bool = False) -> str:
    """The one decision on where the stats keys live: ``prefix`` on one Redis server (``tagged`` False,
    today's keys), ``f"{prefix}{{default}}:"`` on a Redis Cluster (``tagged`` True): the schedule's hash
    tag, so the completion script, the consumer's ``MULTI`` and the upkeep scripts stay in one slot."""
    return f"{prefix}{SCHEDULE_TAG}:" if tagged else prefix


def tagged_for(client) -> bool:
    """True when ``client`` is a Redis Cluster client: the stats keys then take the schedule's tag."""
    from magpie.base.redisconn import is_cluster

    return is_cluster(client)


def stream_key(prefix: str, tagged: bool = False) -> str:
    """Key of the results stream: ``f"{prefix}stats:results"`` (``f"{prefix}{{default}}:stats:results"``
    when ``tagged``, on a cluster)."""
    return stats_base(prefix, tagged) + "stats:results"


def dead_key(prefix: str, tagged: bool = False) -> str:
    """Key of the dead-letter stream: ``f"{prefix}stats:dead"`` (tagged like :func:`stream_key`)."""
    return stats_base(prefix, tagged) + "stats:dead"


def infra_key(prefix: str, tagged: bool = False) -> str:
    """Key of the ingestion's infrastructure-failure state (a hash, see :mod:`magpie.stats.infra`):
    ``f"{prefix}stats:infra"`` (tagged like :func:`stream_key`: the consumer's ``MULTI`` touches it)."""
    return stats_base(prefix, tagged) + "stats:infra"


LEDGER_SPACES = 1026
"""Ledger id spaces: 0 the untagged stream, 1..1024 partition ``p0``..``p1023``'s stream, 1025 another
tagged stream (``{default}`` on a cluster). See :func:`ledger_id`."""


def stream_space(key: str) -> int:
    """The ledger id space of results stream ``key`` (0 untagged, ``K + 1`` for tag ``pK``, 1025 another tag)."""
    i = key.find("{")
    j = key.find("}", i + 1)
    if i < 0 or j < 0:
        return 0
    tag = key[i + 1:j]
    if tag[:1] == "p" and tag[1:].isdigit() and int(tag[1:]) < LEDGER_SPACES - 2:
        return int(tag[1:]) + 1
    return LEDGER_SPACES - 1


def ledger_id(stream_id: str, space: int = 0) -> str:
    """The id an entry of stream id ``stream_id`` in ledger space ``space`` is recorded under.

    Stream ids are unique within one stream only, and every partition's stream feeds one ledger: space 0
    (the untagged stream) keeps the id as it is; a partition's stream records ``"<ms>-<seq * 1026 + space>"``,
    still a ``<ms>-<seq>`` id, ordered as its stream's ids are (so the replay floor keeps its meaning).
    Raises ``ValueError`` when ``stream_id`` is not numeric."""
    if not space:
        return stream_id
    ms, seq = id_parts(stream_id)
    return f"{ms}-{seq * LEDGER_SPACES + int(space)}"


def text(v) -> str:
    """A Redis reply value as ``str`` (``bytes`` decoded as UTF-8, bad bytes replaced)."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def id_parts(stream_id: str) -> tuple[int, int]:
    """``"<ms>-<seq>"`` as ``(ms, seq)`` ints (a missing ``seq`` reads as 0).

    Raises ``ValueError`` when a part is not numeric."""
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)
