"""List formats beyond the plain line (magpie.importer.formats through magpie.importer.parse): JSON lines, CSV
and TSV with a header, column pairs, annotated colon forms and ``--format``, IDN hosts, line numbers."""

from __future__ import annotations

import io

import pytest

from magpie.importer.formats import AMBIGUOUS, FORMATS, is_code
from magpie.importer.parse import ParseError, parse_file, parse_line, parse_lines, split_lines
from magpie.base.routes import Route

IP = "203.0.113.9"


def http(host: str, port: int, user: str | None = None, password: str | None = None) -> Route:
    return Route("http", host, port, user, password)


# --- annotated colon forms ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "line",
    [
        f"{IP}:8080:US:elite",
        f"{IP}:8080:de:anonymous",
        f"{IP}:8080:US:transparent",
        f"{IP}:8080:US:H",
        f"{IP}:8080:user:elite",  # either field looking like a code is enough
        f"{IP}:8080:DE:s3cret",
        f"{IP}:8080:US:elite   # comment",
        f"socks5://{IP}:1080:US:elite",
        "[2001:db8::1]:8080:US:elite",
    ],
)
def test_two_code_fields_are_never_guessed(line):
    with pytest.raises(ParseError) as info:
        parse_line(line)
    assert info.value.reason == AMBIGUOUS
    assert "--format ip:port:country:anonymity" in info.value.reason
    assert "elite" not in info.value.reason and "s3cret" not in info.value.reason  # fields never quoted


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (f"{IP}:8080:US:elite", http(IP, 8080)),
        (f"{IP}:8080:alice:s3cret", http(IP, 8080)),  # the operator said: annotations
        (f"{IP}:8080:US:elite 120ms fast", http(IP, 8080)),
        (f"socks5://{IP}:1080:DE:anonymous", Route("socks5", IP, 1080)),
    ],
)
def test_format_country_anonymity_drops_the_fields(line, expected):
    assert parse_line(line, fmt="ip:port:country:anonymity") == expected


def test_format_user_pass_reads_credentials():
    assert parse_line(f"{IP}:8080:US:elite", fmt="ip:port:user:pass") == http(IP, 8080, "US", "elite")
    assert parse_line(f"{IP}:8080:de:x", fmt="ip:port:user:pass") == http(IP, 8080, "de", "x")


@pytest.mark.parametrize(
    "line",
    [f"{IP}:8080:US", f"{IP}:8080:elite", f"{IP}:8080:US:elite:S", f"{IP}:8080:US:H:+", f"{IP}:8080:FR:N:-:yes"],
)
def test_one_or_three_code_fields_are_annotations(line):
    assert parse_line(line) == http(IP, 8080)


def test_credentials_that_look_like_nothing_stay_credentials():
    assert parse_line(f"{IP}:8080:alice:s3cret") == http(IP, 8080, "alice", "s3cret")
    assert parse_line(f"{IP}:8080:u:p") == http(IP, 8080, "u", "p")


def test_ip_port_country_anon_ssl_after_whitespace():
    for line in (f"{IP}:3128 US-H-S +", f"{IP}:3128 DE-A -", f"{IP}:3128 RU-N!"):
        assert parse_line(line) == http(IP, 3128)


@pytest.mark.parametrize("field", ["US", "de", "elite", "Anonymous", "transparent", "H", "S", "+", "yes"])
def test_codes(field):
    assert is_code(field)


@pytest.mark.parametrize("field", ["alice", "s3cret", "u", "p", "", "123", "USA1"])
def test_not_codes(field):
    assert not is_code(field)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="format 'csv'"):
        parse_lines([], fmt="csv")
    with pytest.raises(ValueError, match="format"):
        parse_file("/nonexistent", fmt="x")
    assert FORMATS[0] == "auto"


# --- JSON lines ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"ip": "203.0.113.9", "port": 8080, "protocol": "socks5"}', Route("socks5", IP, 8080)),
        ('{"ip": "203.0.113.9", "port": "8080"}', http(IP, 8080)),
        ('{"host": "Proxy.Example.NET", "port": 3128, "type": "HTTPS"}', Route("https", "proxy.example.net", 3128)),
        ('{"ip": "2001:db8::1", "port": 1080, "protocols": ["socks4", "socks5"]}', Route("socks4", "2001:db8::1", 1080)),
        ('{"IP": "203.0.113.9", "Port": 80, "username": "a b", "password": "c,d"}', http(IP, 80, "a b", "c,d")),
        ('{"proxy": "socks5://u:p@203.0.113.9:1080"}', Route("socks5", IP, 1080, "u", "p")),
        ('{"proxy": "203.0.113.9:1080", "protocol": "socks4"}', Route("socks4", IP, 1080)),
    ],
)
def test_json_lines(line, expected):
    assert parse_line(line) == expected


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"ip": "203.0.113.9", "port": 8080', "malformed JSON line"),
        ('{"port": 8080}', "JSON line has no 'ip' or 'host'"),
        ('{"ip": "203.0.113.9"}', "missing port"),
        ('{"ip": "203.0.113.9", "port": 0}', "bad port '0'"),
        ('{"ip": "203.0.113.9", "port": true}', "bad port"),
        ('{"ip": "203.0.113.9", "port": 80, "protocol": "ftp"}', "unknown protocol 'ftp'"),
        ('{"ip": "999.1.1.1", "port": 80}', "bad address"),
        ('[{"ip": "203.0.113.9", "port": 80}]', "JSON line is not an object"),
    ],
)
def test_bad_json_lines_are_invalid_not_skipped(line, reason):
    with pytest.raises(ParseError) as info:
        parse_line(line)
    assert info.value.reason.startswith(reason)


