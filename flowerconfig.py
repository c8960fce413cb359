"""Flower settings, read by ``celery -A magpie flower`` from the working directory (Flower's ``--conf``
default), so the Procfile and the compose service run Flower safe by default.

- Binds ``MAGPIE_FLOWER_ADDRESS`` (default ``127.0.0.1``), port ``MAGPIE_FLOWER_PORT`` (default 5555).
- Requires HTTP basic auth ``MAGPIE_FLOWER_BASIC_AUTH="user:password"`` (or Flower's own
  ``--basic-auth``/``FLOWER_BASIC_AUTH`` or ``--auth``); without any, Flower refuses to start with one
  line, unless ``MAGPIE_FLOWER_ALLOW_NO_AUTH=1`` and the address is a loopback one (local development).
- Task display: check messages are sealed and sent with a short ``argsrepr`` (``<250 leases>``, see
  magpie/queue/seal.py), so task events never hold a payload; ``format_task`` also masks any
  ``scheme://user:password@`` in a task's arguments, result or traceback on Flower's pages.

Flower's command-line options still win over this file. Every name at the top level that matches a Flower
option is one, so helpers start with an underscore. See docs/operations.md, "Secrets and Flower".
"""

import ipaddress as _ipaddress

from tornado.options import options as _options

from magpie.config import load_settings as _load_settings
from magpie.redact import mask_url_passwords as _mask

_s = _load_settings()


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return _ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


# an address or port given on Flower's command line (or FLOWER_ADDRESS) is already in _options and wins
address = _options.address or _s.flower_address
if _options.port == 5555 and _s.flower_port != 5555:
    port = _s.flower_port

if _s.flower_basic_auth:  # unset or empty: no basic auth from magpie's settings
    _user, _sep, _password = _s.flower_basic_auth.partition(":")
    if not _user or not _sep or not _password:
        raise SystemExit("flower: MAGPIE_FLOWER_BASIC_AUTH must be user:password (both non-empty)")
    basic_auth = [_s.flower_basic_auth]
elif not (_options.basic_auth or _options.auth or _options.auth_provider):
    if not _s.flower_allow_no_auth:
        raise SystemExit("flower: refusing to start without authentication: set MAGPIE_FLOWER_BASIC_AUTH="
                         "user:password (or MAGPIE_FLOWER_ALLOW_NO_AUTH=1 for a loopback-only development Flower)")
    if _options.unix_socket == "" and not _is_loopback(address):
        raise SystemExit(f"flower: MAGPIE_FLOWER_ALLOW_NO_AUTH=1 binds a loopback address only, not {address!r}; "
                         "set MAGPIE_FLOWER_BASIC_AUTH=user:password")


def format_task(task):
    """Flower's task formatter (its ``format_task`` option): mask URL passwords in what a task page shows."""
    for attr in ("args", "kwargs", "result", "exception", "traceback"):
        value = getattr(task, attr, None)
        if isinstance(value, str):
            setattr(task, attr, _mask(value))
    return task
