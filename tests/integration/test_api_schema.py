"""The program API (tag ``program``) against its own OpenAPI document (schemathesis), with API tokens of each
strength, over real Redis and PostgreSQL: no server error, documented statuses, bodies as documented.

Import URLs are never resolved (the app's resolver is a stub that fails) and the egress guard refuses
every IP literal outside loopback, so generated ``source_url`` values dial nothing.
"""

from __future__ import annotations

import uuid

import pytest
import schemathesis
from hypothesis import HealthCheck
from hypothesis import settings as hyp_settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

WEB_TOKEN = "schema-web-token-0123456789"


def _no_dns(host, *a, **kw):
    raise OSError("name resolution is off in this test")


def _app():
    from magpie.config import load_settings
    from magpie.web.app import create_app

    app = create_app(load_settings(web_token=WEB_TOKEN, web_allowed_hosts="testserver,localhost"), sample=False)
    app.state.resolve = _no_dns
    return app


APP = _app()
schema = schemathesis.openapi.from_asgi("/api/openapi.json", APP).include(tag="program")
TOKENS: dict[str, str] = {}


@pytest.fixture(scope="module")
def seeded_app(pg_url):
    """The app over its own Redis prefix and the session database: two workspaces, routes with history,
    a token of each role."""
    import redis
    import sqlalchemy as sa
    from conftest import REDIS_URL, empty_tables

    from magpie.apitokens.store import create_token
    from magpie.config import load_settings
    from magpie.admin.operations import create_workspace
    from magpie.web.service import Dashboard

    prefix = f"magpie-test:{uuid.uuid4().hex[:12]}:"
    s = load_settings(redis_url=REDIS_URL, redis_prefix=prefix, database_url=pg_url, web_token=WEB_TOKEN,
                      encryption_key="test-key-0123456789abcdef", api_rate=100_000, api_burst=1_000_000)
    r = redis.Redis.from_url(REDIS_URL)
    engine = sa.create_engine(pg_url)
    for ws in ("acme", "beta"):
        create_workspace(engine, ws)
    TOKENS.update(read=create_token(engine, role="read", workspace="acme")["secret"],
                  operate=create_token(engine, role="operate", workspace="acme")["secret"],
                  admin=create_token(engine, role="admin", workspace=None)["secret"])
    idle = APP.state.dashboard
    APP.state.dashboard = Dashboard(s, redis=r, engine=engine)
    try:
        from fastapi.testclient import TestClient

        with TestClient(APP) as c:
            res = c.post("/api/imports", content=b"127.0.6.1:80\nsocks5://u:p@127.0.6.2:1080\n",
                         params={"workspace": "acme"},
                         headers={"Authorization": f"Bearer {TOKENS['operate']}", "Content-Type": "text/plain"})
            assert res.status_code == 201, res.text
        yield APP
    finally:
        APP.state.dashboard = idle
        for key in list(r.scan_iter(match="*" + prefix + "*")):
            r.delete(key)
        empty_tables(engine)
        engine.dispose()
        r.close()


@pytest.mark.parametrize("role", ["read", "operate", "admin"])
@schema.parametrize()
@hyp_settings(max_examples=8, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.filter_too_much])
def test_program_api_conforms_to_its_schema(case, role, seeded_app):
    # An import may be refused for what no schema states (a source_url that does not answer, no workspace
    # named by a token without one, an unknown workspace to
    # export): 422 with one line; the other checks all apply.
    excluded = [positive_data_acceptance] if case.operation.path in ("/api/imports", "/api/export") else None
    response = case.call_and_validate(headers={"Authorization": f"Bearer {TOKENS[role]}"}, excluded_checks=excluded)
    assert response.status_code < 500


def test_every_program_operation_is_generated():
    ops = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert ops == {("GET", "/api/routes"), ("GET", "/api/routes/{route_hash}"),
                   ("GET", "/api/routes/{route_hash}/history"), ("POST", "/api/imports"),
                   ("GET", "/api/imports/{job_id}"), ("GET", "/api/export")}
    doc = schema.raw_schema
    for method, path in ops:
        assert {"401", "403", "429"} <= set(doc["paths"][path][method.lower()]["responses"]), path
    assert set(doc["paths"]["/api/imports"]["post"]["requestBody"]["content"]) == {"text/plain", "application/json"}
