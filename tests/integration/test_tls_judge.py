"""A self-hosted https judge with a private CA, reached through the lab's http proxy (CONNECT) on loopback.

The CA and the judge's certificate (for 127.0.0.1) are generated here with ``cryptography``; the judge is
magpie's own echo server with its listening socket wrapped in TLS.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import logging
import ssl
import threading

import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from magpie.checker import tls
from magpie.checker.engine import CheckEngine
from magpie.checker.judge import make_judge_server
from magpie.cli import main
from magpie.config import ConfigError, get_settings, load_settings
from magpie.observability.health import judge_probe
from magpie.lab.lab import start_free_lab


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         key_cert_sign=True, crl_sign=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """``{"ca": path, "other_ca": path, "cert": path, "key": path}``: a private CA, its judge certificate for
    127.0.0.1, and an unrelated CA."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca = _ca("magpie test judge CA")
    _, other = _ca("someone else's CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": d / "ca.pem", "other_ca": d / "other.pem", "cert": d / "judge.pem", "key": d / "judge.key"}
    paths["ca"].write_bytes(_pem(ca))
    paths["other_ca"].write_bytes(_pem(other))
    paths["cert"].write_bytes(_pem(cert))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def https_judge(pki):
    """``https://127.0.0.1:<port>/``: the echo judge behind TLS with the private CA's certificate."""
    server = make_judge_server("127.0.0.1", 0)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki["cert"], pki["key"])
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    yield f"https://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def lab():
    lab = start_free_lab(slow_delay=0.2)
    yield lab
    lab.stop()


def check(settings, judge_url, ca_bundle, route):
    s = settings.model_copy(update={"judge_url": judge_url, "judge_ca_bundle": ca_bundle, "check_attempts": 1,
                                    "check_timeout": 5.0})
    engine = CheckEngine.from_settings(s)
    return asyncio.run(engine.check(route))


def test_https_judge_with_a_private_ca_is_alive_through_the_http_proxy_only_with_the_bundle(
        settings, https_judge, pki, lab):
    route = lab.proxy("http-elite").route
    ok = check(settings, https_judge, pki["ca"], route)
    assert (ok.alive, ok.error, ok.status) == (True, None, 200), ok
    assert json.loads(ok.body)["remote_addr"] == lab.proxy("http-elite").egress  # it came through the tunnel
    for bundle in (None, pki["other_ca"]):  # system store, or a CA that did not sign the judge
        bad = check(settings, https_judge, bundle, route)
        assert (bad.alive, bad.error) == (False, "SSLError"), (bundle, bad)


def test_over_an_https_judge_a_header_adding_proxy_is_not_seen_and_a_warning_says_so(
        settings, https_judge, pki, lab, monkeypatch, caplog):
    monkeypatch.setattr(tls, "_warned", set())
    route = lab.proxy("http-transparent").route
    with caplog.at_level(logging.WARNING, logger="magpie.checker"):
        graded = check(settings, https_judge, pki["ca"], route)
        check(settings, https_judge, pki["ca"], route)
    notes = [r.getMessage() for r in caplog.records if "anonymity grading" in r.getMessage()]
    assert len(notes) == 1 and https_judge.rstrip("/") in notes[0], notes  # once per process and judge
    assert graded.alive and graded.anonymity == "elite"  # the documented limit: headers stay outside
    assert check(settings, lab.judge_url, None, route).anonymity == "transparent"  # an http judge sees them


