"""The one Redis client factory of magpie: a plain Redis or a Redis Cluster, named by the URL.

* ``redis://``, ``rediss://``, ``unix://``: one server, built with ``redis.Redis.from_url`` as before.
* ``redis+cluster://host:port[,host:port...]/`` (``rediss+cluster://`` for TLS): a Redis Cluster through
  redis-py's :class:`redis.RedisCluster`; the listed nodes are the startup nodes (any reachable one is
  enough, the client learns the slot map from it). ``user:password@`` before the first node is used for
  every node. A cluster has database 0 only: the path is empty, ``/`` or ``/0``.

:func:`connect` builds the client, :func:`is_cluster` tells the two apart, :func:`mget` and
:func:`delete_many` are the multi-key reads and deletes that work on both (on a cluster the keys are split
by slot; such a call is then not atomic across slots), :func:`load_scripts` loads Lua scripts on every
primary before a cluster pipeline runs them, :func:`server_time` is ``TIME`` (a cluster pipeline refuses
it), :func:`refresh_slots` makes a cluster client learn the slot map again. No message here ever quotes a
URL: it may hold a password.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

import redis

from magpie.errors import MagpieError

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
"""URL schemes naming a Redis Cluster."""
PLAIN_SCHEMES = ("redis", "rediss", "unix")
"""URL schemes naming one Redis server."""


CLUSTER_REQUEST_TTL = 64
"""Redirections (MOVED/ASK) and TRYAGAIN replies a cluster command follows before ``ClusterError("TTL
exhausted")``; past the first half they are 50 ms apart, so 64 waits out about 1.6 s of a slot migration
whose keys are split between two nodes (multi-key scripts get TRYAGAIN then)."""


class RedisUrlError(MagpieError, ValueError):
    """A Redis URL magpie cannot use; the message says what is wrong and never quotes the URL."""


class ClusterUnreachable(MagpieError, redis.ConnectionError):
    """No startup node of a Redis Cluster answered while the client was being built (a cluster client
    learns the slot map at construction, unlike a plain client, which connects on its first command)."""


def scheme_of(url: str) -> str:
    """The URL's scheme in lower case (``""`` when there is none)."""
    scheme, sep, _ = str(url).partition("://")
    return scheme.lower() if sep else ""


def is_cluster_url(url: str) -> bool:
    """True when ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return scheme_of(url) in CLUSTER_SCHEMES


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], dict]:
    """Parse a cluster URL into its startup nodes and the connection options it carries.

    Returns ``([(host, port), ...], {"username"?, "password"?, "ssl"?})``. Raises :class:`RedisUrlError`
    (one line, no URL in it) when the scheme is not a cluster scheme, a node has no host or a bad port,
    or the path names a database other than 0.
    """
    scheme = scheme_of(url)
    if scheme not in CLUSTER_SCHEMES:
        raise RedisUrlError("a cluster URL must start with redis+cluster:// or rediss+cluster://")
    rest = url.split("://", 1)[1]
    netloc, _, tail = rest.partition("/")
    path, _, _query = tail.partition("?")
    if path not in ("", "0"):
        raise RedisUrlError("a Redis Cluster has database 0 only: end the cluster URL with / or /0")
    opts: dict = {}
    if "@" in netloc:
        auth, netloc = netloc.rsplit("@", 1)
        user, sep, password = auth.partition(":")
        if sep:
            opts["password"] = unquote(password)
            if user:
                opts["username"] = unquote(user)
        elif user:
            opts["password"] = unquote(user)  # redis://secret@host form
    nodes: list[tuple[str, int]] = []
    for i, part in enumerate(netloc.split(","), 1):
        part = part.strip()
        try:
            parsed = urlsplit("//" + part)
            host, port = parsed.hostname, parsed.port or 6379
        except ValueError:
            raise RedisUrlError(f"cluster URL node {i} is not host:port") from None
        if not host:
            raise RedisUrlError(f"cluster URL node {i} has no host (write host:port[,host:port...])")
        nodes.append((host, port))
    if scheme == "rediss+cluster":
        opts["ssl"] = True
    return nodes, opts


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot name magpie's Redis, as one line without the URL, or None when it can."""
    scheme = scheme_of(url)
    if scheme in CLUSTER_SCHEMES:
        try:
            cluster_nodes(url)
        except RedisUrlError as exc:
            return str(exc)
        return None
    if scheme not in PLAIN_SCHEMES:
        return "must be a redis://, rediss://, unix://, redis+cluster:// or rediss+cluster:// URL"
    return None


class CommandPacker:
    """Packs a command for the wire in one C call (``hiredis.pack_command``) instead of redis-py's
    per-argument Python encoding: a completion carries tens of thousands of arguments per call, and the
    per-argument path cost about 0.9 µs each (9x the C call). Arguments hiredis does not take (bool, None,
    bytearray, ...) go through redis-py's own packer, which packs them or raises its ``DataError`` as before.
    Stateless: one instance serves every connection of a client."""

    def __init__(self) -> None:
        import hiredis
        from redis._parsers.encoders import Encoder
        from redis.connection import PythonRespSerializer

        self._pack = hiredis.pack_command
        self._fallback = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode).pack

    def pack(self, *args) -> list:
        first = args[0]
        if isinstance(first, str) and " " in first or isinstance(first, bytes) and b" " in first:
            args = (*first.split(), *args[1:])  # 'CLIENT SETNAME' and the like: separate words on the wire
        try:
            return [self._pack(args)]
        except TypeError:
            return self._fallback(*args)


