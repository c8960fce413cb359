"""Sealed queue payload credentials (``PROXY_QUEUE_ENCRYPT_CREDENTIALS``): format, keys and errors."""

from __future__ import annotations

import re

import pytest

from magpie.config import load_settings
from magpie.base.crypto import CredentialError, _derive, get_keyring
from magpie.queue.payload import (
    ENCRYPTED_VERSION, PAYLOAD_VERSION, Payload, PayloadError, PayloadKeyError, is_encrypted, read_cipher,
    transcode, write_cipher,
)
from magpie.base.routes import Route

KEY = "unit-key-0123456789abcdef"
OTHER = "another-key-0123456789abcdef"
USER, PASSWORD = "qz-user-7", "Qz!distinct p@ss:w0rd\u00e9"
HASH = "0123456789abcdef01234567"
SPLIT_W = re.compile(r'^(.*"w":)\[([\d,]*)\]}$', re.S)  # the pattern of lib.lua's split_w
CIPHER = get_keyring(KEY).queue


def payload(user=USER, pw=PASSWORD, ws=(3, 1)) -> Payload:
    return Payload(42, Route("socks5", "127.0.0.1", 1080, user, pw), HASH, list(ws))


def test_sealed_payload_hides_credentials_and_keeps_the_lua_shape():
    text = payload().encode(CIPHER)
    assert USER not in text and "distinct" not in text and '"u"' not in text and '"s"' not in text
    assert text.startswith('{"v":2,') and is_encrypted(text)
    head, ids = SPLIT_W.match(text).groups()
    assert ids == "1,3" and re.search(r'"c":"[A-Za-z0-9_-]+","k":"' + HASH + '","w":$', head)
    back = Payload.decode(text, CIPHER)
    assert (back.route.username, back.route.password, back.version) == (USER, PASSWORD, ENCRYPTED_VERSION)
    assert back.workspaces == [1, 3] and back.route_hash == HASH


def test_sealing_is_deterministic_and_compact():
    plain, sealed = payload().encode(), payload().encode(CIPHER)
    assert sealed == payload().encode(CIPHER)  # a rebuild writes the same text
    assert len(sealed) - len(plain) <= 40


@pytest.mark.parametrize("user,pw", [(None, None), ("only-user", None)])
def test_routes_without_a_password_or_credentials(user, pw):
    text = payload(user, pw).encode(CIPHER)
    assert text.startswith('{"v":2,' if user else '{"v":1,')  # nothing to seal: stays version 1
    back = Payload.decode(text, CIPHER)
    assert (back.route.username, back.route.password) == (user, pw)


@pytest.mark.parametrize("user,pw", [("", ""), (None, "pw-only"), ("u" * 300, "p\x00w:@%"),
                                     ("\u00e9l\u00e8ve", "\U0001f511 key")])
def test_any_credentials_round_trip_through_the_cipher(user, pw):
    assert CIPHER.open(CIPHER.seal(user, pw, HASH), HASH) == (user, pw)


def test_legacy_plaintext_payloads_still_decode_with_or_without_a_cipher():
    legacy = payload().encode()
    assert legacy.startswith('{"v":1,') and f'"u":"{USER}"' in legacy and "distinct" in legacy
    for c in (None, CIPHER):
        back = Payload.decode(legacy, c)
        assert (back.route.username, back.route.password, back.version) == (USER, PASSWORD, PAYLOAD_VERSION)


def test_wrong_or_missing_key_is_one_clear_line_without_secrets():
    text = payload().encode(CIPHER)
    for cipher in (get_keyring(OTHER).queue, None):
        with pytest.raises(PayloadKeyError) as ei:
            Payload.decode(text, cipher)
        msg = str(ei.value)
        assert "PROXY_ENCRYPTION_KEY" in msg and "\n" not in msg and HASH in msg
        assert "distinct" not in msg and USER not in msg and text[40:80] not in msg
        assert isinstance(ei.value, PayloadError) and isinstance(ei.value, CredentialError)


def test_a_token_is_bound_to_its_route_and_to_its_bytes():
    text = payload().encode(CIPHER)
    other_route = text.replace(HASH, "f" * 24)
    with pytest.raises(PayloadKeyError):
        Payload.decode(other_route, CIPHER)
    token = re.search(r'"c":"([^"]+)"', text).group(1)
    flipped = token[:-3] + ("A" if token[-3] != "A" else "B") + token[-2:]
    with pytest.raises(PayloadKeyError):
        Payload.decode(text.replace(token, flipped), CIPHER)


@pytest.mark.parametrize("bad", [
    '{"v":2,"id":1,"p":"http","h":"h","o":1,"u":"x","c":"abc","k":"k","w":[1]}',  # both forms
    '{"v":2,"id":1,"p":"http","h":"h","o":1,"k":"k","w":[1]}',  # v 2 without c
    '{"v":1,"id":1,"p":"http","h":"h","o":1,"c":"abc","k":"k","w":[1]}',  # c in a v 1 payload
    '{"v":3,"id":1,"p":"http","h":"h","o":1,"k":"k","w":[1]}',
])
def test_malformed_versions_are_refused(bad):
    with pytest.raises(PayloadError):
        Payload.decode(bad, CIPHER)


def test_transcode_round_trips_and_is_idempotent():
    plain = payload().encode()
    sealed = transcode(plain, CIPHER, encrypt=True)
    assert sealed == payload().encode(CIPHER)
    assert transcode(sealed, CIPHER, encrypt=True) is None
    assert transcode(sealed, CIPHER, encrypt=False) == plain
    assert transcode(plain, CIPHER, encrypt=False) is None
    assert transcode(payload(None, None).encode(), CIPHER, encrypt=True) is None


def test_queue_key_is_its_own_subkey():
    assert _derive(KEY, b"queue-credentials-v1", 64)[:32] != _derive(KEY, b"credentials-v1")
    assert _derive(KEY, b"queue-credentials-v1", 64)[:32] != _derive(KEY, b"route-hash-v1")
    at_rest = get_keyring(KEY).encrypt(PASSWORD)
    assert PASSWORD not in at_rest


def test_the_setting_picks_the_write_cipher():
    off = load_settings(encryption_key=KEY)
    on = load_settings(encryption_key=KEY, encrypt_queue_credentials=True)
    assert write_cipher(off) is None and write_cipher(on) is read_cipher(off) is CIPHER
