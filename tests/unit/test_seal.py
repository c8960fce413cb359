"""Sealed check messages: one authenticated encryption per message, payloads back byte for byte, a short
``argsrepr``, and refusal of anything not sealed under this key."""

from __future__ import annotations

import base64
import dataclasses
import json
import time

import pytest

from magpie.queue import Lease
from magpie.queue.payload import Payload
from magpie.queue.seal import FIELDS, SEAL_PREFIX, SEAL_PREFIX_V1, MessageSeal, SealError, describe, get_seal
from magpie.base.routes import Route

KEY = "unit-seal-key-0123456789"
PASSWORD = "Sl7/seal@canary:4%q"


def _leases(n: int, password: str = PASSWORD) -> list[dict]:
    out = []
    for i in range(n):
        route = Route("socks5", f"10.1.{i // 256}.{i % 256}", 1080 + i, f"user{i}", f"{password}{i}")
        payload = Payload(i + 1, route, f"{i:024x}", [1, 7]).encode()
        out.append(Lease(f"{i:024x}", payload, "1700000000000.00", "1700000300000.50",
                         "magpie:{default}:proxy_queue:3", i % 2 == 0, i % 3, 1.25 * i).to_dict())
    return out


def test_fields_are_the_lease_fields_in_order():
    names = tuple(f.name for f in dataclasses.fields(Lease) if not f.name.startswith("_"))
    assert FIELDS == names


def test_round_trip_gives_every_payload_back_byte_for_byte():
    odd = ['{"v":1,"s":"quote \\" back\\\\slash"}', "ünïcødé ☃ \u2028 tab\t", "\ud800 lone surrogate", ""]
    leases = _leases(5)
    for i, text in enumerate(odd):
        leases[i]["payload"] = text
    sealed = get_seal(KEY).seal(leases)
    assert sealed.startswith(SEAL_PREFIX) and sealed.isascii()
    assert get_seal(KEY).unseal(sealed) == leases
    objs = get_seal(KEY).unseal_leases(sealed)
    assert [o.to_dict() for o in objs] == leases
    assert all(isinstance(o, Lease) and not o.cancelled for o in objs)
    assert [o.payload.encode("utf-8", "surrogatepass") for o in objs] == \
        [d["payload"].encode("utf-8", "surrogatepass") for d in leases]


def test_sealed_text_holds_no_credential_in_any_form():
    sealed = get_seal(KEY).seal(_leases(3))
    for form in (PASSWORD, "Sl7%2Fseal%40canary%3A4%25q", "user1", '"s":'):
        assert form not in sealed


def _seal_v1(leases: list[dict]) -> str:
    """A message as an earlier promote sealed it: the same JSON, not compressed, version-1 data."""
    import binascii
    import os

    from magpie.queue import seal as mod

    doc = {"f": FIELDS, "r": [[d[k] for k in FIELDS] for d in leases]}
    nonce = os.urandom(12)
    body = json.dumps(doc, separators=(",", ":")).encode()
    raw = nonce + get_seal(KEY)._aead.encrypt(nonce, body, mod._AAD)
    return SEAL_PREFIX_V1 + binascii.b2a_base64(raw, newline=False).decode()


def test_messages_are_compressed_and_version_one_messages_still_open():
    leases = _leases(250)
    sealed = get_seal(KEY).seal(leases)
    old = _seal_v1(leases)
    assert len(sealed) * 3 < len(old)  # repetitive payloads: zlib before the encryption
    assert get_seal(KEY).unseal(old) == leases == get_seal(KEY).unseal(sealed)


def test_a_message_relabelled_as_the_other_version_is_refused():
    leases = _leases(3)
    for sealed, other in ((get_seal(KEY).seal(leases), SEAL_PREFIX_V1), (_seal_v1(leases), SEAL_PREFIX)):
        with pytest.raises(SealError, match="altered"):
            get_seal(KEY).unseal(other + sealed[3:])


def test_each_message_gets_its_own_nonce():
    leases = _leases(2)
    assert get_seal(KEY).seal(leases) != get_seal(KEY).seal(leases)


