"""How a check worker is sized from the cores and the open-file limit."""

from __future__ import annotations

import types

from magpie.checker.limits import size_check_worker


def test_two_cores_under_a_20000_fd_limit_give_three_processes_of_the_limit_less_the_reserve():
    s = size_check_worker(None, cores=2, limits=(1024, 20_000))
    assert (s.processes, s.per_process, s.auto, s.auto_per_process) == (3, 19_000, True, True)  # 5 % kept
    assert s.slots == 57_000
    line = s.describe()
    assert "3 processes x 19,000 checks" in line and "20,000" in line and "MAGPIE_CHECK_CONCURRENCY" in line
    assert "one per core plus one" in line and "open-file limit less 1,000" in line


def test_checks_per_process_are_capped_below_the_hard_limit():
    s = size_check_worker(50_000, cores=4, limits=(1024, 20_000))
    assert s.per_process == 19_000 and s.processes == 6 and not s.auto_per_process  # 100,000 wanted
    assert "checks per process: MAGPIE_CHECKS_PER_PROCESS" in s.describe()


def test_a_high_limit_keeps_the_default_per_process_and_one_process_per_core_plus_one():
    s = size_check_worker(None, cores=2, limits=(1024, 1_048_576))
    assert (s.processes, s.per_process) == (3, 20_000)
    assert size_check_worker(15_000, cores=2, limits=(1024, 1_048_576)).processes == 3  # operator's choice


def test_a_low_open_file_limit_adds_processes_up_to_four_per_core():
    s = size_check_worker(None, cores=2, limits=(1024, 4096))
    assert s.per_process == 4096 - 256 and s.processes == 8  # 50,000 wanted, four per core at most
    assert "enough processes for 25,000 checks per core" in s.describe()
    assert size_check_worker(None, cores=2, limits=(1024, 12_000)).processes == 5  # ceil(50,000 / 11,400)


def test_one_core_still_gets_two_processes_and_an_operator_choice_wins():
    assert size_check_worker(100, cores=1, limits=(1024, 1_048_576)).processes == 2
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
