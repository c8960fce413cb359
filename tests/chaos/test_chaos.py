"""The fault suite: each scenario of :mod:`magpie.lab.chaos` against the Procfile's real processes, private
Redis and PostgreSQL servers and the lab, asserting the guarantee it names (its ``failures`` list is empty).

Every scenario is a whole-system run (Celery processes, private servers, the lab) of 15-25 s even at small
sizes, so all of them run in the slow tier (``make test-all``, ``pytest -m slow tests/chaos``): the short
suite (:data:`magpie.lab.chaos.QUICK_DEFAULT`), the other scenarios at small sizes, and every scenario at
full size. The default tier covers faults with the killed-worker e2e test and the integration tests
(private Redis restarts, a stopped and a read-only database, the lab's fault servers).
``benchmarks/chaos.py`` runs the same
scenarios and prints their figures. Logs of a failed scenario stay in the test's ``tmp_path``.
"""

from __future__ import annotations

import pytest

from magpie.lab.chaos import QUICK_DEFAULT, SCENARIOS, TOTALS, WORKER_KILLS, run_scenario

pytestmark = pytest.mark.e2e


def _run(name, pg, quick, tmp_path, full=False, broker="redis"):
    out = run_scenario(name, pg, quick=quick, log_dir=tmp_path, keep_logs=True, full=full, broker=broker)
    print(out.line())
    assert not out.failures, f"{out.line()}\n" + "\n".join(out.failures) + f"\nlogs in {tmp_path}"
    assert any(k in out.figures for k in TOTALS), out.line()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", QUICK_DEFAULT)
def test_short_suite(name, private_pg, tmp_path):
    _run(name, private_pg, True, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_full_scenario(name, private_pg, tmp_path):
    _run(name, private_pg, False, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n in SCENARIOS if n not in QUICK_DEFAULT])
def test_short_scenario_outside_the_default_run(name, private_pg, tmp_path):
    _run(name, private_pg, True, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_loop_long_enough_for_routes_to_meet_several_crashes(private_pg, tmp_path):
    out = _run("kill-loop", private_pg, False, tmp_path, full=True)
    f = out.figures
    assert f["child_kills"] + f["worker_kills"] + f["kills_missed"] == 30 and f["kills_missed"] <= 3, f


@pytest.fixture
def rabbitmq():
    """Skips the test when RabbitMQ is not reachable on 127.0.0.1:5672 (each scenario makes its own vhost)."""
    from magpie.lab.rabbitmq import reachable

    if not reachable():
        pytest.skip("RabbitMQ not reachable on 127.0.0.1:5672")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [*WORKER_KILLS, "broker-restart"])
def test_worker_kill_scenarios_on_rabbitmq(name, private_pg, rabbitmq, tmp_path):
    """The worker-kill scenarios (and the broker's restart) with RabbitMQ's quorum queues as the broker:
    messages a killed worker held unacked come back at once, and still no route is lost or duplicated."""
    _run(name, private_pg, True, tmp_path, broker="amqp")