# --- CSV and TSV ----------------------------------------------------------------------------------------------

def test_csv_with_a_header():
    result = parse_lines([
        "ip,port,protocol,username,password",
        f'{IP},1080,socks5,alice,"pa,ss"',
        f"{IP},8080,,,",
        f"{IP},99999,http,,",
        "203.0.113.10,8080,ftp,,",
        ",,,,",
    ])
    assert result.routes == [Route("socks5", IP, 1080, "alice", "pa,ss"), http(IP, 8080)]
    assert result.skipped == 2  # the header and the empty row
    assert [(x.line, x.reason) for x in result.invalid] == [(4, "bad port '99999'"), (5, "unknown protocol 'ftp'")]


def test_tsv_and_semicolon_headers_and_an_address_column():
    result = parse_lines([
        "IP Address\tPort\tCode\tCountry",
        f"{IP}\t3128\tUS\tUnited States",
        "host;port;user;pass",
        f"{IP};1081;bob;s e;cret",  # 5 fields for 4 columns: malformed, never cut short
        f'{IP};1082;bob;"s e;cret"',
        "# proxy,country",
        f"socks5://{IP}:1083,DE",
    ])
    assert result.routes == [http(IP, 3128), http(IP, 1082, "bob", "s e;cret"), Route("socks5", IP, 1083)]
    assert result.skipped == 3
    assert [(x.line, x.reason) for x in result.invalid] == [(4, "row has 5 fields, its header 4")]


def test_column_pairs_without_a_header():
    result = parse_lines([
        f"{IP}\t8080\tUS\telite",
        f"{IP},1080,socks5",
        f"{IP} 3128",
        "proxy.example.net\t8000",
        "[2001:db8::1]\t8080",
        f"{IP} elite",  # no port column: malformed as before
        "Total 300",  # prose: no address in the first column
    ])
    assert result.routes == [http(IP, 8080), Route("socks5", IP, 1080), http(IP, 3128),
                             http("proxy.example.net", 8000), http("2001:db8::1", 8080)]
    assert [(x.line, x.reason) for x in result.invalid] == [(6, "missing port")]
    assert result.skipped == 1


# --- host names and line numbers ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("line", "host"),
    [
        ("Bücher.Example:8080", "xn--bcher-kva.example"),
        ("http://ПРИМЕР.рф:80", "xn--e1afmkfd.xn--p1ai"),
        ("XN--BCHER-KVA.example:8080", "xn--bcher-kva.example"),
        ("bücher。example:8080", "xn--bcher-kva.example"),  # an ideographic full stop is a dot
        ('{"host": "Bücher.example", "port": 80}', "xn--bcher-kva.example"),
    ],
)
def test_idn_hosts_are_normalised(line, host):
    assert parse_line(line).host == host


def test_idn_duplicates_compare_normalised():
    result = parse_lines(["bücher.example:80", "xn--bcher-kva.example:80", "BÜCHER.example:80"])
    assert result.valid == 1 and result.duplicates == 2


def test_invalid_idn_is_malformed():
    with pytest.raises(ParseError, match="bad address"):
        parse_line("b\u00fccher\u200d-.example:80")


def test_line_numbers_count_newlines_only():
    text = f"# a\r\n{IP}:1\r\n{IP}:2\x0b x\n{IP}:3\u2028\n999.1.1.1:80\n{IP}:4\r{IP}:5\nbad:99999\n"
    assert split_lines(text)[-1] == "bad:99999"
    result = parse_lines(text)
    assert [r.port for r in result.routes] == [1, 2, 3, 4, 5]
    assert [x.line for x in result.invalid] == [5, 7]


def test_files_and_streams_number_lines_alike(tmp_path):
    data = f"{IP}:1\r{IP}:2\r\n\r\nnope:1:2:3:4\n{IP}:bad\n".encode()
    path = tmp_path / "list.txt"
    path.write_bytes(data)
    from_file = parse_file(path)
    from_stream = parse_file(io.BytesIO(data))
    assert from_file == from_stream
    assert [r.port for r in from_file.routes] == [1, 2]
    assert [x.line for x in from_file.invalid] == [3, 4]


def test_an_at_sign_inside_a_literal_password_and_no_quoted_password_in_errors():
    from magpie.importer.parse import ParseError, parse_line

    r = parse_line("127.0.0.2:31080:alice:Sup3r@Secret")
    assert (r.host, r.port, r.username, r.password) == ("127.0.0.2", 31080, "alice", "Sup3r@Secret")
    r = parse_line("alice:Sup3r@127.0.0.2:31080")
    assert (r.host, r.port, r.username, r.password) == ("127.0.0.2", 31080, "alice", "Sup3r")
    with pytest.raises(ParseError) as exc:
        parse_line("1.1.1.5:80:user:p@ss:w0rd")
    assert "w0rd" not in str(exc.value) and "ss" not in str(exc.value).replace("passwords", "")
