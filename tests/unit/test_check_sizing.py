"""How a check worker is sized from the cores and the open-file limit."""

from __future__ import annotations

import types

from magpie.checker.limits import size_check_worker


def test_two_cores_under_a_20000_fd_limit_give_three_processes():
    s = size_check_worker(15_000, cores=2, limits=(1024, 20_000))
    assert (s.processes, s.per_process, s.auto) == (3, 15_000, True)
    assert s.slots == 45_000
    line = s.describe()
    assert "3 processes x 15,000 checks" in line and "20,000" in line and "MAGPIE_CHECK_CONCURRENCY" in line


def test_checks_per_process_are_capped_below_the_hard_limit():
    s = size_check_worker(50_000, cores=4, limits=(1024, 20_000))
    assert s.per_process == 20_000 - 256 and s.processes == 5


def test_one_core_still_gets_two_processes_and_an_operator_choice_wins():
    assert size_check_worker(100, cores=1, limits=(1024, 4096)).processes == 2
    s = size_check_worker(100, 7, cores=1, limits=(1024, 4096))
    assert (s.processes, s.auto) == (7, False) and "--concurrency" in s.describe()


def test_a_worker_without_concurrency_is_sized_and_one_with_it_is_left_alone(monkeypatch):
    from magpie.wiring import worker
    from magpie.config import get_settings

    monkeypatch.setenv("MAGPIE_CHECK_CONCURRENCY", "4")
    get_settings.cache_clear()
    try:
        conf = types.SimpleNamespace(worker_concurrency=None)
        worker.size_check_processes(conf, None)
        assert conf.worker_concurrency == 4
        conf = types.SimpleNamespace(worker_concurrency=None)
        worker.size_check_processes(conf, 9)
        assert conf.worker_concurrency is None  # --concurrency given: Celery uses it as it is
        assert worker._state.pop("sizing").processes == 9
    finally:
        monkeypatch.delenv("MAGPIE_CHECK_CONCURRENCY")
        get_settings.cache_clear()
