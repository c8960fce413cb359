"""Provider selection by URL scheme and lease-token parsing (no services)."""

from __future__ import annotations

import pytest

from magpie.config import ConfigError, load_settings
from magpie.queue.lease import Lease
from magpie.queue.provider import SCHEMES, create_provider, lease_from_token, lease_token, scheme_of


@pytest.mark.parametrize("url,scheme", [
    ("redis://127.0.0.1:6379/0", "redis"), ("rediss://h:6380", "rediss"), ("unix:///tmp/r.sock", "unix"),
    ("postgresql://u@h/db", "postgresql"), ("postgresql+psycopg2://u@h/db", "postgresql+psycopg2"),
    ("PostgreSQL://u@h/db", "postgresql"), ("mysql://u@h/db", "mysql"), ("", ""),
])
def test_scheme_of(url, scheme):
    assert scheme_of(url) == scheme


def test_an_unknown_scheme_names_the_accepted_ones_without_the_password():
    s = load_settings(encryption_key="test-key-0123456789abcdef")
    with pytest.raises(ConfigError) as exc:
        create_provider("mysql://user:hunter2@127.0.0.1/db", s)
    msg = str(exc.value)
    assert "hunter2" not in msg and "mysql://" in msg
    assert all(f"{x}://" in msg for x in SCHEMES)


def test_the_setting_refuses_an_unknown_scheme_at_load():
    with pytest.raises(ConfigError) as exc:
        load_settings(encryption_key="test-key-0123456789abcdef", schedule_url="sqlite:///x.db")
    assert "MAGPIE_SCHEDULE_URL" in str(exc.value) and "postgresql://" in str(exc.value)
    assert load_settings(encryption_key="test-key-0123456789abcdef", schedule_url="").schedule_url is None


class _Fake:
    @staticmethod
    def shard_of(member):
        return "s:" + member[:2]

    def payload(self, member):
        return '{"w":[1]}'


def test_lease_tokens_round_trip_and_malformed_ones_are_config_errors():
    le = Lease("ab" * 12, "p", "1800000000000.25", "1800000060000.50", "s:ab")
    back = lease_from_token(_Fake(), lease_token(le))
    assert (back.member, back.lease_score, back.previous_score, back.shard) == (le.member, le.lease_score,
                                                                             le.previous_score, "s:ab")
    for bad in ("", "abc", "a:b:c", "m:1.5", "m::1"):
        with pytest.raises(ConfigError):
            lease_from_token(_Fake(), bad)
