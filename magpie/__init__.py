"""magpie: recurring, lease-based health checks of HTTP/HTTPS/SOCKS4/SOCKS5 proxies ("routes").

``celery -A magpie worker`` finds the Celery application through the ``celery`` attribute
below (loaded lazily so that importing :mod:`magpie` stays cheap for the CLI and tests).
"""

import os as _os

__version__ = "0.1.0"

if _os.environ.get("MAGPIE_EGRESS_ONLY", "").strip():
    # Deny-by-default egress: the socket guard is in place before anything can dial.
    from magpie.base.egress import install_socket_guard as _install

    _install()


def __getattr__(name):
    if name in ("celery", "app"):
        from magpie.wiring.celery_app import app

        return app
    raise AttributeError(name)
