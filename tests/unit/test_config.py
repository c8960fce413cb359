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
