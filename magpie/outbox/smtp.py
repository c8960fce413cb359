"""Sending one outbox row over SMTP with :mod:`smtplib`.

TLS modes (``MAGPIE_SMTP_TLS``): ``none`` (plain SMTP), ``starttls`` (plain connection upgraded with
``STARTTLS`` before anything else; refused if the server does not offer it) and ``tls`` (implicit TLS from
the first byte, usually port 465). The server certificate is verified against ``MAGPIE_SMTP_CA_FILE`` or the
system store. Credentials (``MAGPIE_SMTP_USER`` / ``MAGPIE_SMTP_PASSWORD``) are sent only over TLS, or
to a loopback server.

Errors are sorted into :class:`PermanentSmtpError` (the server refused this message for good: 5xx to the
recipient or the data; retrying cannot help) and :class:`TemporarySmtpError` (everything else: connection
refused, timeouts, 4xx, authentication and sender problems that a configuration fix can cure).
"""

from __future__ import annotations

import ipaddress
import smtplib
import ssl
from email.message import EmailMessage
from email.utils import format_datetime, formatdate

from magpie.base.egress import EgressRefused, check_dial
from magpie.errors import MagpieError


class SmtpError(MagpieError):
    """Sending failed; ``str(exc)`` is kept as the row's ``last_error``."""


class PermanentSmtpError(SmtpError):
    """The server refused this message for good; the row becomes ``failed`` without further attempts."""


class TemporarySmtpError(SmtpError):
    """Transient failure; the row is retried on the backoff curve while attempts remain."""


def build_message(row: dict, from_addr: str) -> EmailMessage:
    """Build the message of an outbox ``row`` (keys ``recipient``, ``subject``, ``body``, ``message_id``,
    optional ``created_at``). The ``Message-ID`` is the row's, identical on every attempt, so a receiving
    system can drop a duplicate."""
    msg = EmailMessage()
    msg["From"] = from_addr
    msg["To"] = row["recipient"]
    msg["Subject"] = row["subject"]
    msg["Message-ID"] = row["message_id"]
    created = row.get("created_at")
    msg["Date"] = format_datetime(created) if created is not None else formatdate(usegmt=True)
    msg["Auto-Submitted"] = "auto-generated"
    msg.set_content(row["body"])
    return msg


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def send_message(msg: EmailMessage, settings) -> None:
    """Send ``msg`` with the ``MAGPIE_SMTP_*`` settings (one SMTP session per message).

    Args:
        msg: the message (see :func:`build_message`).
        settings: :class:`magpie.config.Settings` (``smtp_host``, ``smtp_port``, ``smtp_tls``,
            ``smtp_user``, ``smtp_password``, ``smtp_timeout`` in seconds, ``smtp_ca_file``).
    Raises:
        PermanentSmtpError: the recipient or the message was refused with a 5xx reply.
        TemporarySmtpError: any other failure.
    """
    mode = settings.smtp_tls
    host, port, timeout = settings.smtp_host, settings.smtp_port, settings.smtp_timeout
    try:
        check_dial(host, port)
        ctx = ssl.create_default_context(cafile=settings.smtp_ca_file) if mode != "none" else None
        if mode == "tls":
            client = smtplib.SMTP_SSL(host, port, timeout=timeout, context=ctx)
        else:
            client = smtplib.SMTP(host, port, timeout=timeout)
        with client:
            client.ehlo()
            if mode == "starttls":
                if not client.has_extn("starttls"):
                    raise TemporarySmtpError(f"SMTP server {host}:{port} does not offer STARTTLS")
                client.starttls(context=ctx)
                client.ehlo()
            if settings.smtp_user:
                if mode == "none" and not _is_loopback(host):
                    raise TemporarySmtpError("refusing to send SMTP credentials without TLS (MAGPIE_SMTP_TLS)")
                client.login(settings.smtp_user, settings.smtp_password or "")
            client.send_message(msg)
    except SmtpError:
        raise
    except EgressRefused as exc:  # MAGPIE_EGRESS_ONLY: nothing was dialled
        raise TemporarySmtpError(str(exc)) from None
    except smtplib.SMTPRecipientsRefused as exc:
        codes = [code for code, _ in exc.recipients.values()]
        text = f"recipient refused: {exc.recipients}"
        raise (PermanentSmtpError if codes and min(codes) >= 500 else TemporarySmtpError)(text) from None
    except smtplib.SMTPDataError as exc:
        text = f"message refused: {exc.smtp_code} {exc.smtp_error!r}"
        raise (PermanentSmtpError if exc.smtp_code >= 500 else TemporarySmtpError)(text) from None
    except smtplib.SMTPResponseException as exc:
        raise TemporarySmtpError(f"SMTP {exc.smtp_code} {exc.smtp_error!r}") from None
    except (smtplib.SMTPException, OSError, ssl.SSLError) as exc:
        raise TemporarySmtpError(f"{exc.__class__.__name__}: {exc}") from None
