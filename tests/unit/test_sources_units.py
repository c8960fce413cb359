"""Units of the proxy-list sources: periods, URL redaction, the robots cache, the beat entry, the schedule keys."""

from __future__ import annotations

import time

import pytest

from magpie.config import load_settings
from magpie.sources.beat import TASK, beat_entries
from magpie.sources.fetch import Deadline, FetchFailed, RobotsCache
from magpie.sources.runner import backoff_of, schedule_keys
from magpie.sources.store import SourceError, check_url, format_every, parse_every, shown_url


def test_periods_parse_and_print():
    assert [parse_every(x) for x in ("6h", "30m", "1d", "90s", "3600", "1.5h", "2w")] == [
        21600, 1800, 86400, 90, 3600, 5400, 1209600]
    assert [format_every(x) for x in (21600, 1800, 86400, 90, 1209600)] == ["6h", "30m", "1d", "90s", "2w"]
    for bad in ("", "often", "6x", "-1h"):
        with pytest.raises(SourceError, match="bad period"):
            parse_every(bad)
    for out in ("5s", "31d"):
        with pytest.raises(SourceError, match="outside"):
            parse_every(out)


def test_urls_are_redacted_and_checked():
    assert shown_url("https://u:p@lists.example:8443/a.txt?page=2&token=abc") == \
        "https://***@lists.example:8443/a.txt?page=2&token=***"
    assert shown_url("http://only-user@h/x") == "http://***@h/x"
    assert shown_url("http://h/x?page=2") == "http://h/x?page=2"
    assert shown_url("http://[::1]:99999/") == "<unparsable URL>"
    assert check_url("HTTP://h/x#frag") == "http://h/x"
    with pytest.raises(SourceError, match="http:// or https://"):
        check_url("file:///etc/passwd")
    with pytest.raises(SourceError, match="no host"):
        check_url("http:///x")


def test_robots_cache_is_bounded_and_expires(monkeypatch):
    from urllib.robotparser import RobotFileParser

    cache = RobotsCache(size=2, ttl=10)
    for o in ("a", "b", "c"):
        cache.put(o, RobotFileParser())
    assert len(cache) == 2 and cache.get("a") is None and cache.get("b") is not None
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 11)
    assert cache.get("b") is None


def test_deadline_names_the_setting():
    d = Deadline.after(-1)
    with pytest.raises(FetchFailed, match="MAGPIE_SOURCE_FETCH_TIMEOUT"):
        d.left("http://h/x")


def test_beat_entry_keys_and_backoff():
    s = load_settings(source_tick=15, redis_prefix="p:")
    entry = beat_entries(s)["fetch-sources"]
    assert entry["task"] == TASK and entry["schedule"].total_seconds() == 15
    assert beat_entries(load_settings(source_tick=0)) == {}
    keys = schedule_keys(s)
    assert keys.base == "p:sources:{sources}:" and keys.shards == 1
    curve = backoff_of(s)
    assert curve.ceiling(1) == 60_000 and curve.ceiling(2) == 120_000 and curve.ceiling(30) == 6 * 3600_000
    from magpie.wiring.celery_config import build

    assert build(s)["beat_schedule"]["fetch-sources"]["task"] == TASK


def test_next_page_from_a_link_header_or_html():
    from magpie.sources.fetch import next_page

    assert next_page(b"", '<https://h/p?page=2>; rel="next", <https://h/p?page=9>; rel="last"', "https://h/p") \
        == "https://h/p?page=2"
    assert next_page(b"", '</a>; rel="prev"', "https://h/p") is None
    html = b'<a href="/x">x</a> <a rel="nofollow next" href="?page=3&amp;s=1">next</a>'
    assert next_page(html, None, "https://h/list?page=2") == "https://h/list?page=3&s=1"
    assert next_page(b"127.0.0.1:80\n", None, "https://h/") is None