def _fast_packer(kw: dict):
    """A :class:`CommandPacker` when this client encodes as redis-py's default (UTF-8, strict) and hiredis
    is installed; else None (redis-py's packer)."""
    if kw.get("encoding", "utf-8").lower() not in ("utf-8", "utf8") or kw.get("encoding_errors", "strict") != "strict":
        return None
    try:
        return CommandPacker()
    except ImportError:  # pragma: no cover - hiredis is a dependency
        return None


def connect(url: str, **kw) -> redis.Redis | redis.RedisCluster:
    """A client for the Redis (or Redis Cluster) that ``url`` names.

    Args:
        url: ``redis://``, ``rediss://``, ``unix://`` (one server) or ``redis+cluster://h:p[,h:p...]/``,
            ``rediss+cluster://...`` (a cluster).
        kw: connection options passed through (``decode_responses``, ``socket_timeout`` s,
            ``socket_connect_timeout`` s, ``health_check_interval`` s, ...).

    Returns a :class:`redis.Redis` or a :class:`redis.RedisCluster`. Building a cluster client connects
    to a startup node to learn the slot map; raises :class:`ClusterUnreachable` (a
    :class:`redis.ConnectionError`) when none answers, :class:`RedisUrlError` for a malformed URL.
    """
    if not is_cluster_url(url):
        if scheme_of(url) not in PLAIN_SCHEMES:
            raise RedisUrlError(url_problem(url) or "not a Redis URL")
        if "command_packer" not in kw and (packer := _fast_packer(kw)) is not None:
            kw["command_packer"] = packer
        return redis.Redis.from_url(url, **kw)
    from redis.cluster import ClusterNode

    nodes, opts = cluster_nodes(url)
    kw = {**opts, **kw}
    kw.pop("db", None)
    try:
        client = redis.RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **kw)
    except redis.exceptions.RedisClusterException as exc:  # not a RedisError: callers catch those
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ClusterUnreachable(f"no startup node of the Redis Cluster answered ({len(nodes)} listed): {first}") \
            from None
    # redirections and TRYAGAIN replies one command follows before giving up (redis-py: 16, of which
    # the second half 50 ms apart: ~0.4 s of a half-moved slot); 64 rides out ~1.6 s of a slot migration
    client.RedisClusterRequestTTL = CLUSTER_REQUEST_TTL
    return client


def is_cluster(client) -> bool:
    """True when ``client`` is a Redis Cluster client (:class:`redis.RedisCluster` or its pipeline)."""
    from redis.cluster import ClusterPipeline

    return isinstance(client, (redis.RedisCluster, ClusterPipeline))


def mget(client, keys: Sequence) -> list:
    """``MGET keys`` on one server; on a cluster split by slot (not atomic across slots). Values in the
    order of ``keys`` (None for a missing key); ``[]`` for no keys."""
    keys = list(keys)
    if not keys:
        return []
    if is_cluster(client):
        return client.mget_nonatomic(keys)
    return client.mget(keys)


def delete_many(client, keys: Sequence, batch: int = 500) -> int:
    """Delete ``keys`` in batches of ``batch`` (on a cluster each batch is split by slot). Returns how many
    existed."""
    keys = list(keys)
    n = 0
    for i in range(0, len(keys), batch):
        n += int(client.delete(*keys[i:i + batch]))
    return n


def load_scripts(client, scripts) -> None:
    """Before a cluster pipeline runs ``scripts`` (``redis.commands.core.Script`` objects): ``SCRIPT LOAD``
    each on every primary, again whenever the set of primaries changed (a failover promotes a replica
    without the scripts; redis-py's cluster pipelines do not load them as plain pipelines do). No-op on
    one Redis server. Raises ``redis.RedisError`` when a primary is unreachable."""
    if not isinstance(client, redis.RedisCluster):
        return
    primaries = frozenset(n.name for n in client.get_primaries())
    loaded = client.__dict__.setdefault("_magpie_scripts_on", {})
    for s in scripts:
        if loaded.get(s.sha) != primaries:
            client.script_load(s.script)
            loaded[s.sha] = primaries


def server_time(client, key: str | None = None) -> tuple[int, int]:
    """``TIME`` as ``(seconds, microseconds)``; on a cluster asked of the primary serving ``key`` (the clock
    a script on that key sees), a random node without one. Raises ``redis.RedisError``."""
    if isinstance(client, redis.RedisCluster):
        node = client.get_node_from_key(key) if key is not None else client.get_random_node()
        sec, usec = client.time(target_nodes=node)
    else:
        sec, usec = client.time()
    return int(sec), int(usec)


def refresh_slots(client) -> None:
    """Make a cluster client learn the slot map again (after a call that went to one node directly failed
    to connect: a failover). Errors are swallowed: the next command through the client retries."""
    try:
        client.nodes_manager.initialize()
    except Exception:  # noqa: BLE001 - best effort; the cluster client refreshes on its next error too
        pass
