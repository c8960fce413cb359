"""The Celery application. Settings come from ``celeryconfig.py`` when importable, else the same builder.

Importing it also hands Flower the package's ``flowerconfig.py`` when the working directory has none
(:func:`magpie.observability.flower.use_packaged_config`), so ``celery -A magpie flower`` never runs without a login.
"""

from __future__ import annotations

import importlib.util
import sys

from celery import Celery

from magpie.wiring import celery_config, worker  # noqa: F401 (worker connects the Celery signal hooks)
from magpie.errors import MagpieError
from magpie.observability.flower import use_packaged_config

app = Celery("magpie", include=["magpie.wiring.tasks"])
use_packaged_config()  # `celery -A magpie flower` without a flowerconfig.py: the package's defaults
try:
    if importlib.util.find_spec("celeryconfig") is not None:  # a deployment's or the checkout's settings
        app.config_from_object("celeryconfig", force=True)
    else:  # installed package run outside the repository
        app.conf.update(celery_config.build())
except MagpieError as _exc:  # a bad setting (e.g. MAGPIE_BROKER_URL): one line, no traceback, exit 2
    print(f"Error: {_exc}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None
