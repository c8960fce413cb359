"""Log format of magpie's processes: Celery's text lines (default) or one JSON object a line.

``MAGPIE_LOG_FORMAT=json`` makes every handler of the worker, beat and the ``magpie`` command write
:class:`JsonFormatter` lines::

    {"ts": "2026-01-01T12:00:00.123Z", "level": "INFO", "logger": "magpie.wiring.worker", "message": "...",
     "process": "MainProcess", "pid": 4242, "task_id": "...", "task_name": "magpie.promote"}

``task_id``/``task_name`` appear inside a Celery task, ``exc`` holds a traceback, and attributes given
with ``extra=`` are kept (values that are not JSON become strings). Secrets never leave a process in a
log line: URL passwords are masked and so is the value of every secret setting in the environment
(:mod:`magpie.base.redact`), in the message and the traceback alike.

Hooks: Celery's ``after_setup_logger`` and ``after_setup_task_logger`` signals (connected on import;
:mod:`magpie.wiring.worker` imports this module); the command line calls :func:`setup_cli_logging`. With
``MAGPIE_LOG_FORMAT=json`` in the environment, importing this module also routes Python warnings into
logging and gives a root logger without handlers a JSON one, so that what a process says before Celery
sets up its logging (a ``SecurityWarning``, a setting being waited for) is JSON too. Celery prints two
things itself, not through logging: its start banner (``celery --quiet`` leaves it out) and the
``worker: Warm shutdown`` notice.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime

from celery import signals

from magpie.base.redact import scrub, secret_values

FORMATS = ("text", "json")
"""Values of ``MAGPIE_LOG_FORMAT``."""

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def _env_secrets() -> list[str]:
    """Secret strings of this process's settings environment (secret settings, URL passwords)."""
    return secret_values({k: v for k, v in os.environ.items() if k.upper().startswith(("MAGPIE_", "PROXY_"))})


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ms), ``level``, ``logger``, ``message``, ``process``,
    ``pid``, Celery's ``task_id``/``task_name`` in a task, ``exc`` for an exception, then extras.

    Args:
        secrets: strings to mask wherever they appear (default: the secret settings and URL passwords of
            the environment, read once).
    """

    def __init__(self, secrets: list[str] | None = None):
        super().__init__()
        self._secrets = _env_secrets() if secrets is None else list(secrets)

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace(
                "+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.processName,
            "pid": record.process,
        }
        task = _current_task()
        if task is not None:
            out["task_id"], out["task_name"] = task
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out and not key.startswith("_"):
                out[key] = value
        text = json.dumps(out, default=str, ensure_ascii=False)
        return scrub(text, self._secrets)


def _current_task() -> tuple[str, str] | None:
    try:
        from celery._state import get_current_task

        task = get_current_task()
    except Exception:  # noqa: BLE001 - outside Celery
        return None
    if task is None or not getattr(task.request, "id", None):
        return None
    return task.request.id, task.name


def log_format() -> str:
    """The configured format: ``MAGPIE_LOG_FORMAT`` through the settings when they load, else the
    environment variable itself (``text`` when unset).

    Raises:
        magpie.errors.MagpieError: a value other than ``text`` or ``json`` (one line naming the variable).
    """
    from magpie.errors import MagpieError

    try:
        from magpie.config import get_settings

        return get_settings().log_format
    except Exception:  # noqa: BLE001 - settings broken elsewhere: that error is reported by its owner
        value = os.environ.get("MAGPIE_LOG_FORMAT", "text").strip().lower() or "text"
    if value not in FORMATS:
        raise MagpieError(f"MAGPIE_LOG_FORMAT must be one of {', '.join(FORMATS)}, not {value[:20]!r}")
    return value


def use_json(logger: logging.Logger) -> None:
    """Give every handler of ``logger`` a :class:`JsonFormatter` (handlers without one get a stderr one)."""
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())
    fmt = JsonFormatter()
    for handler in logger.handlers:
        handler.setFormatter(fmt)


@signals.after_setup_logger.connect(weak=False)
@signals.after_setup_task_logger.connect(weak=False)
def _celery_logger_ready(logger=None, **_kw) -> None:
    if logger is not None and log_format() == "json":
        use_json(logger)


def setup_cli_logging() -> None:
    """For the ``magpie`` command: with ``MAGPIE_LOG_FORMAT=json``, warnings and errors of magpie's
    loggers go to stderr as JSON lines (the text default leaves logging as it is)."""
    if log_format() != "json":
        return
    root = logging.getLogger()
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        root.addHandler(handler)
        if root.level == logging.NOTSET or root.level > logging.WARNING:
            root.setLevel(logging.WARNING)


def _early_json() -> None:
    """Before Celery configures logging: warnings as log records, JSON on a root logger without handlers."""
    if os.environ.get("MAGPIE_LOG_FORMAT", "").strip().lower() != "json":
        return
    logging.captureWarnings(True)
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        root.addHandler(handler)


_early_json()

__all__ = ["FORMATS", "JsonFormatter", "log_format", "setup_cli_logging", "use_json"]
