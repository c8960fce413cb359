"""No secret on screen: configuration errors name the variable but never show a secret value or URL
password; ``queue inspect`` masks the route password; ``flowerconfig.py`` binds loopback and requires auth."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from urllib.parse import quote

import pytest

from magpie.config import ConfigError, load_settings
from magpie.base.redact import mask_url_passwords

ROOT = Path(__file__).resolve().parents[2]
SECRET = "Cf9/secret@canary:7%x"  # needs percent-encoding in a URL
FORMS = (SECRET, quote(SECRET, safe=""), quote(SECRET))


def _message(**overrides) -> str:
    with pytest.raises(ConfigError) as err:
        load_settings(**overrides)
    return str(err.value)


def _clean(text: str) -> bool:
    return not any(f in text for f in FORMS)


@pytest.mark.parametrize("overrides,name", [
    ({"encryption_key": SECRET[:10]}, "PROXY_ENCRYPTION_KEY"),  # too short: rejected, never shown
    ({"smtp_password": 12345, "smtp_port": 0}, "MAGPIE_SMTP_PASSWORD"),
    ({"database_url": f"mysql://root:{quote(SECRET, safe='')}@db:3306/x"}, "MAGPIE_DATABASE_URL"),
    ({"redis_url": f"http://:{quote(SECRET, safe='')}@redis:6379/0"}, "MAGPIE_REDIS_URL"),
    ({"broker_url": f"bogus://guest:{quote(SECRET, safe='')}@mq//"}, "MAGPIE_BROKER_URL"),
    ({"broker_url": f"redis://:{SECRET}@h:6379/1;nope"}, "MAGPIE_BROKER_URL"),
    ({"flower_basic_auth": 7, "flower_port": 0}, "MAGPIE_FLOWER_BASIC_AUTH"),
])
def test_a_config_error_names_the_variable_and_not_the_secret(overrides, name):
    msg = _message(**overrides)
    assert name in msg and _clean(msg) and "\n" not in msg, msg
    if "encryption_key" in overrides:
        assert SECRET[:10] not in msg and "'***'" in msg


def test_a_secret_from_the_environment_is_masked_too(monkeypatch):
    monkeypatch.setenv("PROXY_ENCRYPTION_KEY", "Cf9/short")
    monkeypatch.setenv("MAGPIE_DATABASE_URL", f"sqlite://u:{quote(SECRET, safe='')}@h/x")
    msg = _message()
    assert "PROXY_ENCRYPTION_KEY" in msg and "MAGPIE_DATABASE_URL" in msg
    assert "Cf9/short" not in msg and _clean(msg), msg


def test_a_validator_repeating_a_secret_is_scrubbed(monkeypatch):
    """A secret another setting's rejected value repeats (here the database password pasted into a bad
    MAGPIE_SMTP_TLS) is masked in the whole message."""
    monkeypatch.setenv("MAGPIE_DATABASE_URL", f"postgresql://u:{quote(SECRET, safe='')}@h/x")
    msg = _message(smtp_tls=f"tls {SECRET}")
    assert "MAGPIE_SMTP_TLS" in msg and _clean(msg), msg


def test_non_secret_values_are_still_shown():
    msg = _message(queue_shards=500)
    assert "PROXY_QUEUE_SHARDS" in msg and "500" in msg


@pytest.mark.parametrize("text,want", [
    ("postgresql+psycopg2://postgres:p@ss:w0rd@127.0.0.1:5432/x", "postgresql+psycopg2://postgres:***@127.0.0.1:5432/x"),
    ("redis://:pw@h:6379/0;amqp://guest:guest@mq//", "redis://:***@h:6379/0;amqp://guest:***@mq//"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("http://user@h/", "http://user@h/"),
])
def test_mask_url_passwords(text, want):
    assert mask_url_passwords(text) == want


def test_queue_inspect_masks_the_password_everywhere():
    from magpie.cli.queue import _masked

    payload = json.dumps({"v": 1, "id": 3, "p": "socks5", "h": "127.0.0.5", "o": 1080, "u": "alice",
                          "s": SECRET, "k": "ab" * 12, "w": [1]}, separators=(",", ":"))
    info = {"member": "ab" * 12, "payload": payload, "state": "due", "progress": f"dial {SECRET}",
            "logs": [f"socks5://alice:{quote(SECRET, safe='')}@127.0.0.5:1080 refused"], "dead": None}
    out = _masked(info)
    assert _clean(json.dumps(out)), out
    doc = json.loads(out["payload"])
    assert doc["s"] == "***" and doc["u"] == "alice" and doc["h"] == "127.0.0.5"
    assert _masked({"member": "x", "payload": None, "state": "gone"})["payload"] is None
    broken = _masked(dict(info, payload=payload[:-3]))  # not JSON: masked by pattern
    assert SECRET not in broken["payload"] and '"s":"***"' in broken["payload"]


def _flowerconfig(monkeypatch, **env) -> dict:
    pytest.importorskip("flower")
    import flower.options  # noqa: F401 - defines Flower's options, which flowerconfig.py reads

    for name in ("MAGPIE_FLOWER_BASIC_AUTH", "MAGPIE_FLOWER_ALLOW_NO_AUTH", "MAGPIE_FLOWER_ADDRESS",
                 "MAGPIE_FLOWER_PORT", "FLOWER_BASIC_AUTH"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return runpy.run_path(str(ROOT / "flowerconfig.py"))


def test_flowerconfig_binds_loopback_and_requires_basic_auth(monkeypatch):
    conf = _flowerconfig(monkeypatch, MAGPIE_FLOWER_BASIC_AUTH=f"ops:{SECRET}", MAGPIE_FLOWER_PORT="6123")
    assert conf["address"] == "127.0.0.1" and conf["basic_auth"] == [f"ops:{SECRET}"] and conf["port"] == 6123
    with pytest.raises(SystemExit, match="MAGPIE_FLOWER_BASIC_AUTH") as err:
        _flowerconfig(monkeypatch)
    assert "refusing" in str(err.value)
    with pytest.raises(SystemExit, match="user:password"):
        _flowerconfig(monkeypatch, MAGPIE_FLOWER_BASIC_AUTH="no-colon")
    with pytest.raises(SystemExit, match="loopback"):
        _flowerconfig(monkeypatch, MAGPIE_FLOWER_ALLOW_NO_AUTH="1", MAGPIE_FLOWER_ADDRESS="0.0.0.0")
    dev = _flowerconfig(monkeypatch, MAGPIE_FLOWER_ALLOW_NO_AUTH="1")
    assert dev["address"] == "127.0.0.1" and "basic_auth" not in dev


def test_flowerconfig_masks_url_passwords_on_task_pages(monkeypatch):
    conf = _flowerconfig(monkeypatch, MAGPIE_FLOWER_BASIC_AUTH="ops:pw")

    class Task:
        args = f"('socks5://alice:{quote(SECRET, safe='')}@h:1',)"
        kwargs = "{}"
        result = None
        exception = f"ProxyError('http://bob:{SECRET}@h:2')"
        traceback = None

    t = conf["format_task"](Task())
    assert _clean(t.args + t.exception) and "alice:***@h:1" in t.args
