"""Flower's settings from magpie's (``MAGPIE_FLOWER_*``): loopback, basic auth required, task pages masked.

Flower reads them through its config file (``--conf``, default ``flowerconfig.py`` in the working
directory): the ``flowerconfig.py`` that ``magpie init`` writes, and the package's own copy, which the
Celery app hands Flower where the working directory has none (:func:`use_packaged_config`). So
``celery -A magpie flower`` runs safe by default from a checkout and from an installed wheel.

- Binds ``MAGPIE_FLOWER_ADDRESS`` (default ``127.0.0.1``), port ``MAGPIE_FLOWER_PORT`` (default 5555).
- Requires HTTP basic auth ``MAGPIE_FLOWER_BASIC_AUTH="user:password"`` (or Flower's own
  ``--basic-auth``/``FLOWER_BASIC_AUTH`` or ``--auth``); without any, Flower refuses to start with one
  line, unless ``MAGPIE_FLOWER_ALLOW_NO_AUTH=1`` and the address is a loopback one (local development).
- Task display: check messages are sealed and sent with a short ``argsrepr`` (``<250 leases>``, see
  magpie/queue/seal.py), so task events never hold a payload; :func:`format_task` also masks any
  ``scheme://user:password@`` in a task's arguments, result or traceback on Flower's pages.

Flower's command-line options and environment variables win over these. See docs/operations.md,
"Secrets and Flower".
"""

from __future__ import annotations

import ipaddress
import os
import sys

from magpie.base.redact import mask_url_passwords


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def format_task(task):
    """Flower's task formatter (its ``format_task`` option): mask URL passwords in what a task page shows."""
    for attr in ("args", "kwargs", "result", "exception", "traceback"):
        value = getattr(task, attr, None)
        if isinstance(value, str):
            setattr(task, attr, mask_url_passwords(value))
    return task


def flower_options(settings=None) -> dict:
    """The Flower options of a config file: ``{"address", "format_task"}`` and, when magpie's settings
    give them, ``"port"`` and ``"basic_auth"`` (a one-item list ``["user:password"]``).

    Args:
        settings: :class:`magpie.config.Settings` (default: loaded from the environment).
    Raises:
        SystemExit: with one line, when Flower must not start: a malformed ``MAGPIE_FLOWER_BASIC_AUTH``,
            no authentication at all, or ``MAGPIE_FLOWER_ALLOW_NO_AUTH`` on a non-loopback address.
    An address or port already given to Flower (its command line, ``FLOWER_ADDRESS``) is kept.
    """
    from tornado.options import options

    from magpie.config import load_settings

    s = settings or load_settings()
    out: dict = {"address": options.address or s.flower_address, "format_task": format_task}
    if options.port == 5555 and s.flower_port != 5555:
        out["port"] = s.flower_port
    if s.flower_basic_auth:  # unset or empty: no basic auth from magpie's settings
        user, sep, password = s.flower_basic_auth.partition(":")
        if not user or not sep or not password:
            raise SystemExit("flower: MAGPIE_FLOWER_BASIC_AUTH must be user:password (both non-empty)")
        out["basic_auth"] = [s.flower_basic_auth]
    elif not (options.basic_auth or options.auth or options.auth_provider):
        if not s.flower_allow_no_auth:
            raise SystemExit("flower: refusing to start without authentication: set "
                             "MAGPIE_FLOWER_BASIC_AUTH=user:password (or MAGPIE_FLOWER_ALLOW_NO_AUTH=1 for a "
                             "loopback-only development Flower)")
        if options.unix_socket == "" and not _is_loopback(out["address"]):
            raise SystemExit(f"flower: MAGPIE_FLOWER_ALLOW_NO_AUTH=1 binds a loopback address only, not "
                             f"{out['address']!r}; set MAGPIE_FLOWER_BASIC_AUTH=user:password")
    return out


def use_packaged_config() -> str | None:
    """Point Flower at the package's ``flowerconfig.py`` when it would read none: Flower is loaded (the
    ``celery`` command loads its plugins before the app), its ``--conf`` is still the default and the
    working directory has no such file. An explicit ``--conf`` or ``FLOWER_CONF`` is parsed later and
    wins. Returns the path handed to Flower, or None when nothing changed."""
    flower_options_module = sys.modules.get("flower.options")
    if flower_options_module is None:
        return None
    from tornado.options import options

    from magpie.base.deployment import source

    default = flower_options_module.DEFAULT_CONFIG_FILE
    if options.conf != default or os.path.exists(default):
        return None
    packaged = source("flowerconfig.py")
    if packaged is None:
        return None
    options.conf = str(packaged)
    return options.conf