def test_magpie_check_uses_the_ca_bundle_option_or_setting(settings, https_judge, pki, lab, tmp_path,
                                                           monkeypatch):
    lst = tmp_path / "one.txt"
    lst.write_text(lab.proxy("http-elite").route.url() + "\n")
    monkeypatch.delenv("MAGPIE_JUDGE_CA_BUNDLE", raising=False)
    get_settings.cache_clear()
    runner = CliRunner()
    args = ["check", str(lst), "--judge", https_judge, "--attempts", "1", "--timeout", "5", "--json"]
    try:
        res = runner.invoke(main, args + ["--ca-bundle", pki["ca"]])
        assert res.exit_code == 0, res.output
        first = json.loads(res.stdout)["results"][0]
        assert first["alive"] is True, first
        assert first["connect_ms"] is not None and first["handshake_ms"] is not None, first
        res = runner.invoke(main, args)
        assert res.exit_code == 1 and "does not answer" in res.output
        monkeypatch.setenv("MAGPIE_JUDGE_CA_BUNDLE", pki["ca"])
        get_settings.cache_clear()
        res = runner.invoke(main, args)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["results"][0]["alive"] is True
    finally:
        get_settings.cache_clear()


def test_ca_bundle_setting_is_validated_and_health_notes_https_judges(pki, tmp_path):
    with pytest.raises(ConfigError, match="MAGPIE_JUDGE_CA_BUNDLE"):
        load_settings(judge_ca_bundle=str(tmp_path / "missing.pem"))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="MAGPIE_JUDGE_CA_BUNDLE"):
        tls.judge_ssl_context(str(junk))
    assert tls.judge_ssl_context(pki["ca"]).verify_mode == ssl.CERT_REQUIRED
    assert "http judge" in judge_probe(load_settings(judge_url="http://127.0.0.1:8899/"))
    note = judge_probe(load_settings(judge_url="https://127.0.0.1:8443/", judge_ca_bundle=pki["ca"]))
    assert "anonymity grading" in note and "MAGPIE_JUDGE_CA_BUNDLE" in note
    with pytest.raises(ConfigError):
        judge_probe(load_settings(judge_url="https://127.0.0.1:8443/", judge_ca_bundle=str(junk)))


@pytest.fixture(scope="module")
def slow_lab():
    lab = start_free_lab(slow_delay=1.2)  # the slow proxy waits 1.2 s before dialing out (CONNECT too)
    yield lab
    lab.stop()


def test_a_slow_proxy_is_alive_through_an_https_judge_too_its_handshake_counts_against_the_deadline(
        https_judge, pki, slow_lab):
    route = slow_lab.proxy("http-slow").route
    ctx = tls.judge_ssl_context(pki["ca"])
    for judge, ssl_context in ((slow_lab.judge_url, None), (https_judge, ctx)):
        engine = CheckEngine(judge, timeout=4.0, attempts=1, connect_timeout=1.0, ssl_context=ssl_context)
        res = asyncio.run(engine.check(route))
        assert (res.alive, res.error) == (True, None), (judge, res)
        assert res.connect_ms is not None and res.connect_ms >= 0, res
    assert res.handshake_ms is not None and res.handshake_ms >= 1000.0, res  # the CONNECT waited 1.2 s
    plain = CheckEngine(slow_lab.judge_url, timeout=4.0, attempts=1, connect_timeout=1.0)
    assert asyncio.run(plain.check(route)).handshake_ms is None  # an absolute-URI GET has no handshake
    tight = CheckEngine(https_judge, timeout=0.6, attempts=1, connect_timeout=0.3, ssl_context=ctx)
    cut = asyncio.run(tight.check(route))
    assert (cut.alive, cut.error, cut.handshake_ms) == (False, "ReadTimeout", None), cut  # at the deadline
    assert cut.connect_ms is not None, cut


def test_socks_and_connect_handshakes_are_timed_apart_from_the_connect(https_judge, pki, lab):
    ctx = tls.judge_ssl_context(pki["ca"])
    for name in ("http-elite", "socks5-elite"):
        res = asyncio.run(CheckEngine(https_judge, timeout=5.0, attempts=1, ssl_context=ctx).check(
            lab.proxy(name).route))
        assert res.alive, (name, res)
        assert res.connect_ms is not None and res.handshake_ms is not None, (name, res)
    socks4 = lab.proxy("socks4-elite").route
    res = asyncio.run(CheckEngine(lab.judge_url, timeout=5.0, attempts=1).check(socks4))
    assert res.alive and res.connect_ms is not None and res.handshake_ms is not None, res
