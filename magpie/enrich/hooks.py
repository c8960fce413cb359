"""Celery hooks: every worker process with GeoIP files configured listens for revision announcements.

Each process (the main one at ``worker_ready``, each pool child at ``worker_process_init``, after the fork)
starts one :func:`magpie.enrich.geo.listen` thread on the process's shared
:class:`~magpie.enrich.geo.GeoDatabases`; an announcement makes its next lookup look at the files again.
Nothing starts when no GeoIP file is configured.
"""

from __future__ import annotations

import logging
import os

from celery import signals
from magpie.base import redisconn

log = logging.getLogger(__name__)
_started: dict[str, int | None] = {"pid": None}


def start_listener() -> bool:
    """Start this process's announcement listener once (per pid); True when one was started."""
    if _started["pid"] == os.getpid():
        return False
    from magpie.config import get_settings

    settings = get_settings()
    if not (settings.geoip_country_db or settings.geoip_asn_db):
        return False
    import redis

    from magpie.enrich.geo import listen, shared

    client = redisconn.connect(settings.redis_url)
    listen(shared(settings, client), client)
    _started["pid"] = os.getpid()
    return True


@signals.worker_process_init.connect(weak=False)
def _on_child_init(**_kw) -> None:
    try:
        start_listener()
    except Exception as exc:  # noqa: BLE001 - enrichment still looks at the files on its interval
        log.warning("GeoIP announcements not followed: %s", exc)


@signals.worker_ready.connect(weak=False)
def _on_worker_ready(**_kw) -> None:
    _on_child_init()
