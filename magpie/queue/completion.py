"""Where completion appends results, and what it reports (``complete.lua``: one atomic step).

A check's result is recorded if and only if its lease completed: the completion script fences each lease,
reschedules the completed routes and appends their results to the results stream in the same script call,
so no crash point can complete a cycle without its result or record a result whose lease was refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StreamTarget:
    """The results stream a completion appends to.

    Attributes:
        key: the stream's key.
        group: the consumer group whose acknowledged entries may be trimmed to make room.
        maxlen: bound on unconsumed entries.
        policy: ``evict_oldest`` (the oldest unconsumed entries make room), ``drop_new`` (results past the
            room are dropped) or ``refuse`` (change nothing when the results do not fit; the caller waits
            and tries again: the ``block`` overflow policy).
    """

    key: str
    group: str
    maxlen: int
    policy: str = "evict_oldest"

    @classmethod
    def from_settings(cls, settings, tagged: bool | None = None) -> StreamTarget:
        """The deployment's results stream: ``<prefix>stats:results`` (``<prefix>{default}:stats:results``
        on a Redis Cluster, see :func:`magpie.queue.streams.stats_base`), the stats consumer group, the bound
        ``MAGPIE_STATS_STREAM_MAXLEN`` and the policy ``MAGPIE_STATS_OVERFLOW``. The one place the
        stream's bound is read; ``settings`` is a :class:`magpie.config.Settings`; ``tagged`` None: True
        when ``MAGPIE_REDIS_URL`` names a cluster. A partitioned schedule re-aims this target at each
        partition's own stream."""
        from magpie.base.redisconn import is_cluster_url
        from magpie.queue.streams import GROUP, stream_key

        st = settings.stream
        if tagged is None:
            tagged = is_cluster_url(settings.redis_url)
        return cls(stream_key(st.prefix, tagged), GROUP, st.maxlen, st.overflow)


@dataclass(slots=True)
class Completion:
    """What one completion call did.

    Attributes:
        codes: per lease, 1 completed, ``LEASE_LOST`` or ``GONE``.
        ids: per lease, the stream id of its result, or None (not completed, no result, or dropped).
        dropped: results lost to the stream bound (new ones dropped, or unconsumed old ones evicted).
        trimmed: consumed entries trimmed to make room (not a loss).
        full: True when a ``refuse`` call found no room and changed nothing.
    """

    codes: list[int] = field(default_factory=list)
    ids: list[str | None] = field(default_factory=list)
    dropped: int = 0
    trimmed: int = 0
    full: bool = False
