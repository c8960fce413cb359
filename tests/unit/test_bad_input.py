"""Bad input a user or an attacker feeds the importer: each case fails its own line with one reason and
never aborts the file or reaches storage raw."""

from __future__ import annotations

import io

import pytest

from magpie.importer.parse import ParseError, parse_file, parse_line, parse_lines

from magpie.base.routes import Route


def test_deeply_nested_json_line_fails_that_line_only():
    res = parse_lines(['{"a":' * 100_000 + "1", "127.0.0.1:8080", "[" * 100_000])
    assert res.routes == [Route("http", "127.0.0.1", 8080)]
    assert [(x.line, x.reason) for x in res.invalid] == [(1, "malformed JSON line: nested too deeply")]


@pytest.mark.parametrize("line, field", [
    ("us\x1b[2J\x1b[31mer:pw@127.0.0.3:80", "user name"),
    ("user:p\x07w@127.0.0.3:80", "password"),
    ('{"ip": "127.0.0.3", "port": 80, "username": "a\\u001b[0mb", "password": "x"}', "user name"),
    ("127.0.0.3:80:proxyuser\x9b:secretpass", "user name"),
])
def test_control_characters_in_credentials_are_refused(line, field):
    res = parse_lines([line, "127.0.0.1:8080"])
    assert res.routes == [Route("http", "127.0.0.1", 8080)]
    [bad] = res.invalid
    assert bad.reason == f"control character in the {field}"
    assert "\x1b" not in bad.text and "\x07" not in bad.text and "\x9b" not in bad.text
    with pytest.raises(ParseError, match="control character"):
        parse_line(line)


def test_nul_byte_is_refused_and_shown_escaped():
    res = parse_lines(["us\x00er:pw@127.0.0.2:80"])
    [bad] = res.invalid
    assert bad.reason.startswith("NUL byte in the line") and bad.text == "us\\x00er:pw@127.0.0.2:80"
    assert not res.routes


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_and_utf32_files_with_a_byte_order_mark_import(encoding):
    text = "127.0.0.1:8080\r\n# comment\nsocks5://u:p@127.0.0.2:1080\n"
    data = text.encode(encoding)
    if encoding == "utf-16-be":
        data = b"\xfe\xff" + data
    res = parse_file(io.BytesIO(data))
    assert res.routes == [Route("http", "127.0.0.1", 8080), Route("socks5", "127.0.0.2", 1080, "u", "p")]
    assert res.lines == [1, 3] and not res.invalid


def test_utf16_file_without_a_byte_order_mark_says_so():
    res = parse_file(io.BytesIO("127.0.0.1:8080\n".encode("utf-16-le")))
    assert not res.routes and res.invalid
    assert "UTF-16" in res.invalid[0].reason


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/abc", "redis://:s3cret@127.0.0.1:6379/1x",
                                 "rediss://127.0.0.1:6379/-1", "unix:///tmp/redis.sock?db=two",
                                 "redis://127.0.0.1:6379/0/1"])
def test_redis_url_with_a_non_numeric_database_is_refused(url):
    from magpie.config import ConfigError, load_settings

    with pytest.raises(ConfigError) as exc:
        load_settings(redis_url=url)
    msg = str(exc.value)
    assert "MAGPIE_REDIS_URL" in msg and "database number" in msg and "s3cret" not in msg
    assert len(msg.splitlines()) == 1
    with pytest.raises(ConfigError, match="MAGPIE_SCHEDULE_URL"):
        load_settings(schedule_url=url)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379", "redis://127.0.0.1:6379/", "redis://h:1/15",
                                 "unix:///tmp/redis.sock?db=3"])
def test_redis_url_with_a_database_number_is_accepted(url):
    from magpie.config import load_settings

    assert load_settings(redis_url=url).redis_url == url
