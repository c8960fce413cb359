"""Beat entries of the alert and email jobs (collected by :func:`magpie.wiring.celery_config.build`).

Every entry expires after about one period, so a backlog of triggers (beat running while workers were
down) is dropped instead of replayed: the rows in PostgreSQL, not the broker, hold the work.
"""

from __future__ import annotations

from datetime import timedelta


def beat_entries(settings) -> dict:
    """Celery ``beat_schedule`` entries (name -> ``{task, schedule, options: {expires}}``).

    Args:
        settings: :class:`magpie.config.Settings` (``alert_eval_interval``, ``delivery_interval``,
            ``email_interval``, ``outbox_housekeeping_interval``; seconds).
    Returns:
        ``alerts-evaluate`` (``magpie.alerts.evaluate``), ``delivery-drain`` (``magpie.delivery.drain``),
        ``email-drain`` (``magpie.email.drain``) and ``email-housekeeping`` (``magpie.email.housekeeping``).
    """

    def entry(task: str, every: float, expires: float) -> dict:
        return {"task": task, "schedule": timedelta(seconds=every), "options": {"expires": max(1.0, expires)}}

    return {
        "alerts-evaluate": entry("magpie.alerts.evaluate", settings.alert_eval_interval,
                                 settings.alert_eval_interval),
        "delivery-drain": entry("magpie.delivery.drain", settings.delivery_interval, 2 * settings.delivery_interval),
        "email-drain": entry("magpie.email.drain", settings.email_interval, 2 * settings.email_interval),
        "email-housekeeping": entry("magpie.email.housekeeping", settings.outbox_housekeeping_interval,
                                    settings.outbox_housekeeping_interval),
    }
