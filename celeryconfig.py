"""Celery settings for ``celery -A magpie ...``, read from the environment (see magpie/config.py).

Queues: promote, checks, stats, alerts, delivery, email, maintenance. Beat triggers ``magpie.promote``
every ``MAGPIE_PROMOTE_INTERVAL`` seconds and ``magpie.ingest_stats`` every ``MAGPIE_STATS_INTERVAL``.
"""

from magpie.wiring.celery_config import build as _build

globals().update(_build())
