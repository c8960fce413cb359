"""The Celery application. Settings come from ``celeryconfig.py`` when importable, else the same builder."""

from __future__ import annotations

from celery import Celery

from magpie import celery_config, worker  # noqa: F401 (worker connects the Celery signal hooks)

app = Celery("magpie", include=["magpie.tasks"])
try:
    import celeryconfig  # noqa: F401

    app.config_from_object("celeryconfig")
except ImportError:  # installed package run outside the repository
    app.conf.update(celery_config.build())
