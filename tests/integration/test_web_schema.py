"""The dashboard's JSON API against its own OpenAPI document (schemathesis), over seeded Redis/PostgreSQL.

Examples are generated from ``/api/openapi.json``, sent to the app in process, and every answer is checked:
no server error, a documented status code, content type and body schema. Few examples per operation, so
the run stays short.
"""

from __future__ import annotations

import pytest
import schemathesis
from browser.web_seed import seed
from hypothesis import HealthCheck
from hypothesis import settings as hyp_settings

TOKEN = "schema-token-0123456789abcdef"


def _app():
    from magpie.config import load_settings
    from magpie.web.app import create_app

    return create_app(load_settings(web_token=TOKEN, web_allowed_hosts="testserver,localhost"), sample=False)


APP = _app()  # the document needs no storage; each test gives the app its seeded clients
schema = schemathesis.openapi.from_asgi("/api/openapi.json", APP)
dashboard = schema.exclude(tag="program")  # the program API has its own run (test_api_schema.py)


@pytest.fixture(scope="module")
def seeded_app(pg_url):
    """The app over one seeded Redis prefix and the session database, for the whole module."""
    import uuid

    import redis
    import sqlalchemy as sa
    from conftest import REDIS_URL

    from magpie.config import load_settings
    from magpie.web.service import Dashboard

    prefix = f"magpie-test:{uuid.uuid4().hex[:12]}:"
    s = load_settings(redis_url=REDIS_URL, redis_prefix=prefix, database_url=pg_url, web_token=TOKEN,
                      encryption_key="test-key-0123456789abcdef", api_rate=100_000, api_burst=1_000_000)
    r = redis.Redis.from_url(REDIS_URL)
    engine = sa.create_engine(pg_url)
    seed(s, engine, r)
    idle = APP.state.dashboard
    APP.state.dashboard = Dashboard(s, redis=r, engine=engine)
    try:
        yield APP
    finally:
        APP.state.dashboard = idle
        for key in list(r.scan_iter(match=prefix + "*")) + list(r.scan_iter(match="{" + prefix + "*")):
            r.delete(key)
        with engine.begin() as c:
            c.execute(sa.text("TRUNCATE workspaces, routes, check_history RESTART IDENTITY CASCADE"))
        engine.dispose()
        r.close()


@dashboard.parametrize()
@hyp_settings(max_examples=8, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.filter_too_much])
def test_api_conforms_to_its_schema(case, seeded_app):
    headers = {"Authorization": f"Bearer {TOKEN}"} if case.method.upper() == "POST" else None
    case.call_and_validate(headers=headers)


def test_document_describes_every_action_refusal():
    doc = schema.raw_schema
    for path in ("/api/actions/pause", "/api/actions/resume", "/api/routes/{route_hash}/reprocess",
                 "/api/routes/{route_hash}/check-now"):
        assert {"200", "401", "403", "409"} <= set(doc["paths"][path]["post"]["responses"]), path
    assert "/api/status" in doc["paths"] and doc["info"]["title"] == "magpie dashboard"


def test_every_read_is_generated():
    """The parametrized test covers every operation of the document, the fleet reads among them."""
    ops = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert {("GET", "/api/rotators"), ("GET", "/api/instances")} <= ops
    assert len(ops) == sum(len(v) for v in schema.raw_schema["paths"].values())
    props = schema.raw_schema["components"]["schemas"]["RotatorView"]["properties"]
    assert "auth" in props and not {"username", "password", "password_enc"} & set(props)
