"""Settings: a bad value names its variable; settings that must agree are checked together."""

from __future__ import annotations

import pytest

from magpie.config import ConfigError, load_settings
from magpie.errors import MagpieError


def test_defaults_load_and_derive_timeouts():
    s = load_settings()
    assert s.connect_timeout == min(s.check_timeout / 2, s.check_timeout)
    assert s.max_check_seconds == s.check_attempts * s.check_timeout + 1.0


@pytest.mark.parametrize("field,value,name", [
    ("checks_per_process", 0, "MAGPIE_CHECKS_PER_PROCESS"),
    ("check_timeout", -1, "MAGPIE_CHECK_TIMEOUT"),
    ("queue_shards", 500, "PROXY_QUEUE_SHARDS"),
    ("redis_url", "http://x", "MAGPIE_REDIS_URL"),
    ("check_allow_private", "127.0.0.0/8,banana", "MAGPIE_CHECK_ALLOW_PRIVATE"),
    ("complete_interval", 0, "MAGPIE_COMPLETE_INTERVAL"),
])
def test_a_bad_value_names_its_variable(field, value, name):
    with pytest.raises(ConfigError, match=name) as err:
        load_settings(**{field: value})
    assert isinstance(err.value, MagpieError) and "\n" not in str(err.value)


def test_a_lease_must_outlive_a_whole_check():
    with pytest.raises(ConfigError, match="MAGPIE_LEASE_SECONDS"):
        load_settings(lease_seconds=15, check_timeout=10, check_attempts=2)
    assert load_settings(lease_seconds=22, renew_below_seconds=5, check_timeout=10, check_attempts=2).lease_seconds == 22


def test_connect_timeout_never_exceeds_the_deadline():
    assert load_settings(check_timeout=4, connect_timeout_s=9).connect_timeout == 4


@pytest.mark.parametrize("field,name,too_big,largest", [
    ("lease_seconds", "MAGPIE_LEASE_SECONDS", 1e300, 86400),
    ("check_interval", "MAGPIE_CHECK_INTERVAL", 30 * 86400 + 1, 30 * 86400),
    ("renew_below_seconds", "MAGPIE_RENEW_BELOW_SECONDS", 86401, None),
    ("check_timeout", "MAGPIE_CHECK_TIMEOUT", 601, None),
    ("connect_timeout_s", "MAGPIE_CONNECT_TIMEOUT", 601, 600),
    ("retry_base", "MAGPIE_RETRY_BASE", 3601, 3600),
    ("retry_cap", "MAGPIE_RETRY_CAP", 86401, 86400),
    ("promote_interval", "MAGPIE_PROMOTE_INTERVAL", 301, 300),
    ("webhook_timeout", "MAGPIE_WEBHOOK_TIMEOUT", 601, 600),
    ("webhook_backoff_cap", "MAGPIE_WEBHOOK_BACKOFF_CAP", 86401, 86400),
    ("email_backoff_cap", "MAGPIE_EMAIL_BACKOFF_CAP", 86401, 86400),
    ("smtp_timeout", "MAGPIE_SMTP_TIMEOUT", 601, 600),
    ("delivery_claim_seconds", "MAGPIE_DELIVERY_CLAIM_SECONDS", 86401, 86400),
    ("maintenance_lock_ttl", "MAGPIE_MAINTENANCE_LOCK_TTL", 86401, 86400),
])
def test_durations_have_upper_bounds(field, name, too_big, largest):
    with pytest.raises(ConfigError, match=name) as err:
        load_settings(**{field: too_big})
    assert "less than or equal" in str(err.value) and "\n" not in str(err.value)
    if largest is not None:
        assert getattr(load_settings(**{field: largest}), field) == largest


def test_a_huge_lease_from_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("MAGPIE_LEASE_SECONDS", "1e300")
    with pytest.raises(ConfigError, match="MAGPIE_LEASE_SECONDS: Input should be less than or equal to 86400"):
        load_settings()


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/1", "rediss://:pw@redis.example.net:6380/0", "redis+socket:///run/redis.sock",
    "amqp://guest:guest@127.0.0.1:5672//", "AMQPS://u:p@mq.example.net:5671/vh", "pyamqp://127.0.0.1//",
    "sentinel://s1:26379;sentinel://s2:26379", "memory://",
])
def test_broker_urls_of_the_supported_transports_are_accepted(url):
    assert load_settings(broker_url=url).broker_url == url


@pytest.mark.parametrize("url,shown", [
    ("bogus://user:s3cr3t@mq:5672//", "scheme 'bogus'"),
    ("127.0.0.1:6379", "no scheme"),
    ("user:s3cr3t@redis:6379", "no scheme"),
    ("user:s3cr3t@host://x", "no scheme"),
    ("", "no scheme"),
    ("redis://h:1/0;kafka://:s3cr3t@k:9092", "scheme 'kafka'"),
])
def test_a_bad_broker_url_is_one_line_naming_the_variable_without_its_password(url, shown):
    with pytest.raises(ConfigError) as err:
        load_settings(broker_url=url)
    msg = str(err.value)
    assert "MAGPIE_BROKER_URL" in msg and shown in msg and "\n" not in msg
    assert "s3cr3t" not in msg


@pytest.mark.parametrize("value,expected", [
    (True, "true"), (False, "false"), ("true", "true"), ("10.0.0.0/8, ::1", "10.0.0.0/8, ::1"),
])
def test_webhook_allow_private_takes_a_bool_or_cidrs(value, expected):
    assert load_settings(webhook_allow_private=value).webhook_allow_private == expected


def test_webhook_allow_private_rejects_a_malformed_list():
    with pytest.raises(ConfigError, match="MAGPIE_WEBHOOK_ALLOW_PRIVATE"):
        load_settings(webhook_allow_private="10.0.0.0/8,banana")
