"""The shipped Prometheus rules: ``promtool check rules`` accepts them, and ``promtool test rules`` shows
the alerts fire (and stay quiet) on synthetic series: a job that never ran on an old and on a fresh
deployment, scheduled routes with no completed check, paused claiming, dead letters."""

from __future__ import annotations

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
