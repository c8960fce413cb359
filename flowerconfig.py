"""Flower settings for ``celery -A magpie flower`` run from this directory (Flower's ``--conf`` default).

magpie's safe defaults (:func:`magpie.observability.flower.flower_options`): loopback (``MAGPIE_FLOWER_ADDRESS``),
``MAGPIE_FLOWER_PORT``, basic auth required (``MAGPIE_FLOWER_BASIC_AUTH="user:password"``; Flower refuses
to start without authentication), URL passwords masked on task pages. Where there is no such file,
``celery -A magpie flower`` uses the package's copy of this one. Add Flower options below the defaults:
every top-level name that matches a Flower option is one. Flower's command line still wins.
"""

from magpie.observability.flower import flower_options as _flower_options

globals().update(_flower_options())
