"""The shipped Prometheus rules: ``promtool check rules`` accepts them, and ``promtool test rules`` shows
the alerts fire (and stay quiet) on synthetic series: a job that never ran on an old and on a fresh
deployment, scheduled routes with no completed check, paused claiming, dead letters."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None,
                                    reason="promtool is not installed (Debian: apt-get install prometheus)")


def _annotations(alert: str, **subst: str) -> dict[str, str]:
    """The alert's annotations as promtool renders them, ``{{ ... }}`` replaced from ``subst``."""
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                out = {}
                for key, text in rule["annotations"].items():
                    for template, value in subst.items():
                        text = text.replace(template, value)
                    out[key] = text
                return out
    raise KeyError(alert)


STALE = _annotations("MagpieMaintenanceJobStale", **{"{{ $labels.maintenance_job }}": "partitions"})
NO_CHECKS = _annotations("MagpieNoChecksCompleting")
DEAD = _annotations("MagpieStatisticsDeadLetters", **{"{{ $value | humanize }}": "3"})


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_accepts_the_rules():
    res = _run("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def _unit_test(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    test = tmp_path / "rules_test.yml"
    test.write_text(f"rule_files:\n  - {RULES}\nevaluation_interval: 1m\ntests:\n" + textwrap.indent(
        textwrap.dedent(body), "  "))
    return _run("test", "rules", str(test))


@needs_promtool
def test_stale_job_alert_counts_from_the_deployment_start(tmp_path):
    # t=0: the deployment starts; "partitions" (hourly) never succeeds, "token_expiry" succeeds every minute.
    body = f"""
    - interval: 1m
      input_series:
        - series: 'magpie_deployment_created_timestamp_seconds'
          values: '0x300'
        - series: 'magpie_maintenance_cadence_seconds{{maintenance_job="partitions"}}'
          values: '3600x300'
        - series: 'magpie_maintenance_last_success_timestamp_seconds{{maintenance_job="partitions"}}'
          values: '0x300'
        - series: 'magpie_maintenance_cadence_seconds{{maintenance_job="token_expiry"}}'
          values: '60x300'
        - series: 'magpie_maintenance_last_success_timestamp_seconds{{maintenance_job="token_expiry"}}'
          values: '0+60x300'
      alert_rule_test:
        - eval_time: 2h
          alertname: MagpieMaintenanceJobStale
          exp_alerts: []
        - eval_time: 4h
          alertname: MagpieMaintenanceJobStale
          exp_alerts:
            - exp_labels: {{severity: warning, maintenance_job: partitions}}
              exp_annotations:
                summary: "{STALE['summary']}"
                description: "{STALE['description']}"
    """
    res = _unit_test(tmp_path, body)
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
def test_no_checks_alert_fires_unless_paused_and_dead_letters_alert(tmp_path):
    body = f"""
    - interval: 1m
      input_series:
        - series: 'magpie_queue_depth{{shard="0"}}'
          values: '10x40'
        - series: 'magpie_checks_total{{outcome="alive"}}'
          values: '5x40'
        - series: 'magpie_checks_total{{outcome="dead"}}'
          values: '0x40'
        - series: 'magpie_queue_paused'
          values: '0x40'
        - series: 'magpie_statistics_dead_letters'
          values: '3x40'
      alert_rule_test:
        - eval_time: 25m
          alertname: MagpieNoChecksCompleting
          exp_alerts:
            - exp_labels: {{severity: critical}}
              exp_annotations:
                summary: "{NO_CHECKS['summary']}"
                description: "{NO_CHECKS['description']}"
        - eval_time: 25m
          alertname: MagpieStatisticsDeadLetters
          exp_alerts:
            - exp_labels: {{severity: warning}}
              exp_annotations:
                summary: "{DEAD['summary']}"
                description: "{DEAD['description']}"
    - interval: 1m
      input_series:
        - series: 'magpie_queue_depth{{shard="0"}}'
          values: '10x40'
        - series: 'magpie_checks_total{{outcome="alive"}}'
          values: '5x40'
        - series: 'magpie_queue_paused'
          values: '1x40'
      alert_rule_test:
        - eval_time: 25m
          alertname: MagpieNoChecksCompleting
          exp_alerts: []
    - interval: 1m
      input_series:
        - series: 'magpie_queue_depth{{shard="0"}}'
          values: '10x40'
        - series: 'magpie_checks_total{{outcome="alive"}}'
          values: '5+10x40'
        - series: 'magpie_queue_paused'
          values: '0x40'
      alert_rule_test:
        - eval_time: 25m
          alertname: MagpieNoChecksCompleting
          exp_alerts: []
    """
    res = _unit_test(tmp_path, body)
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
def test_promtool_unit_test_harness_can_fail(tmp_path):
    body = """
    - interval: 1m
      input_series:
        - series: 'magpie_statistics_dead_letters'
          values: '0x40'
      alert_rule_test:
        - eval_time: 25m
          alertname: MagpieStatisticsDeadLetters
          exp_alerts:
            - exp_labels: {severity: warning}
    """
    assert _unit_test(tmp_path, body).returncode != 0


# -- two exporters of one deployment ------------------------------------------------------------------
# Every exporter shows the same deployment-wide series under its own `instance`. Each expression of the
# rules and the dashboard must give the same answer over one exporter's scrape and over two exporters'.

DASHBOARD = RULES.parents[1] / "grafana" / "magpie.json"
_SELECTOR = re.compile(r"\b(magpie_[a-zA-Z0-9_]+)(\{[^}]*\})?")
_RECORDED = re.compile(r"\bmagpie:[a-zA-Z0-9_:]+")
_EXPORTERS = {"single": ["10.0.0.1:9464"], "pair": ["10.0.0.1:9464", "10.0.0.2:9464"]}

# metric -> (label sets, values in a "busy" scenario, values in an "idle" one); 1-minute samples
_COUNT, _FLAT = "0+60x60", "5x60"
_SERIES = {
    "magpie_checks_total": ([{"outcome": o} for o in ("alive", "dead", "lease_lost")], _COUNT, _FLAT),
    "magpie_stale_completions_rejected_total": ([{}], _COUNT, _FLAT),
    "magpie_statistics_dropped_total": ([{"policy": "block"}, {"policy": "drop_new"}], _COUNT, _FLAT),
    "magpie_maintenance_failures_total": ([{"maintenance_job": "partitions"}], _COUNT, _FLAT),
    "magpie_maintenance_last_success_timestamp_seconds": ([{"maintenance_job": "partitions"}], "0x60",
                                                          "0x60"),
    "magpie_maintenance_cadence_seconds": ([{"maintenance_job": "partitions"}], "60x60", "60x60"),
    "magpie_deployment_created_timestamp_seconds": ([{}], "0x60", "0x60"),
    "magpie_exporter_source_up": ([{"source": "redis"}, {"source": "postgres"}], "1x60", "0x60"),
    "magpie_queue_depth": ([{"shard": "0"}, {"shard": "1"}], "100x60", "100x60"),
    "magpie_queue_leased": ([{"shard": "0"}, {"shard": "1"}], "10x60", "0x60"),
    "magpie_queue_expired_leases": ([{"shard": "0"}, {"shard": "1"}], "2x60", "0x60"),
    "magpie_queue_due_now": ([{"shard": "0"}, {"shard": "1"}], "50x60", "0x60"),
    "magpie_queue_oldest_lateness_seconds": ([{"shard": "0"}, {"shard": "1"}], "600x60", "0x60"),
    "magpie_queue_dead_letters": ([{}], "4x60", "0x60"),
    "magpie_queue_paused": ([{}], "0x60", "0x60"),
    "magpie_routes_alive": ([{"protocol": p, "anonymity": "elite", "workspace": w} for p in ("http", "socks5")
                             for w in ("acme", "beta")], "7x60", "7x60"),
    "magpie_statistics_backlog": ([{}], "90000x60", "0x60"),
    "magpie_statistics_pending": ([{}], "30x60", "0x60"),
    "magpie_statistics_stream_length": ([{}], "90000x60", "0x60"),
    "magpie_statistics_dead_letters": ([{}], "3x60", "0x60"),
    "magpie_statistics_ingest_backing_off": ([{}], "1x60", "0x60"),
    "magpie_statistics_ingest_infra_failures": ([{}], "9x60", "0x60"),
    "magpie_deliveries": ([{"channel": "webhook", "status": "sent"},
                           {"channel": "email", "status": "failed"}], "3x60", "3x60"),
    "magpie_leader_job_active": ([{"lock": "partitions"}, {"lock": "rebuild"}], "1x60", "1x60"),
}
for _hist, _late in (("magpie_check_lateness_seconds_bucket", "120"),
                     ("magpie_check_latency_seconds_bucket", "5")):
    _SERIES[_hist] = ([{"le": "1"}, {"le": _late}, {"le": "+Inf"}], _COUNT, _FLAT)
    _SERIES[_hist][0][0]["_values"] = "0+6x60"  # 10% under 1 s, the rest in the upper bucket

# alerts whose expression is expected non-empty in each scenario (the rest are quiet there)
_QUIET_WHEN_BUSY = {"MagpieExporterSourceDown", "MagpieNoChecksCompleting"}


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _dashboard_exprs() -> list[str]:
    out = []

    def walk(panels):
        for p in panels:
            out.extend(t["expr"].replace("$__rate_interval", "5m") for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


def _inline(expr: str, recorded: dict[str, str]) -> str:
    return _RECORDED.sub(lambda m: f"({recorded[m.group(0)]})", expr)


def _scrape_of(expr: str, job: str) -> str:
    """``expr`` over the series of one scrape set only (a ``job`` matcher added to every selector)."""
    def add(m):
        inner = (m.group(2) or "{}")[1:-1].strip()
        return f'{m.group(1)}{{job="{job}"{", " + inner if inner else ""}}}'
    return _SELECTOR.sub(add, expr)


def _same_over_one_and_two_exporters(expr: str) -> str:
    """0 when ``expr`` gives the same label sets and values over one exporter's series and over two's,
    also 0 when both are empty; else empty (a mismatch)."""
    one, two = _scrape_of(expr, "single"), _scrape_of(expr, "pair")
    return (f"((count(({two}) == ({one})) - count({two})) + (count({two}) - count({one})))"
            f" or on () (sum(absent({two})) * 0 + sum(absent({one})) * 0)")


def _input_series(scenario: int) -> str:
    lines = []
    for name, (label_sets, busy, idle) in _SERIES.items():
        for labels in label_sets:
            values = labels.get("_values") or (busy, idle)[scenario]
            for job, instances in _EXPORTERS.items():
                for inst in instances:
                    ls = {k: v for k, v in labels.items() if k != "_values"} | {"job": job, "instance": inst}
                    sel = ", ".join(f'{k}="{v}"' for k, v in ls.items())
                    lines.append(f"    - series: '{name}{{{sel}}}'\n      values: '{values}'")
    return "\n".join(lines)


def _exprs_in_files() -> list[tuple[str, str]]:
    """``(what, expr)`` of every recording rule, alert and dashboard query, recording rules inlined."""
    rules = _rules()
    recorded = {r["record"]: r["expr"] for r in rules if "record" in r}
    out = [(r.get("record") or r["alert"], _inline(r["expr"], recorded)) for r in rules]
    out += [(f"dashboard: {e}", e) for e in _dashboard_exprs()]
    return out


def test_the_two_exporter_series_cover_every_metric_the_rules_and_dashboard_use():
    used = {m.group(1) for _, e in _exprs_in_files() for m in _SELECTOR.finditer(e)}
    assert used - set(_SERIES) == set(), "add these to _SERIES"


@needs_promtool
def test_rules_and_dashboard_give_the_same_figures_over_one_and_two_exporters(tmp_path):
    exprs = _exprs_in_files()
    tests = []
    for scenario in (0, 1):
        checks = []
        for what, expr in exprs:
            checks.append(f"      - expr: '{_same_over_one_and_two_exporters(expr)}'\n"
                          f"        eval_time: 40m\n        exp_samples: [{{labels: '{{}}', value: 0}}]")
            alert = what.startswith("Magpie")
            if alert and (scenario == 0) == (what not in _QUIET_WHEN_BUSY):
                # the alert's expression has data in this scenario: the comparison above is not vacuous
                checks.append(f"      - expr: 'count({_scrape_of(expr, 'pair')}) > bool 0'\n"
                              f"        eval_time: 40m\n        exp_samples: [{{labels: '{{}}', value: 1}}]")
        tests.append(f"- interval: 1m\n  input_series:\n{_input_series(scenario)}\n"
                     f"  promql_expr_test:\n" + "\n".join(checks))
    test = tmp_path / "two_exporters_test.yml"
    test.write_text(f"rule_files:\n  - {RULES}\nevaluation_interval: 1m\ntests:\n"
                    + textwrap.indent("\n".join(tests), "  ") + "\n")
    res = _run("test", "rules", str(test))
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]


@needs_promtool
def test_checks_per_second_and_each_alert_count_once_with_two_exporters_scraped(tmp_path):
    # only the two exporters' series (both scraped): 60 alive + 60 dead checks a minute in the deployment
    quiet = tmp_path / "rules.yml"  # the shipped rules without annotations (the labels are under test)
    doc = yaml.safe_load(RULES.read_text())
    for rule in (r for g in doc["groups"] for r in g["rules"]):
        rule.pop("annotations", None)
    quiet.write_text(yaml.safe_dump(doc))
    busy = [r["alert"] for r in _rules() if "alert" in r and r["alert"] not in _QUIET_WHEN_BUSY]
    labels = {"MagpieMaintenanceJobStale": ", maintenance_job: partitions",
              "MagpieMaintenanceJobFailing": ", maintenance_job: partitions"}
    alerts = "\n".join(
        f"      - eval_time: 40m\n        alertname: {name}\n        exp_alerts:\n"
        f"          - exp_labels: {{severity: {_severity(name)}{labels.get(name, '')}}}" for name in busy)
    body = (f"- interval: 1m\n  input_series:\n{_pair_only(_input_series(0))}\n  promql_expr_test:\n"
            f"      - expr: magpie:checks_completed:rate1m\n        eval_time: 40m\n"
            f"        exp_samples: [{{labels: 'magpie:checks_completed:rate1m', value: 2}}]\n"
            f"      - expr: magpie:checks:rate5m\n        eval_time: 40m\n        exp_samples:\n"
            + "".join(f"          - {{labels: 'magpie:checks:rate5m{{outcome=\"{o}\"}}', value: 1}}\n"
                      for o in ("alive", "dead", "lease_lost"))
            + f"  alert_rule_test:\n{alerts}")
    test = tmp_path / "once_test.yml"
    test.write_text(f"rule_files:\n  - {quiet}\nevaluation_interval: 1m\ntests:\n"
                    + textwrap.indent(body, "  ") + "\n")
    res = _run("test", "rules", str(test))
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]


def _severity(alert: str) -> str:
    return next(r["labels"]["severity"] for r in _rules() if r.get("alert") == alert)


def _pair_only(series: str) -> str:
    """The input series of the two exporters only (one deployment scraped twice)."""
    out, keep = [], False
    for line in series.split("\n"):
        if line.startswith("    - series:"):
            keep = 'job="pair"' in line
        if keep:
            out.append(line)
    return "\n".join(out)
