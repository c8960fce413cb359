"""``/livez`` and ``/readyz`` on the metrics server, over real HTTP against real Redis, PostgreSQL and
broker (Redis), and against unreachable ones (closed ports on loopback)."""

from __future__ import annotations

import pytest
import requests

from magpie.observability.metrics import serve
from magpie.observability.probes import READY_PROBES, Readiness

SECRET = "s3cret-broker-passw0rd"


@pytest.fixture
def start():
    servers = []

    def _start(settings, **kw):
        server, thread = serve(settings, "127.0.0.1", 0, **kw)
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.server_port}"

    yield _start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _ready_settings(settings, redis_prefix):
    return settings.model_copy(update={"broker_url": settings.redis_url,
                                       "broker_key_prefix": redis_prefix + "b:"})


def test_readyz_is_200_with_the_three_probes_when_services_answer(settings, db, redis_prefix, start):
    base = start(_ready_settings(settings, redis_prefix))
    resp = requests.get(base + "/readyz", timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["Content-Type"] == "application/json"
    body = resp.json()
    assert body["ready"] is True and set(body["checks"]) == set(READY_PROBES)
    assert all(c["ok"] for c in body["checks"].values())
    live = requests.get(base + "/livez", timeout=5)
    assert live.status_code == 200 and live.text == "ok\n"
    metrics = requests.get(base + "/metrics", timeout=10)
    assert metrics.status_code == 200 and "magpie_exporter_source_up" in metrics.text
    assert requests.get(base + "/nope", timeout=5).status_code == 404


def test_readyz_is_503_naming_the_broker_without_its_password(settings, db, redis_prefix, start):
    down = _ready_settings(settings, redis_prefix).model_copy(
        update={"broker_url": f"redis://:{SECRET}@127.0.0.1:1/0", "health_timeout": 1.0})
    base = start(down)
    resp = requests.get(base + "/readyz", timeout=30)
    assert resp.status_code == 503, resp.text
    body = resp.json()
    assert body["ready"] is False
    checks = body["checks"]
    assert not checks["broker"]["ok"] and checks["redis"]["ok"] and checks["postgres"]["ok"]
    assert SECRET not in resp.text


def test_livez_answers_while_redis_and_postgres_are_down(settings, start):
    down = settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0", "health_timeout": 1.0,
                                       "database_url": "postgresql+psycopg2://postgres@127.0.0.1:1/none",
                                       "broker_url": "redis://127.0.0.1:1/0"})
    base = start(down)
    assert requests.get(base + "/livez", timeout=5).status_code == 200
    resp = requests.get(base + "/readyz", timeout=30)
    assert resp.status_code == 503
    assert {n for n, c in resp.json()["checks"].items() if not c["ok"]} == set(READY_PROBES)
    assert requests.get(base + "/metrics", timeout=10).status_code == 200  # a scrape never fails as a whole


def test_readiness_is_computed_once_per_second_and_a_broken_probe_is_not_ready():
    runs = []

    def probe(_settings):
        runs.append(1)
        return {"ready": True, "checks": {n: {"ok": True, "detail": "ok", "ms": 1.0} for n in READY_PROBES}}

    ready = Readiness(object(), probe=probe)
    assert ready()["ready"] and ready()["ready"] and len(runs) == 1

    def broken(_settings):
        raise RuntimeError(f"boom redis://u:{SECRET}@h/0")

    rep = Readiness(object(), probe=broken)()
    assert rep["ready"] is False and SECRET not in str(rep) and "boom" in rep["checks"]["probe"]["detail"]
