"""Country and ASN of an address from operator-supplied MaxMind-format files, and a network-type guess.

Files: ``MAGPIE_GEOIP_COUNTRY_DB`` (a country or city database: ``country.iso_code``, else
``registered_country.iso_code``) and ``MAGPIE_GEOIP_ASN_DB`` (``autonomous_system_number``,
``autonomous_system_organization``), read with the ``maxminddb`` reader. Either may be unset.

Change detection: a process looks at the files' mtime and size at most every
``MAGPIE_GEOIP_CHECK_INTERVAL`` seconds, and at once after an announcement. When they moved it hashes the
contents (SHA-256); a new hash reopens the readers, empties the lookup cache and gives a new **revision**
(the first 16 hex digits of the hash of both files' hashes). The process that notices a new revision
announces it on the Redis channel ``<prefix>enrich:geoip`` (and stores it under the key of the same
name); every process listening (:func:`listen`) marks its files for a look at its next lookup, so
processes reload lazily. Rows of ``route_enrichment`` carry the revision they were computed from: the
``geo_enrichment`` job re-enriches rows of an older revision.

Network type, a guess from the ASN organisation name (case-insensitive, first rule that matches):

1. ``datacenter``: a hosting or cloud word (``hosting``, ``cloud``, ``data center``, ``datacenter``,
   ``server``, ``vps``, ``colo``, ``dedicated``, ``cdn``) or a known hosting or cloud operator
   (:data:`DATACENTER_NAMES`, e.g. Amazon, Google, Microsoft, DigitalOcean, OVH, Hetzner, Linode);
2. ``residential``: a consumer-access word (``broadband``, ``cable``, ``dsl``, ``fiber``/``fibre``,
   ``mobile``, ``wireless``, ``cellular``, ``telecom``, ``telekom``, ``telecommunications``) or a known
   consumer access provider (:data:`RESIDENTIAL_NAMES`, e.g. Comcast, Verizon, Vodafone, Orange);
3. ``isp``: any other named network (transit, business and research networks);
4. ``unknown``: no ASN organisation.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from magpie.enrich.caches import TTLCache
from magpie.errors import MagpieError

log = logging.getLogger(__name__)

_DATACENTER_WORDS = re.compile(r"hosting|cloud|data ?cent(er|re)|server|\bvps\b|\bcolo|dedicated|\bcdn\b",
                               re.IGNORECASE)
DATACENTER_NAMES = ("amazon", "aws", "google", "microsoft", "azure", "digitalocean", "ovh", "hetzner",
                    "linode", "akamai", "vultr", "choopa", "leaseweb", "contabo", "m247", "oracle", "alibaba",
                    "tencent", "scaleway", "cloudflare", "fastly", "hostinger", "ionos", "rackspace", "upcloud")
"""Organisation-name fragments taken as hosting or cloud operators."""
_RESIDENTIAL_WORDS = re.compile(r"broadband|cable|\bdsl|fib(er|re)|mobile|wireless|cellular|telecom|telekom",
                                re.IGNORECASE)
RESIDENTIAL_NAMES = ("comcast", "verizon", "at&t", "charter", "spectrum", "cox communications", "vodafone",
                     "orange", "telefonica", "movistar", "deutsche telekom", "british telecommunications", "sky ",
                     "jio", "airtel", "virgin media", "rogers", "bell canada", "free sas", "tim ", "claro")
"""Organisation-name fragments taken as consumer access providers."""


def network_type(as_org: str | None) -> str:
    """The module docstring's guess for an ASN organisation name: datacenter, residential, isp, unknown."""
    if not as_org or not as_org.strip():
        return "unknown"
    low = f" {as_org.lower()} "
    if _DATACENTER_WORDS.search(low) or any(n in low for n in DATACENTER_NAMES):
        return "datacenter"
    if _RESIDENTIAL_WORDS.search(low) or any(n in low for n in RESIDENTIAL_NAMES):
        return "residential"
    return "isp"


@dataclass(frozen=True, slots=True)
class GeoInfo:
    """What the files say about one address (None where they say nothing)."""

    country: str | None
    asn: int | None
    as_org: str | None
    network_type: str


class GeoError(MagpieError, RuntimeError):
    """A configured database file cannot be read or is not a MaxMind-format database."""


def channel(prefix: str) -> str:
    """The Redis channel (and key) of GeoIP revision announcements."""
    return f"{prefix}enrich:geoip"


