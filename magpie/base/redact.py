"""Redaction of secrets in text meant for people: configuration errors, Flower pages, command output.

:func:`mask_url_passwords` masks the password of every ``scheme://user:password@`` in a text;
:func:`secret_values` collects the secret strings a settings build saw (secret settings, URL passwords)
so that :func:`scrub` can mask them wherever a message repeats them. Used by
:func:`magpie.config.load_settings` and ``flowerconfig.py``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote, urlsplit

SECRET_SETTINGS = ("PROXY_ENCRYPTION_KEY", "MAGPIE_SMTP_PASSWORD", "MAGPIE_FLOWER_BASIC_AUTH")
"""Settings whose values are never shown; so is any setting whose name ends in PASSWORD, SECRET, TOKEN
or _KEY (or holds BASIC_AUTH), and the password of any URL (``scheme://user:***@host``)."""
_SECRET_ENDINGS = ("PASSWORD", "SECRET", "TOKEN", "_KEY")
_URL_PASSWORD = re.compile(r"(://[^\s;'\"/@:]*:)[^\s;'\"]*@")  # up to the segment's last '@'
MASK = "***"


def is_secret(name: str) -> bool:
    """True when the setting called ``name`` (an environment name or field name, any case) holds a secret."""
    up = name.upper()
    return up in SECRET_SETTINGS or up.endswith(_SECRET_ENDINGS) or "BASIC_AUTH" in up


def mask_url_passwords(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` in it replaced by ``***``."""
    return _URL_PASSWORD.sub(lambda m: m.group(1) + MASK + "@", text)


def raw_values(names: Mapping[str, str], overrides: Mapping[str, object]) -> dict[str, object]:
    """Every value a settings build may have seen, by upper-case environment name: ``.env``, the
    environment, then ``overrides``.

    Args:
        names: upper-case field name or environment name -> upper-case environment name.
        overrides: the keyword arguments of the build (field names or environment names).
    """
    out: dict[str, object] = {}
    try:
        from dotenv import dotenv_values

        out.update({k.upper(): v for k, v in dotenv_values(".env").items() if v is not None})
    except Exception:  # noqa: BLE001 - a missing or unreadable .env hides nothing
        pass
    out.update({k.upper(): v for k, v in os.environ.items() if k.upper() in names})
    out.update({names.get(k.upper(), k.upper()): v for k, v in overrides.items()})
    return out


def secret_values(values: Mapping[str, object]) -> list[str]:
    """The secret strings among ``values`` (name -> value): values of secret settings and the passwords
    (raw and percent-decoded) of URLs in any value, longest first; strings under 4 characters are left out
    (masking them everywhere would garble a message; :func:`mask_url_passwords` still covers URLs)."""
    found: set[str] = set()
    for name, v in values.items():
        if not isinstance(v, str) or not v:
            continue
        if is_secret(name):
            found.add(v)
        for part in v.split(";"):
            try:
                pw = urlsplit(part.strip()).password
            except ValueError:
                pw = None
            if pw:
                found.update((pw, unquote(pw)))
    return sorted((x for x in found if len(x) >= 4), key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with URL passwords and every string of ``secrets`` (also in its repr form) masked."""
    text = mask_url_passwords(text)
    for sec in secrets:
        for form in {sec, repr(sec)[1:-1]}:
            text = text.replace(form, MASK)
    return text


def shown(name: str, value) -> str:
    """The repr of a rejected value of setting ``name``: ``'***'`` for a secret setting, else with URL
    passwords masked."""
    if is_secret(name) and value is not None:
        return repr(MASK)
    if isinstance(value, str):
        return repr(mask_url_passwords(value))
    return repr(value)


_PAYLOAD_SECRET = re.compile(r'("s"\s*:\s*)"(?:[^"\\]|\\.)*"')  # the password field of payload JSON text


def mask_route_info(info: dict) -> dict:
    """``info`` with the route's password masked as every other command shows routes (``"s":"***"``),
    and the password (plain or percent-encoded) masked wherever else it appears (logs, progress, dead)."""
    text = info.get("payload")
    if text is None:
        return info
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    password = doc.get("s") if isinstance(doc, dict) else None
    if isinstance(doc, dict):
        if "s" in doc:
            doc["s"] = "***"
        masked = json.dumps(doc, separators=(",", ":"))
    else:  # not JSON: mask the field by pattern
        masked = _PAYLOAD_SECRET.sub(r'\1"***"', text)
    out = dict(info, payload=masked)
    if isinstance(password, str) and password:
        from urllib.parse import quote

        forms = sorted({password, quote(password, safe="")}, key=len, reverse=True)
        for key, value in out.items():
            if key != "payload":
                out[key] = _without(value, forms)
    return out


def _without(value, forms: list[str]):
    """``value`` (JSON-like: str, list, dict, scalars) with every string of ``forms`` masked in its text."""
    if isinstance(value, str):
        for form in forms:
            value = value.replace(form, "***")
        return value
    if isinstance(value, list):
        return [_without(v, forms) for v in value]
    if isinstance(value, dict):
        return {k: _without(v, forms) for k, v in value.items()}
    return value
