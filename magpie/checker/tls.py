"""TLS towards an https judge: the trusted CAs (``MAGPIE_JUDGE_CA_BUNDLE``) and what such a judge cannot see.

Verification is always on (certificate chain and host name). A self-hosted judge with a private CA is
trusted by pointing ``MAGPIE_JUDGE_CA_BUNDLE`` at a PEM file of its CA; that file then replaces the system
trust store for the judge (put both in it to trust both).

Over an https judge a plain-HTTP proxy only relays a ``CONNECT`` tunnel: it cannot add headers inside
it, so anonymity grading sees none (a header-adding proxy grades ``elite``). Grading anonymity needs an
http judge, or a TLS judge that the proxy itself terminates. :func:`warn_https_judge` says so once.
"""

from __future__ import annotations

import logging
import ssl
from urllib.parse import urlsplit

log = logging.getLogger("magpie.checker")

HTTPS_JUDGE_NOTE = (
    "https judge: a proxy cannot add headers inside the TLS tunnel, so anonymity grading does not see "
    "them (a header-adding proxy grades elite); grade anonymity with an http judge or a TLS judge the "
    "proxy terminates"
)
"""One line explaining the limit of anonymity grading over an https judge (logs, ``magpie health``)."""

_warned: set[str] = set()


def is_https(judge_url: str) -> bool:
    """True when ``judge_url`` is an ``https://`` URL."""
    return urlsplit(judge_url).scheme == "https"


def judge_ssl_context(ca_bundle: str | None = None) -> ssl.SSLContext:
    """A verifying client TLS context for the judge.

    Args:
        ca_bundle: path of a PEM file of trusted CA certificates (``MAGPIE_JUDGE_CA_BUNDLE``); None or
            empty: the system trust store.
    Returns:
        An :class:`ssl.SSLContext` with ``CERT_REQUIRED`` and host-name checking.
    Raises:
        magpie.config.ConfigError: the file cannot be read or holds no usable PEM certificate; the
            message names ``MAGPIE_JUDGE_CA_BUNDLE`` and the file.
    """
    if not ca_bundle:
        return ssl.create_default_context()
    try:
        ctx = ssl.create_default_context(cafile=ca_bundle)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        from magpie.config import ConfigError

        reason = getattr(exc, "reason", None) or exc.__class__.__name__
        raise ConfigError(f"MAGPIE_JUDGE_CA_BUNDLE: cannot load CA certificates from {ca_bundle!r} "
                          f"({reason})") from None
    if not ctx.get_ca_certs():
        from magpie.config import ConfigError

        raise ConfigError(f"MAGPIE_JUDGE_CA_BUNDLE: no CA certificate in {ca_bundle!r}")
    return ctx


def warn_https_judge(judge_url: str) -> bool:
    """Log :data:`HTTPS_JUDGE_NOTE` once per process and judge URL when the judge is https.

    Returns True when the judge is https (whether or not the warning was logged now).
    """
    if not is_https(judge_url):
        return False
    if judge_url not in _warned:
        _warned.add(judge_url)
        u = urlsplit(judge_url)
        log.warning("%s (judge %s://%s)", HTTPS_JUDGE_NOTE, u.scheme, u.netloc.rpartition("@")[2])
    return True


__all__ = ["HTTPS_JUDGE_NOTE", "is_https", "judge_ssl_context", "warn_https_judge"]
