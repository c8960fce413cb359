"""The pipeline benchmark's own arithmetic and flags (benchmarks/pipeline_bench.py; no run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from magpie.importer.parse import parse_lines

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("pipeline_bench", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def specs(bench, *argv):
    ap = bench.make_parser()
    return bench.specs_from_args(ap, ap.parse_args(list(argv)))


def test_the_goal_form_measures_one_interval_after_one_interval(bench):
    (s,) = specs(bench, "--population", "mix", "--routes", "1000000", "--interval", "300")
    assert (s.name, s.routes, s.interval, s.warmup, s.seconds, s.timeout, s.attempts) == \
        ("mix", 1_000_000, 300.0, 300.0, 300.0, 10.0, 2)
    (q,) = specs(bench, "--quick-mix")
    assert (q.name, q.routes, q.interval, q.warmup, q.seconds) == ("mix", 200_000, 60.0, 60.0, 60.0)
    (short,) = specs(bench, "--population", "mix", "--routes", "20000", "--interval", "30", "--seconds", "20")
    assert (short.warmup, short.seconds) == (30.0, 20.0)
    assert [x.name for x in specs(bench)] == list(bench.POPULATIONS)  # every population by default


def test_ideal_rate_of_the_goal(bench):
    (s,) = specs(bench, "--population", "mix", "--routes", "1000000", "--interval", "300")
    # 700,000 tarpits / (300 + 2 x 10) + 300,000 others / 300
    assert bench.ideal_rate(s, 700_000, 300_000) == pytest.approx(2187.5 + 1000.0)


def test_tarpit_ports_hold_the_open_connections_under_the_reapers_low_mark(bench, monkeypatch):
    import magpie.lab.tarpit as tarpit

    monkeypatch.setattr(tarpit, "somaxconn", lambda default=4096: 4096)
    (s,) = specs(bench, "--population", "mix", "--routes", "1000000", "--interval", "300")
    # 700,000 x 20 / 320 = 43,750 open connections, four times that held; 70 % of 4096 per port -> 62 ports
    assert bench.TARPIT_HEADROOM == 4
    assert bench.tarpit_ports_per_lab(s, 700_000, 2) == 31
    assert bench.tarpit_ports_per_lab(s, 700_000, 1) == 62
    assert bench.tarpit_ports_per_lab(s, 1_000, 2) == bench.MIN_TARPIT_PORTS


def test_limited_by(bench):
    assert bench.limited_by({"achieved_ratio": 0.99}) == "none"
    assert bench.limited_by({"achieved_ratio": 0.8, "tarpit_reaped_waiting": 3}) == "lab:queues"
    assert bench.limited_by({"achieved_ratio": 0.8, "listen_overflows": 1}) == "lab:queues"
    few = {"achieved_ratio": 0.8, "listen_overflows": 12, "tarpit_reaped_waiting": 39,
           "by_kind": "echo:101051/tarpit:431203"}
    assert bench.limited_by(few) == "magpie"  # 51 of 431,203 tarpit checks cut short: not the limit
    assert bench.limited_by({**few, "listen_overflows": 900}) == "lab:queues"
    assert bench.limited_by({**few, "achieved_ratio": 1.0, "tarpit_reaped_waiting": 326_689}) == "lab:queues"
    busy = {"achieved_ratio": 0.8, "machine_cpu_util": 0.95}
    assert bench.limited_by({**busy, "lab_cpu_share": 0.4}) == "lab:cpu"
    assert bench.limited_by({**busy, "lab_cpu_share": 0.05, "unaccounted_cpu_util": 0.5}) == "other-load"
    assert bench.limited_by({**busy, "lab_cpu_share": 0.05, "unaccounted_cpu_util": 0.0}) == "magpie"


def test_mix_lines_spread_tarpits_over_every_lab_port_alternating_protocols(bench):
    labs = [{"tarpit": f"127.0.0.{h}:30000", "tarpits": [f"127.0.0.{h}:{30000 + i}" for i in (0, 5, 6)],
             "trickle": f"127.0.0.{h + 1}:30001", "slow": f"127.0.0.{h + 2}:30002",
             "echo": f"127.0.0.{h + 3}:30003", "refused": f"127.0.0.{h + 4}:30004"} for h in (20, 40)]
    (s,) = specs(bench, "--population", "mix", "--routes", "2000", "--interval", "30")
    lines, _ = bench.build_lines(s, labs)
    routes = parse_lines(lines).routes
    assert len(routes) == 2000
    tar = [r for r in routes if r.host in ("127.0.0.20", "127.0.0.40")]
    assert len(tar) == 1400 == bench.count_deadline_routes(lines, bench.host_kinds(labs))
    assert {(r.host, r.port, r.protocol) for r in tar} == {
        (h, p, proto) for h in ("127.0.0.20", "127.0.0.40") for p in (30000, 30005, 30006)
        for proto in ("http", "socks5")}


@pytest.mark.parametrize("argv", [["--quick-mix", "--population", "live"], ["--quick", "--quick-mix"],
                                  ["--seconds", "0"], ["--routes", "mix=x"], ["--routes", "nope=3"],
                                  ["--population", "nope"], ["--tarpit-ports", "0"]])
def test_bad_flags_are_one_line_usage_errors(bench, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        specs(bench, *argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error:" in err[-1], err
