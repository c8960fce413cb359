"""A process's in-memory copy of judges and profiles, following changes without a per-check read.

:class:`ConfigCache` holds one :class:`~magpie.judges.store.Snapshot`. A daemon thread listens on the
Redis channel ``<prefix>config:changed`` and, whether or not a notification arrives, compares the
revision it holds with the persisted one every ``MAGPIE_CONFIG_RECONCILE_SECONDS`` (one one-row query),
reloading the snapshot when they differ. A lost notification, a Redis outage or a blocked channel
therefore delays a change by at most one reconcile cadence. Readers take :attr:`ConfigCache.snapshot`
(one attribute read, no lock).

Each pass also writes the process's cache record (``<prefix>metrics:config_cache:<instance>``, a JSON
object with a TTL of three cadences): held and persisted revision, the revision lag, seconds since the
last successful reconcile and the stats of the process's other caches (DNS, plans) given as
``extra_stats``. :func:`read_cache_records` reads them back for the exporter.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from magpie.judges.store import Snapshot, channel, load_snapshot, read_revision

log = logging.getLogger(__name__)


def record_key(prefix: str, instance: str) -> str:
    """Key of one process's cache record."""
    return f"{prefix}metrics:config_cache:{instance}"


class ConfigCache:
    """See the module doc.

    Args:
        engine: SQLAlchemy engine on the magpie database (reads only).
        redis: client for the notifications and the cache record (None: reconcile only, no record).
        prefix: key prefix (``MAGPIE_REDIS_PREFIX``).
        reconcile_s: seconds between two revision comparisons.
        subscribe: listen for notifications (False: reconcile only; tests block the channel this way).
        extra_stats: ``extra_stats() -> dict`` of other caches' figures put into the cache record.
        on_change: ``on_change(snapshot)`` after a new snapshot is installed (in the cache's thread).
    """

    def __init__(self, engine, redis=None, prefix: str = "", *, reconcile_s: float = 5.0, subscribe: bool = True,
                 extra_stats: Callable[[], dict] | None = None,
                 on_change: Callable[[Snapshot], object] | None = None) -> None:
        self.engine = engine
        self.redis = redis
        self.prefix = prefix
        self.reconcile_s = float(reconcile_s)
        self.subscribe = subscribe
        self.extra_stats = extra_stats
        self.on_change = on_change
        self.instance = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.snapshot: Snapshot = Snapshot(0)
        self.persisted = 0
        self.reloads = 0
        self.notifications = 0
        self.last_sync = 0.0  # time.monotonic() of the last successful reconcile
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def lag(self) -> int:
        """Persisted revision (as last read) minus the revision held (0 when current)."""
        return max(0, self.persisted - self.snapshot.revision)

    def load(self) -> Snapshot:
        """Read the snapshot now and install it. Raises ``DBAPIError``."""
        snap = load_snapshot(self.engine)
        self._install(snap)
        self.persisted = max(self.persisted, snap.revision)
        self.last_sync = time.monotonic()
        return snap

    def _install(self, snap: Snapshot) -> None:
        if snap.revision == self.snapshot.revision and self.reloads:
            return
        self.snapshot = snap
        self.reloads += 1
        if self.on_change is not None:
            try:
                self.on_change(snap)
            except Exception:  # noqa: BLE001 - a listener never stops the cache
                log.exception("config change listener failed")

    def reconcile(self) -> bool:
        """Compare with the persisted revision and reload when it differs; True when a new snapshot was
        installed. Raises ``DBAPIError``."""
        self.persisted = read_revision(self.engine)
        self.last_sync = time.monotonic()
        if self.persisted != self.snapshot.revision:
            self.load()
            return True
        return False

    def start(self) -> ConfigCache:
        """Load once (a failure is logged; the thread keeps trying) and start the thread (idempotent)."""
        if self._thread is not None:
            return self
        try:
            self.load()
        except Exception as exc:  # noqa: BLE001 - checks run on the defaults until the database answers
            log.warning("check config not loaded yet (defaults in use): %s", exc)
        self._thread = threading.Thread(target=self._run, name="magpie-config-cache", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (returns within about a second)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _run(self) -> None:
        listener = threading.Thread(target=self._listen, name="magpie-config-listen", daemon=True) \
            if self.subscribe and self.redis is not None else None
        if listener is not None:
            listener.start()
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception as exc:  # noqa: BLE001 - the next cadence tries again
                log.warning("check config reconcile failed: %s", exc)
            self._write_record()
            self._wake.wait(self.reconcile_s)
            self._wake.clear()

    def _listen(self) -> None:
        """Wake the reconcile loop on every notification; reconnect after a Redis failure."""
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(channel(self.prefix))
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=1.0)
                    if msg and msg.get("type") == "message":
                        self.notifications += 1
                        try:
                            self.persisted = max(self.persisted, int(msg["data"]))
                        except (TypeError, ValueError):
                            pass
                        self._wake.set()
            except Exception as exc:  # noqa: BLE001 - reconciliation covers the gap
                log.debug("config notifications interrupted: %s", exc)
                self._stop.wait(min(self.reconcile_s, 5.0))
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception as exc:  # noqa: BLE001 - closing a broken connection
                        log.debug("pubsub close failed: %s", exc)

    def record(self) -> dict:
        """This process's cache record (see the module doc)."""
        out = {"instance": self.instance, "revision": self.snapshot.revision, "persisted": self.persisted,
               "lag": self.lag, "reloads": self.reloads, "notifications": self.notifications,
               "since_sync_s": round(time.monotonic() - self.last_sync, 3) if self.last_sync else None}
        if self.extra_stats is not None:
            try:
                out["caches"] = self.extra_stats()
            except Exception:  # noqa: BLE001
                log.debug("cache stats failed", exc_info=True)
        return out

    def _write_record(self) -> None:
        if self.redis is None:
            return
        try:
            self.redis.set(record_key(self.prefix, self.instance), json.dumps(self.record()),
                           px=int(self.reconcile_s * 3000) + 1000)
        except Exception:  # noqa: BLE001 - metrics never stop checks
            log.debug("cache record not written", exc_info=True)


def read_cache_records(redis, prefix: str, limit: int = 1000) -> list[dict]:
    """Every live process's cache record (see the module doc), at most ``limit``."""
    out = []
    for key in redis.scan_iter(match=record_key(prefix, "*"), count=500):
        raw = redis.get(key)
        if raw:
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
        if len(out) >= limit:
            break
    return out