class _File:
    """One database file: its reader, the stat it was opened at, its content hash."""

    def __init__(self, path: str | None):
        self.path = path
        self.stat: tuple[int, int] | None = None
        self.digest: str | None = None
        self.reader = None

    def moved(self) -> bool:
        if not self.path:
            return False
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise GeoError(f"cannot read GeoIP database {self.path!r}: {exc.strerror}") from None
        return (st.st_mtime_ns, st.st_size) != self.stat

    def reload(self) -> bool:
        """Re-open when the contents changed; True when they did. Raises :class:`GeoError`."""
        import maxminddb

        h = hashlib.sha256()
        try:
            st = os.stat(self.path)
            with open(self.path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        except OSError as exc:
            raise GeoError(f"cannot read GeoIP database {self.path!r}: {exc.strerror}") from None
        self.stat = (st.st_mtime_ns, st.st_size)
        if h.hexdigest() == self.digest:
            return False
        try:
            reader = maxminddb.open_database(self.path, maxminddb.MODE_MEMORY)
        except (OSError, ValueError, maxminddb.InvalidDatabaseError):
            raise GeoError(f"{self.path!r} is not a MaxMind-format database") from None
        old, self.reader, self.digest = self.reader, reader, h.hexdigest()
        if old is not None:
            old.close()
        return True

    def get(self, ip: str):
        return self.reader.get(ip) if self.reader is not None else None


class GeoDatabases:
    """The process's view of the two files (see the module docstring).

    Args:
        settings: :class:`magpie.config.Settings` (paths, check interval, cache size and TTL, prefix).
        redis: a client to announce new revisions on (None: no announcement).
        clock: monotonic seconds (tests).
    """

    def __init__(self, settings, redis=None, *, clock=time.monotonic):
        self.settings = settings
        self.redis = redis
        self._clock = clock
        self._files = (_File(settings.geoip_country_db), _File(settings.geoip_asn_db))
        self._lock = threading.Lock()
        self._next_look = 0.0
        self.revision: str | None = None
        self.cache = TTLCache("geoip", settings.enrich_cache_size, settings.enrich_cache_ttl, clock=clock)

    @property
    def configured(self) -> bool:
        """True when at least one file is configured."""
        return any(f.path for f in self._files)

    def invalidate(self) -> None:
        """Look at the files at the next lookup (an announcement arrived)."""
        self._next_look = 0.0

    def refresh(self, force: bool = False) -> bool:
        """Look at the files now (or when the check interval passed); reload what changed and announce a
        new revision. Returns True when the revision changed. Raises :class:`GeoError`."""
        with self._lock:
            now = self._clock()
            if not force and now < self._next_look:
                return False
            self._next_look = now + self.settings.geoip_check_interval
            changed = False
            for f in self._files:
                if f.path and (f.reader is None or f.moved()):
                    changed |= f.reload()
            if not changed and self.revision is not None:
                return False
            digest = hashlib.sha256("|".join(f.digest or "-" for f in self._files).encode()).hexdigest()[:16]
            if digest == self.revision:
                return False
            self.revision = digest
            self.cache.clear()
        log.info("GeoIP databases at revision %s", digest)
        self._announce(digest)
        return True

    def _announce(self, revision: str) -> None:
        if self.redis is None:
            return
        try:
            key = channel(self.settings.redis_prefix)
            if self.redis.getset(key, revision) not in (revision, revision.encode()):
                self.redis.publish(key, json.dumps({"revision": revision}))
        except Exception as exc:  # noqa: BLE001 - an announcement is best effort: others look on their interval
            log.warning("cannot announce GeoIP revision %s: %s", revision, exc)

    def lookup(self, host: str) -> GeoInfo | None:
        """Country, ASN and network type of an IP address (None for a host name or unconfigured files).

        Cached per address (``MAGPIE_ENRICH_CACHE_SIZE``, ``MAGPIE_ENRICH_CACHE_TTL``). Raises
        :class:`GeoError` when a configured file cannot be read."""
        if not self.configured:
            return None
        try:
            ip = str(ipaddress.ip_address(host))
        except ValueError:
            return None
        self.refresh()
        got = self.cache.get(ip)
        if got is not None:
            return got
        country_rec, asn_rec = (f.get(ip) for f in self._files)
        country = None
        if isinstance(country_rec, dict):
            for key in ("country", "registered_country"):
                code = (country_rec.get(key) or {}).get("iso_code")
                if code:
                    country = str(code).upper()
                    break
        asn = org = None
        if isinstance(asn_rec, dict):
            asn = asn_rec.get("autonomous_system_number")
            org = asn_rec.get("autonomous_system_organization")
        info = GeoInfo(country, int(asn) if asn is not None else None, org, network_type(org))
        self.cache.put(ip, info)
        return info


_SHARED: dict[tuple, GeoDatabases] = {}
_SHARED_LOCK = threading.Lock()


def shared(settings, redis=None) -> GeoDatabases:
    """The process's :class:`GeoDatabases` for ``settings``' paths (one per paths and prefix)."""
    key = (settings.geoip_country_db, settings.geoip_asn_db, settings.redis_prefix)
    with _SHARED_LOCK:
        geo = _SHARED.get(key)
        if geo is None:
            geo = _SHARED[key] = GeoDatabases(settings, redis)
        elif geo.redis is None and redis is not None:
            geo.redis = redis
        return geo


def listen(geo: GeoDatabases, redis, stop: threading.Event | None = None) -> threading.Thread:
    """Start a daemon thread that calls :meth:`GeoDatabases.invalidate` on every announcement.

    Returns the thread; setting ``stop`` ends it within about a second."""
    stop = stop or threading.Event()

    def run() -> None:
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(channel(geo.settings.redis_prefix))
        try:
            while not stop.is_set():
                try:
                    msg = pubsub.get_message(timeout=1.0)
                except Exception as exc:  # noqa: BLE001 - Redis restarts: the interval look still works
                    log.warning("GeoIP announcements: %s", exc)
                    stop.wait(1.0)
                    continue
                if msg and msg.get("type") == "message":
                    geo.invalidate()
        finally:
            pubsub.close()

    th = threading.Thread(target=run, name="geoip-listener", daemon=True)
    th.start()
    return th


__all__ = ["DATACENTER_NAMES", "RESIDENTIAL_NAMES", "GeoDatabases", "GeoError", "GeoInfo", "channel", "listen",
           "network_type", "shared"]