@pytest.mark.parametrize("bad", [
    [{"member": "x"}],  # a plaintext lease list (an older promote)
    "not sealed",
    SEAL_PREFIX + "!!!not base64!!!",
    SEAL_PREFIX + "AAAA",
])
def test_anything_not_sealed_is_refused_as_a_whole(bad):
    with pytest.raises(SealError):
        get_seal(KEY).unseal_leases(bad)


def test_another_key_or_one_flipped_bit_is_refused():
    sealed = get_seal(KEY).seal(_leases(2))
    with pytest.raises(SealError, match="PROXY_ENCRYPTION_KEY") as err:
        MessageSeal("another-key-0123456789").unseal(sealed)
    assert PASSWORD not in str(err.value)
    raw = bytearray(base64.b64decode(sealed[len(SEAL_PREFIX):]))
    raw[20] ^= 1  # one bit of the ciphertext
    with pytest.raises(SealError, match="altered"):
        get_seal(KEY).unseal(SEAL_PREFIX + base64.b64encode(bytes(raw)).decode())


def test_describe_is_a_lease_count():
    assert describe(250) == "<250 leases>" and describe(1) == "<1 lease>"


def test_sealing_250_leases_stays_cheap():
    """One JSON encoding and one AES-GCM pass per message: well under 5 ms for 250 leases here (measured
    about 0.4 ms to seal and 0.6 ms to open on this machine kind)."""
    leases, seal = _leases(250), get_seal(KEY)
    sealed = seal.seal(leases)
    n = 30
    t0 = time.perf_counter()
    for _ in range(n):
        seal.seal(leases)
    t1 = time.perf_counter()
    for _ in range(n):
        seal.unseal_leases(sealed)
    t2 = time.perf_counter()
    assert (t1 - t0) / n < 0.005 and (t2 - t1) / n < 0.005, ((t1 - t0) / n, (t2 - t1) / n)


def test_dispatch_sends_one_sealed_message_with_a_short_argsrepr(monkeypatch):
    from magpie.wiring import runtime, tasks

    sent = []
    monkeypatch.setattr(tasks.check_routes, "apply_async", lambda **kw: sent.append(kw))
    leases = _leases(3)
    tasks._dispatch_checks(leases)
    (kw,) = sent
    assert kw["argsrepr"] == "<3 leases>" and kw["kwargsrepr"] == "{}" and kw["queue"] == "checks"
    (arg,) = kw["args"]
    assert isinstance(arg, str) and PASSWORD not in json.dumps(kw)

    admitted = []

    class Pool:
        def offer(self, ls):
            admitted.extend(ls)
            return []

    monkeypatch.setattr(runtime, "check_pool", lambda: Pool())
    assert tasks.check_routes.run(arg) == 3
    assert [le.to_dict() for le in admitted] == leases
    with pytest.raises(SealError):
        tasks.check_routes.run(leases)  # an unsealed message admits nothing
    assert len(admitted) == 3


def test_a_full_process_passes_the_leases_it_has_no_slot_for_on(monkeypatch):
    from magpie.wiring import runtime, tasks

    sent = []
    monkeypatch.setattr(tasks.check_routes, "apply_async", lambda **kw: sent.append(kw))
    leases = _leases(5)
    tasks._dispatch_checks(leases)
    (arg,) = sent.pop()["args"]
    taken, waited = [], []

    class Pool:  # two free slots, then none
        room = 2

        def offer(self, ls):
            n, self.room = min(self.room, len(ls)), self.room - min(self.room, len(ls))
            taken.extend(ls[:n])
            return ls[n:]

        def submit(self, ls):
            waited.extend(ls)
            return len(ls)

    monkeypatch.setattr(runtime, "check_pool", lambda: Pool())
    assert tasks.check_routes.run(arg) == 2
    (kw,) = sent
    sealed, hops = kw["args"]
    assert hops == 1 and kw["argsrepr"] == "<3 leases>" and kw["queue"] == "checks"
    assert [le.to_dict() for le in taken] == leases[:2]
    sent.clear()
    monkeypatch.setattr(runtime, "check_pool", lambda: Pool())
    assert tasks.check_routes.run(sealed, hops) == 2  # the next process takes two, passes one on
    ((sealed, hops),) = [kw["args"] for kw in sent]
    assert hops == 2
    assert tasks.check_routes.run(sealed, hops) == 1 and not sent[1:]  # the last hop waits for a slot
    assert [le.to_dict() for le in waited] == leases[4:]
