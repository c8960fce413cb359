"""Prometheus families of judge pools and the per-process caches, for the metrics exporter.

:func:`cache_families` reads every live process's cache record (:mod:`magpie.judges.cache`) from Redis:

* ``magpie_config_cache_revision{process}`` / ``magpie_config_cache_revision_lag{process}``: the
  check-config revision a process holds and how far it is behind the persisted one;
* ``magpie_config_cache_sync_age_seconds{process}``: seconds since its last successful reconcile;
* ``magpie_cache_hits_total`` / ``magpie_cache_misses_total`` / ``magpie_cache_evictions_total`` /
  ``magpie_cache_size`` / ``magpie_cache_max_size`` ``{process, cache}`` for the ``dns`` and ``plans``
  caches; ``magpie_judge_failovers_total{process}``.

The ``process`` label names the check process (``<host>-<pid>-<id>``); it is not ``instance``, which
Prometheus sets to the scrape target. Every exporter shows every process's record: aggregate with
``max by (process, ...)`` before summing.

:func:`judge_families` reads the ``judges`` table: ``magpie_judge_healthy{judge, pool}`` (1 or 0).
"""

from __future__ import annotations

import sqlalchemy as sa
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from magpie.judges.cache import read_cache_records


def cache_families(redis, prefix: str):
    """The families of the module doc built from the live cache records. Raises ``redis.RedisError``."""
    rev = GaugeMetricFamily("magpie_config_cache_revision", "Check-config revision a process holds",
                            labels=["process"])
    lag = GaugeMetricFamily("magpie_config_cache_revision_lag",
                            "Persisted check-config revision minus the one a process holds",
                            labels=["process"])
    age = GaugeMetricFamily("magpie_config_cache_sync_age_seconds",
                            "Seconds since a process last compared its cache with the persisted revision",
                            labels=["process"])
    fams = {name: cls(f"magpie_cache_{name}", text, labels=["process", "cache"]) for name, cls, text in (
        ("hits", CounterMetricFamily, "Lookups answered by a process's cache"),
        ("misses", CounterMetricFamily, "Lookups a process's cache could not answer"),
        ("evictions", CounterMetricFamily, "Entries pushed out of a process's cache by its size bound"),
        ("size", GaugeMetricFamily, "Entries in a process's cache"),
        ("max_size", GaugeMetricFamily, "Size bound of a process's cache"))}
    failovers = CounterMetricFamily("magpie_judge_failovers", "Checks retried through another judge",
                                    labels=["process"])
    for rec in read_cache_records(redis, prefix):
        inst = str(rec.get("instance"))
        rev.add_metric([inst], float(rec.get("revision") or 0))
        lag.add_metric([inst], float(rec.get("lag") or 0))
        if rec.get("since_sync_s") is not None:
            age.add_metric([inst], float(rec["since_sync_s"]))
        caches = rec.get("caches") or {}
        for cache in ("dns", "plans"):
            st = caches.get(cache) or {}
            for name, fam in fams.items():
                if name in st:
                    fam.add_metric([inst, cache], float(st[name]))
        if "failed_over" in caches:
            failovers.add_metric([inst], float(caches["failed_over"]))
    yield from (rev, lag, age, *fams.values(), failovers)


def judge_families(conn: sa.Connection):
    """``magpie_judge_healthy{judge, pool}`` from the ``judges`` table. Raises ``DBAPIError``."""
    fam = GaugeMetricFamily("magpie_judge_healthy", "1 when the judge refresh job's last probe succeeded",
                            labels=["judge", "pool"])
    for url, healthy, ws in conn.execute(sa.text(
            "SELECT j.url, j.healthy, w.name FROM judges j LEFT JOIN workspaces w ON w.id = j.workspace_id "
            "WHERE j.enabled ORDER BY j.id")):
        fam.add_metric([url, ws or "global"], 1.0 if healthy else 0.0)
    yield fam
