"""The Celery application. Settings come from ``celeryconfig.py`` when importable, else the same builder."""

from __future__ import annotations

import sys

from celery import Celery

from magpie import celery_config, worker  # noqa: F401 (worker connects the Celery signal hooks)
from magpie.errors import MagpieError

app = Celery("magpie", include=["magpie.tasks"])
try:
    try:
        import celeryconfig  # noqa: F401

        app.config_from_object("celeryconfig")
    except ImportError:  # installed package run outside the repository
        app.conf.update(celery_config.build())
except MagpieError as _exc:  # a bad setting (e.g. MAGPIE_BROKER_URL): one line, no traceback, exit 2
    print(f"Error: {_exc}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None
