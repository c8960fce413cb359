"""Proxy-list parser (magpie.importer.parse): formats, line classification, reasons, counts.

Parse-only: no network, addresses are plain strings.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from magpie.importer.parse import (
    InvalidLine,
    ParseError,
    ParseResult,
    _normalize_host,
    _parse_address,
    parse_file,
    parse_line,
    parse_lines,
)
from magpie.base.protocols import PROTOCOLS
from magpie.base.routes import Route, normalize_host

IP = "203.0.113.9"


def http(host: str, port: int, user: str | None = None, password: str | None = None) -> Route:
    return Route("http", host, port, user, password)


# --- accepted formats ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (f"{IP}:8080", http(IP, 8080)),
        (f"user:pass@{IP}:8080", http(IP, 8080, "user", "pass")),
        (f"{IP}:8080:user:pass", http(IP, 8080, "user", "pass")),
        (f"http://{IP}:8080", http(IP, 8080)),
        (f"https://{IP}:8443", Route("https", IP, 8443)),
        (f"socks4://{IP}:1080", Route("socks4", IP, 1080)),
        (f"socks5://{IP}:1080", Route("socks5", IP, 1080)),
        (f"socks5://alice:s3cret@{IP}:1080", Route("socks5", IP, 1080, "alice", "s3cret")),
        (f"https://alice:s3cret@{IP}:443", Route("https", IP, 443, "alice", "s3cret")),
        (f"SOCKS5://{IP}:1080", Route("socks5", IP, 1080)),
        (f"HtTpS://{IP}:443", Route("https", IP, 443)),
        (f"socks5h://{IP}:1080", Route("socks5", IP, 1080)),
        (f"SOCKS4A://{IP}:1080", Route("socks4", IP, 1080)),
        (f"http://{IP}:8080/", http(IP, 8080)),
        (f"alice@{IP}:8080", http(IP, 8080, "alice", None)),
        (f"socks5://alice@{IP}:1080", Route("socks5", IP, 1080, "alice", None)),
        (f"alice:@{IP}:8080", http(IP, 8080, "alice", "")),
        (f"{IP}:8080:alice:", http(IP, 8080, "alice", "")),
        (f"alice:p@ss@{IP}:8080", http(IP, 8080, "alice", "p@ss")),  # unencoded '@': the last one splits
        (f"alice:a:b@{IP}:8080", http(IP, 8080, "alice", "a:b")),
        (f"{IP}:00080", http(IP, 80)),
        (f"{IP}:1", http(IP, 1)),
        (f"{IP}:65535", http(IP, 65535)),
        (f"  {IP}:8080  \r\n", http(IP, 8080)),
        (f"\ufeff{IP}:8080", http(IP, 8080)),
    ],
)
def test_accepted_formats(line, expected):
    assert parse_line(line) == expected


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("[2001:db8::1]:8080", http("2001:db8::1", 8080)),
        ("[2001:DB8:0:0:0:0:0:1]:8080", http("2001:db8::1", 8080)),
        ("[::1]:3128", http("::1", 3128)),
        ("socks5://[2001:db8::7]:1080", Route("socks5", "2001:db8::7", 1080)),
        ("socks5://u:p@[2001:db8::7]:1080", Route("socks5", "2001:db8::7", 1080, "u", "p")),
        ("u:p@[2001:db8::7]:1080", http("2001:db8::7", 1080, "u", "p")),
        ("[2001:db8::7]:1080:u:p", http("2001:db8::7", 1080, "u", "p")),
        ("[2001:db8::7]:1080 DE elite", http("2001:db8::7", 1080)),
        ("[::ffff:192.0.2.1]:80", http(normalize_host("[::ffff:192.0.2.1]"), 80)),
        ("[::ffff:c000:201]:80", http(normalize_host("[::ffff:c000:201]"), 80)),
    ],
)
def test_ipv6_hosts_are_bracketed_and_normalised(line, expected):
    assert parse_line(line) == expected


@pytest.mark.parametrize(
    ("line", "host"),
    [
        ("proxy.example.net:3128", "proxy.example.net"),
        ("Proxy.Example.NET:3128", "proxy.example.net"),
        ("proxy.example.net.:3128", "proxy.example.net"),
        ("localhost:3128", "localhost"),
        ("squid_1.internal:3128", "squid_1.internal"),
        ("http://user:pw@GW-2.Example.org:3128", "gw-2.example.org"),
        ("0.0.0.0:3128", "0.0.0.0"),
    ],
)
def test_host_names_and_ipv4_are_normalised(line, host):
    assert parse_line(line).host == host


def test_percent_encoded_credentials_are_decoded_in_url_and_at_forms():
    assert parse_line(f"socks5://us%40er:p%3Ass%20w%2F@{IP}:1080") == Route(
        "socks5", IP, 1080, "us@er", "p:ss w/"
    )
    assert parse_line(f"us%3Aer:p%25@{IP}:8080") == http(IP, 8080, "us:er", "p%")
    assert parse_line(f"%E2%82%ACuro@{IP}:8080") == http(IP, 8080, "€uro", None)


def test_colon_form_credentials_are_literal():
    assert parse_line(f"{IP}:8080:us%40er:p%3A") == http(IP, 8080, "us%40er", "p%3A")


@pytest.mark.parametrize(
    "line",
    [
        f"{IP}:8080 US-N-S +",
        f"{IP}:8080 elite 120ms",
        f"{IP}:8080   # fast one",
        f"{IP}:8080\tUS\telite",
        f"{IP}:8080;US;elite",
        f"{IP}:8080,US,elite",
        f"{IP}:8080;",
        f"\t{IP}:8080 \t",
    ],
)
def test_annotated_lines_parse_only_the_first_column(line):
    assert parse_line(line) == http(IP, 8080)


# --- malformed lines --------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (f"{IP}:abc", "bad port 'abc'"),
        (f"{IP}:0", "bad port '0'"),
        (f"{IP}:65536", "bad port '65536'"),
        (f"{IP}:99999", "bad port '99999'"),
        (f"{IP}:123456", "bad port '123456'"),
        (f"{IP}:8o80 elite", "bad port '8o80'"),
        (f"{IP}:８０", "bad port '８０'"),  # full-width digits are not a port
        (f"{IP}:8080#fast", "bad port '8080#fast'"),
        (IP, "missing port"),
        (f"{IP}:", "missing port"),
        (f"{IP} elite US", "missing port"),
        ("proxy.example.net", "missing port"),
        (f"http://{IP}", "missing port"),
        (f"user:pass@{IP}", "missing port"),
        ("[2001:db8::1]", "missing port"),
        ("999.1.1.1", "missing port"),
        (f"ftp://{IP}:21", "unknown scheme 'ftp'"),
        (f"socks6://{IP}:1080", "unknown scheme 'socks6'"),
        (f"://{IP}:80", "unknown scheme ''"),
        ("999.1.1.1:80", "bad address '999.1.1.1'"),
        ("1.2.3:80", "bad address '1.2.3'"),
        ("01.2.3.4:80", "bad address '01.2.3.4'"),
        ("a..b:80", "bad address 'a..b'"),
        ("-bad.example.net:80", "bad address '-bad.example.net'"),
        ("[zz::1]:80", "bad address '[zz::1]'"),
        ("[203.0.113.9]:80", "bad address '[203.0.113.9]'"),
        ("[2001:db8::1:80", "bad address '[2001:db8::1:80'"),
        ("[2001:db8::1]8080", "bad address '[2001:db8::1]8080'"),
        (":8080", "empty host"),
        ("http://:8080", "empty host"),
        ("user:pass@:8080", "empty host"),
        ("[]:8080", "empty host"),
        (f":pass@{IP}:8080", "empty user in credentials"),
        (f"socks5://:pass@{IP}:1080", "empty user in credentials"),
        (f"@{IP}:8080", "empty user in credentials"),
        (f"{IP}:8080::pass", "empty user in credentials"),
        (f"{IP}:8080:user", "too many colons"),
        (f"{IP}:8080:u:p:x", "too many colons"),
        (f"u:p@{IP}:8080:8081", "too many colons"),
        (f"http://{IP}:8080:9090", "too many colons"),
        ("2001:db8::1:8080", "IPv6 address must be bracketed"),
        ("2001:db8::1", "IPv6 address must be bracketed"),
        ("socks5://2001:db8::1:1080", "IPv6 address must be bracketed"),
        (f"http://{IP}:8080/path", "unexpected path '/path'"),
    ],
)
def test_malformed_line_reason(line, reason):
    with pytest.raises(ParseError) as info:
        parse_line(line)
    assert info.value.reason == reason
    assert str(info.value) == reason
    assert isinstance(info.value, ValueError)


def test_reason_clips_long_tokens():
    with pytest.raises(ParseError) as info:
        parse_line(f"{IP}:" + "9" * 500)
    assert info.value.reason == "bad port '" + "9" * 39 + "…'"


# --- skipped lines ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "line",
    [
        "",
        "   ",
        "\t\r\n",
        "# comment",
        "   #indented comment 1.2.3.4:80",
        "// C-style comment",
        "; ini comment",
        ",,,",
        "Free proxy list - updated hourly",
        "Proxy list updated at 2024-05-01 10:00:00 UTC",
        "Total: 300 proxies",
        "IP address   Port   Country",
        "IP:PORT",
        "--- end ---",
        "-----",
        "END",
        "Thanks.",
        "Support us at https://donate.invalid/magpie",
        "Mirror: https://mirror.invalid/list.txt",
        "Updated: 10:00:00 UTC",
        "01.05.2024 list refresh",
        "[INFO] list generated",
        "http proxies (anonymous)",
    ],
)
def test_prose_comments_and_blanks_are_skipped(line):
    assert parse_line(line) is None


# --- whole lists ------------------------------------------------------------------------------------------

MIXED = [
    "Free proxy list - updated hourly",          # 1 prose
    "Proxy list updated at 2024-05-01 10:00:00 UTC",  # 2 prose
    "",                                          # 3 blank
    "IP address   Port   Country",               # 4 prose
    "203.0.113.9:8080 US-N-S +",                 # 5 ok
    "# comment",                                 # 6 comment
    "203.0.113.10:3128",                         # 7 ok
    "999.1.1.1:80",                              # 8 bad address
    "socks5://u:p@203.0.113.11:1080",            # 9 ok
    "203.0.113.9:8080",                          # 10 duplicate of 5
    "HTTP://203.0.113.10:3128",                  # 11 duplicate of 7 (same Route)
    "203.0.113.12",                              # 12 missing port
    "ftp://203.0.113.13:21",                     # 13 unknown scheme
    "203.0.113.9:8080:u:p",                      # 14 ok: credentials make it a different route
    "socks4://203.0.113.9:8080",                 # 15 ok: protocol makes it a different route
    "999.1.1.1:80",                              # 16 bad address again (invalid, not a duplicate)
    "Total: 300 proxies",                        # 17 prose
    "--- end ---",                               # 18 prose
]


def test_mixed_list_counts_and_line_numbers():
    result = parse_lines(MIXED)
    assert result.routes == [
        http("203.0.113.9", 8080),
        http("203.0.113.10", 3128),
        Route("socks5", "203.0.113.11", 1080, "u", "p"),
        http("203.0.113.9", 8080, "u", "p"),
        Route("socks4", "203.0.113.9", 8080),
    ]
    assert result.valid == 5
    assert result.duplicates == 2
    assert result.skipped == 7
    assert result.invalid == [
        InvalidLine(8, "bad address '999.1.1.1'", "999.1.1.1:80"),
        InvalidLine(12, "missing port", "203.0.113.12"),
        InvalidLine(13, "unknown scheme 'ftp'", "ftp://203.0.113.13:21"),
        InvalidLine(16, "bad address '999.1.1.1'", "999.1.1.1:80"),
    ]
    assert result.valid + result.duplicates + result.skipped + len(result.invalid) == len(MIXED)


def test_first_occurrence_wins_and_order_is_kept():
    lines = ["203.0.113.3:1", "203.0.113.1:1", "203.0.113.3:1", "203.0.113.2:1", "203.0.113.1:1"]
    result = parse_lines(lines)
    assert [r.host for r in result.routes] == ["203.0.113.3", "203.0.113.1", "203.0.113.2"]
    assert result.duplicates == 2


def test_duplicates_compare_normalised_routes():
    result = parse_lines(
        [
            "[2001:DB8::1]:80",
            "[2001:db8:0::1]:80",
            "Proxy.Example.NET:80",
            "http://proxy.example.net.:80",
            "u%40x:p@proxy.example.net:80",
            "u@x:p@proxy.example.net:80",
        ]
    )
    assert result.valid == 3
    assert result.duplicates == 3


def test_parse_lines_accepts_a_string_and_a_one_shot_iterator():
    text = "203.0.113.1:80\n# c\n203.0.113.2:80\r\nnope:x\n"
    from_text = parse_lines(text)
    from_iter = parse_lines(iter(text.splitlines(keepends=True)))
    assert from_text == from_iter
    assert (from_text.valid, from_text.skipped, from_text.invalid) == (2, 2, [])


def test_empty_input():
    assert parse_lines([]) == ParseResult(routes=[], duplicates=0, skipped=0, invalid=[])


def test_invalid_text_is_stripped_and_clipped():
    long_line = "  999.1.1.1:80 " + "x" * 1000 + "\n"
    (bad,) = parse_lines([long_line]).invalid
    assert bad.text == long_line.strip()[:300]
    assert len(bad.text) == 300


# --- default protocol -------------------------------------------------------------------------------------

def test_default_protocol_applies_only_without_scheme():
    result = parse_lines([f"{IP}:1080", f"u:p@{IP}:1081", f"{IP}:1082:u:p", f"http://{IP}:1083"], "socks5")
    assert [r.protocol for r in result.routes] == ["socks5", "socks5", "socks5", "http"]
    assert parse_line(f"{IP}:1080", default_protocol="socks4").protocol == "socks4"
    assert parse_line(f"{IP}:1080").protocol == "http"


@pytest.mark.parametrize("bad", ["ftp", "SOCKS5", "socks5h", ""])
def test_unknown_default_protocol_is_rejected(bad, tmp_path):
    missing = tmp_path / "does-not-exist.txt"
    for call in (
        lambda: parse_line(f"{IP}:80", bad),
        lambda: parse_lines([], bad),
        lambda: parse_file(missing, bad),  # checked before the file is opened
    ):
        with pytest.raises(ValueError) as info:
            call()
        assert not isinstance(info.value, ParseError)
        assert repr(bad) in str(info.value)


# --- files ------------------------------------------------------------------------------------------------

def test_parse_file_reads_utf8_with_replacement(tmp_path):
    path = tmp_path / "list.txt"
    path.write_bytes(
        b"\xef\xbb\xbf# list with a BOM\r\n"
        b"203.0.113.1:8080\r\n"
        b"\xff\xfe garbage line\r\n"
        b"203.0.113.2:8080 \xe2\x82\xac\r\n"
        b"caf\xe9.example.net:80\r\n"
        b"203.0.113.1:8080"
    )
    result = parse_file(path)
    assert result.routes == [http("203.0.113.1", 8080), http("203.0.113.2", 8080)]
    assert result.skipped == 2
    assert result.duplicates == 1
    assert result.invalid == [
        InvalidLine(5, "bad address 'caf\ufffd.example.net'", "caf\ufffd.example.net:80")
    ]


def test_parse_file_accepts_str_path_and_default_protocol(tmp_path):
    path = tmp_path / "socks.txt"
    path.write_text("203.0.113.1:1080\n203.0.113.2:1080\n", encoding="utf-8")
    result = parse_file(str(path), default_protocol="socks5")
    assert result.routes == [Route("socks5", "203.0.113.1", 1080), Route("socks5", "203.0.113.2", 1080)]


# --- properties -------------------------------------------------------------------------------------------

_label = st.from_regex(r"[a-z0-9_]([a-z0-9_-]{0,12}[a-z0-9_])?", fullmatch=True)
_hostnames = st.lists(_label, min_size=1, max_size=4).map(".".join).filter(
    lambda h: not all(part.isdigit() for part in h.split("."))
)
_hosts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda a: normalize_host(f"[{a}]")),
    _hostnames,
)
# credentials with control characters (NUL, terminal escapes) are refused on import
_secret = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)


@st.composite
def _routes(draw):
    user = draw(st.none() | _secret.filter(bool))
    password = None if user is None else draw(st.none() | _secret)
    return Route(draw(st.sampled_from(PROTOCOLS)), draw(_hosts), draw(st.integers(1, 65535)), user, password)


@given(_routes())
def test_url_round_trips(route):
    assert parse_line(route.url()) == route
    assert parse_line(f"  {route.url()}\tUS elite 120ms") == route
    assert parse_lines([route.url(), route.url()]).routes == [route]


@given(_routes().filter(lambda r: r.username is None))
def test_bare_hostport_round_trips_with_default_protocol(route):
    assert parse_line(route.hostport, default_protocol=route.protocol) == route


@given(
    st.one_of(
        st.text(alphabet="0123456789abcdefABCDEF:.%", max_size=45).map(lambda s: f"[{s}]"),
        st.text(alphabet="0123456789.", max_size=20),
        st.text(alphabet="abcXYZ019._-", max_size=30),
        st.ip_addresses().map(str),
        st.ip_addresses(v=6).map(lambda a: f"[{a.exploded.upper()}]"),
    )
)
@example("[::ffff:c000:201]")  # IPv4-mapped: inet_ntop would print a dotted tail here
@example("[::c000:201]")
@example("[0:0:0:0:0:FFFF:C000:0201]")
@example("[1:0:2:3:4:5:6:7]")  # a single zero group is not compressed
@example("[0:0:1:0:0:1:0:0]")  # leftmost of equal zero runs is compressed
@settings(suppress_health_check=[HealthCheck.filter_too_much])
def test_fast_host_normalisation_matches_normalize_host(host):
    try:
        expected = normalize_host(host)
    except ValueError:
        expected = ValueError
    try:
        got = _normalize_host(host)
    except ValueError:
        got = ValueError
    assert got == expected


@given(st.text(max_size=60))
def test_any_text_parses_skips_or_raises_parse_error(text):
    try:
        route = parse_line(text)
    except ParseError as exc:
        assert exc.reason
        return
    if route is not None:
        assert route.protocol in PROTOCOLS
        assert 0 < route.port < 65536
        assert route == _parse_address(route.url(), "http")


# --- credentials with whitespace, ';' or ',' --------------------------------------------------------------

@pytest.mark.parametrize(
    "line",
    [
        f"user:s3 cr3t@{IP}:8080",
        f"user:s3;cr3t@{IP}:8080",
        f"user:s3,cr3t@{IP}:8080 US elite",
        f"us er:s3cr3t@{IP}:8080",
        f"socks5://user:s3 cr3t@{IP}:1080",
        f"user:s3 cr3t@[2001:db8::1]:8080",
    ],
)
def test_credentials_cut_by_a_separator_are_refused_not_skipped(line):
    with pytest.raises(ParseError) as info:
        parse_line(line)
    assert info.value.reason.startswith("credentials contain whitespace")
    assert "s3" not in info.value.reason and "cr3t" not in info.value.reason  # nothing of the secret


@pytest.mark.parametrize(
    "line",
    [
        f"{IP}:8080:user:pa ss",
        f"{IP}:8080:user:pa\tss",
        f"{IP}:8080:user:pa;ss",
        f"{IP}:8080:user:pass US elite",
        f"socks5://{IP}:1080:user:pa ss",
        f"[2001:db8::7]:1080:u:p x",
    ],
)
def test_text_after_a_colon_form_password_is_refused_not_cut(line):
    with pytest.raises(ParseError) as info:
        parse_line(line)
    assert info.value.reason.startswith("text after host:port:user:pass")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (f"{IP}:8080:user:pass # eu-west", http(IP, 8080, "user", "pass")),
        (f"{IP}:8080:user:pass;", http(IP, 8080, "user", "pass")),
        (f"{IP}:8080:user:pass \t", http(IP, 8080, "user", "pass")),
        (f"user:pa%20ss@{IP}:8080 US", http(IP, 8080, "user", "pa ss")),
        (f"socks5://user:pa%20ss@{IP}:1080", Route("socks5", IP, 1080, "user", "pa ss")),
        (f"u:p@{IP}:8080 contact admin@{IP}:25", http(IP, 8080, "u", "p")),  # annotations may hold '@'
    ],
)
def test_encoded_or_annotated_credentials_still_parse(line, expected):
    assert parse_line(line) == expected


@pytest.mark.parametrize(
    "line",
    ["Contact: admin@example.com", "Mail john@example.com for access", "Support: help @ example.com:443"],
)
def test_prose_with_an_at_sign_is_still_prose(line):
    assert parse_line(line) is None


def test_whitespace_credentials_are_reported_with_their_line_numbers():
    result = parse_lines([f"{IP}:8080", f"user:pa ss@{IP}:8081", f"{IP}:8082:user:pa ss", f"{IP}:8083 US-N-S +"])
    assert result.routes == [http(IP, 8080), http(IP, 8083)]
    assert [(x.line, x.reason.split(" ")[0]) for x in result.invalid] == [(2, "credentials"), (3, "text")]


# --- a caller's refusal (the importer passes the egress guard) --------------------------------------------

def test_refused_routes_are_invalid_per_line_and_the_rest_still_parse(tmp_path):
    def refuse(route):
        return f"refused: {route.host}" if route.host.startswith("10.") else None

    lines = ["10.0.0.1:80", f"{IP}:80", "# c", "10.0.0.1:80", f"{IP}:80", "10.0.0.2:81 US", "999.1.1.1:80"]
    result = parse_lines(lines, refuse=refuse)
    assert result.routes == [http(IP, 80)]
    assert (result.duplicates, result.skipped) == (1, 1)
    assert result.invalid == [
        InvalidLine(1, "refused: 10.0.0.1", "10.0.0.1:80"),
        InvalidLine(4, "refused: 10.0.0.1", "10.0.0.1:80"),  # a refused route's repeat is refused too
        InvalidLine(6, "refused: 10.0.0.2", "10.0.0.2:81 US"),
        InvalidLine(7, "bad address '999.1.1.1'", "999.1.1.1:80"),
    ]
    path = tmp_path / "list.txt"
    path.write_text("\n".join(lines))
    assert parse_file(path, refuse=refuse) == result
    assert parse_lines(lines).valid == 3  # the parser applies no policy of its own
