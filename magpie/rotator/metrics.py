"""Prometheus metrics of a rotator process, read from its listeners at scrape time.

Families (label ``rotator`` = the rotator's name): ``magpie_rotator_connections_total``,
``magpie_rotator_active_connections``, ``magpie_rotator_bytes_total`` (label ``direction`` = ``up``: client
to upstream, ``down``), ``magpie_rotator_upstream_failures_total``, ``magpie_rotator_no_route_total``,
``magpie_rotator_refused_total``, ``magpie_rotator_auth_failures_total`` (wrong or throttled
credentials), ``magpie_rotator_destination_refused_total`` (destinations the policy refused),
``magpie_rotator_rate_limited_total`` (connections over ``MAGPIE_ROTATOR_CLIENT_RATE``) and
``magpie_rotator_pool_size`` (eligible routes).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class RotatorCollector:
    """Collects the counters of a :class:`magpie.rotator.process.RotatorProcess`'s listeners."""

    def __init__(self, proc):
        self.proc = proc

    def describe(self):
        return []

    def collect(self):
        conns = CounterMetricFamily("magpie_rotator_connections", "Client connections accepted", labels=["rotator"])
        active = GaugeMetricFamily("magpie_rotator_active_connections", "Client connections open", labels=["rotator"])
        data = CounterMetricFamily("magpie_rotator_bytes", "Bytes tunnelled", labels=["rotator", "direction"])
        fails = CounterMetricFamily("magpie_rotator_upstream_failures", "Upstream routes that failed to connect",
                                    labels=["rotator"])
        none = CounterMetricFamily("magpie_rotator_no_route", "Connections refused: no route connected",
                                   labels=["rotator"])
        refused = CounterMetricFamily("magpie_rotator_refused", "Connections refused: auth or protocol",
                                      labels=["rotator"])
        auth = CounterMetricFamily("magpie_rotator_auth_failures", "Client authentications failed or throttled",
                                   labels=["rotator"])
        dest = CounterMetricFamily("magpie_rotator_destination_refused", "Destinations the policy refused",
                                   labels=["rotator"])
        limited = CounterMetricFamily("magpie_rotator_rate_limited",
                                      "Connections refused: the client address was over MAGPIE_ROTATOR_CLIENT_RATE",
                                      labels=["rotator"])
        pool = GaugeMetricFamily("magpie_rotator_pool_size", "Eligible routes", labels=["rotator"])
        for lis in list(self.proc.listeners.values()):
            n, st = lis.spec.name, lis.stats
            conns.add_metric([n], st.connections)
            active.add_metric([n], st.active)
            data.add_metric([n, "up"], st.bytes_up)
            data.add_metric([n, "down"], st.bytes_down)
            fails.add_metric([n], st.upstream_failures)
            none.add_metric([n], st.no_route)
            refused.add_metric([n], st.refused)
            auth.add_metric([n], st.auth_failures)
            dest.add_metric([n], st.destination_refused)
            limited.add_metric([n], st.rate_limited)
            pool.add_metric([n], len(lis.pool))
        yield from (conns, active, data, fails, none, refused, auth, dest, limited, pool)


def serve_metrics(proc, host: str, port: int) -> CollectorRegistry:
    """Serve ``/metrics`` of ``proc`` on ``host:port`` (a daemon thread); returns the registry.
    Raises ``OSError`` when the port cannot be bound."""
    reg = CollectorRegistry()
    reg.register(RotatorCollector(proc))
    start_http_server(port, addr=host, registry=reg)
    return reg
