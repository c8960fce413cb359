"""``magpie web``: the operator dashboard of the schedule and its results, with a JSON API under ``/api``.

:func:`magpie.web.app.create_app` builds the app; :mod:`magpie.web.service` composes the reads of the
schedule, the metrics counters and PostgreSQL; :mod:`magpie.web.auth` guards operator actions with
``MAGPIE_WEB_TOKEN``. See docs/dashboard.md.
"""
