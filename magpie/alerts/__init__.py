"""Alerts (``alerts/`` in docs/design.md): rules over already recorded measurements, incidents, webhook delivery.

Python API:

* rules - :func:`create_rule`, :func:`edit_rule`, :func:`set_enabled`, :func:`get_rule`, :func:`list_rules`,
  :func:`delete_rule` (:mod:`magpie.alerts.rules`);
* channels - :func:`create_webhook_channel`, :func:`create_email_channel`, :func:`list_channels`,
  :func:`set_channel_enabled`, :func:`delete_channel` (:mod:`magpie.alerts.channels`);
* evaluation - :func:`evaluate_all`, :func:`run_evaluation` (leader-locked), :func:`apply_workspace`
  (:mod:`magpie.alerts.evaluate`) over :func:`measure_workspace` (:mod:`magpie.alerts.measure`) and the pure
  streak rules (:mod:`magpie.alerts.streaks`);
* delivery - :func:`run_delivery_workers`, :func:`deliver_one`, :func:`list_deliveries`,
  :func:`retry_delivery` (:mod:`magpie.alerts.delivery`).

Evaluation reads ``route_health`` and ``check_history``; it never checks a route or adds queue work.
"""

from magpie.alerts.channels import (
    Channel,
    create_email_channel,
    create_webhook_channel,
    delete_channel,
    list_channels,
    set_channel_enabled,
)
from magpie.alerts.delivery import deliver_one, list_deliveries, retry_delivery, run_delivery_workers
from magpie.alerts.evaluate import (
    EvaluationReport,
    Measurement,
    apply_workspace,
    evaluate_all,
    evaluate_workspace,
    incidents,
    measure_workspace,
    run_evaluation,
)
from magpie.alerts.rules import (
    Rule,
    RuleConflict,
    create_rule,
    delete_rule,
    edit_rule,
    get_rule,
    list_rules,
    set_enabled,
)
from magpie.alerts.webhook import WebhookRefused

__all__ = [
    "Channel",
    "EvaluationReport",
    "Measurement",
    "Rule",
    "RuleConflict",
    "WebhookRefused",
    "apply_workspace",
    "create_email_channel",
    "create_rule",
    "create_webhook_channel",
    "delete_channel",
    "delete_rule",
    "deliver_one",
    "edit_rule",
    "evaluate_all",
    "evaluate_workspace",
    "get_rule",
    "incidents",
    "list_channels",
    "list_deliveries",
    "list_rules",
    "measure_workspace",
    "retry_delivery",
    "run_delivery_workers",
    "run_evaluation",
    "set_channel_enabled",
    "set_enabled",
]
