"""The email outbox against real PostgreSQL and a real SMTP server (aiosmtpd on 127.0.0.1, free port).

"SMTP down" is a port with nothing listening (connection refused); time moves through explicit ``now``.
"""

from __future__ import annotations

import datetime as dt
import email
import ipaddress
import socket
import threading
from collections import Counter

import pytest
import sqlalchemy as sa
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult

from magpie.claims import rows as claim_rows
from magpie.outbox.invitations import create_invitation, find_valid_invitation
from magpie.outbox.service import (
    OUTBOX,
    HousekeepingReport,
    enqueue_email,
    housekeeping,
    list_outbox,
    outbox_counts,
    run_housekeeping,
    run_outbox_workers,
)

T0 = dt.datetime(2025, 3, 1, 12, 0, 0, tzinfo=dt.UTC)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sink:
    """aiosmtpd handler keeping every accepted message; ``bounce@...`` recipients get a 550."""

    def __init__(self):
        self.lock = threading.Lock()
        self.messages: list[email.message.Message] = []

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if address.startswith("bounce@"):
            return "550 5.1.1 no such mailbox"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):
        with self.lock:
            self.messages.append(email.message_from_bytes(envelope.content))
        return "250 Message accepted"

    def ids(self) -> Counter:
        with self.lock:
            return Counter(m["Message-ID"] for m in self.messages)


@pytest.fixture
def smtp_port():
    return free_port()


@pytest.fixture
def mail_settings(settings, smtp_port):
    return settings.model_copy(update={"smtp_host": "127.0.0.1", "smtp_port": smtp_port, "smtp_tls": "none",
                                       "smtp_timeout": 5.0, "smtp_from": "magpie@alerts.example.test"})


@pytest.fixture
def start_smtp(smtp_port):
    """Call it to bring the SMTP server up on ``smtp_port`` (stopped after the test)."""
    started = []

    def start(sink: Sink, **kw) -> Controller:
        ctl = Controller(sink, hostname="127.0.0.1", port=smtp_port, **kw)
        ctl.start()
        started.append(ctl)
        return ctl

    yield start
    for ctl in started:
        ctl.stop()


@pytest.fixture
def workspace(db):
    with db.begin() as c:
        return c.execute(sa.text("INSERT INTO workspaces (name) VALUES ('acme') RETURNING id")).scalar_one()


def outbox_rows(db) -> list[dict]:
    with db.connect() as c:
        return [dict(r) for r in c.execute(sa.text("SELECT * FROM email_outbox ORDER BY id")).mappings()]


def test_smtp_down_then_up_delivers_every_message_once(db, mail_settings, start_smtp, workspace):
    for i in range(5):
        enqueue_email(db, mail_settings, f"user{i}@example.test", f"hello {i}", "body", now=T0)
    inv = create_invitation(db, mail_settings, "acme", "new.member@example.test", now=T0)

    assert run_outbox_workers(db, mail_settings, 4, now=T0) == Counter(retry=6)  # nothing listens yet
    rows = outbox_rows(db)
    assert {(r["status"], r["attempts"]) for r in rows} == {("pending", 1)}
    assert all("refused" in r["last_error"].lower() for r in rows)
    base = mail_settings.email_backoff_base
    assert all(base / 2 <= (r["next_attempt_at"] - T0).total_seconds() <= base for r in rows)
    assert run_outbox_workers(db, mail_settings, 4, now=T0) == Counter()  # retries not due yet

    sink = Sink()
    start_smtp(sink)
    due = T0 + dt.timedelta(seconds=base)
    assert run_outbox_workers(db, mail_settings, 4, now=due) == Counter(sent=6)
    rows = outbox_rows(db)
    assert {(r["status"], r["attempts"]) for r in rows} == {("sent", 2)}
    assert sink.ids() == Counter({r["message_id"]: 1 for r in rows})  # each message exactly once
    invite = next(m for m in sink.messages if m["To"] == "new.member@example.test")
    assert inv.token in invite.get_payload() and invite["From"] == "magpie@alerts.example.test"
    assert run_outbox_workers(db, mail_settings, 4, now=due + dt.timedelta(hours=1)) == Counter()
    assert outbox_counts(db) == {"pending": 0, "processing": 0, "sent": 6, "failed": 0}


def test_invitation_stays_valid_when_its_email_cannot_be_sent(db, mail_settings, workspace):
    s = mail_settings.model_copy(update={"email_max_attempts": 2})
    inv = create_invitation(db, s, workspace, "someone@example.test", now=T0, ttl_seconds=86400)
    assert run_outbox_workers(db, s, 1, now=T0) == Counter(retry=1)
    assert run_outbox_workers(db, s, 1, now=T0 + dt.timedelta(hours=1)) == Counter(failed=1)
    [row] = outbox_rows(db)
    assert (row["status"], row["attempts"], row["kind"]) == ("failed", 2, "invitation")
    found = find_valid_invitation(db, inv.token, now=T0 + dt.timedelta(hours=2))
    assert found is not None and found["id"] == inv.id and found["email"] == "someone@example.test"
    assert find_valid_invitation(db, inv.token, now=T0 + dt.timedelta(days=2)) is None  # expired
    assert find_valid_invitation(db, "not-the-token", now=T0) is None
    with db.connect() as c:
        stored = c.execute(sa.text("SELECT token_hash FROM invitations")).scalar_one()
    assert inv.token not in stored


def test_invitation_and_its_email_commit_together(db, mail_settings, workspace, monkeypatch):
    import magpie.outbox.invitations as invitations

    with pytest.raises(ValueError):
        create_invitation(db, mail_settings, workspace, "not an address", now=T0)
    with pytest.raises(LookupError):
        create_invitation(db, mail_settings, "no-such-workspace", "a@example.test", now=T0)

    def broken(*a, **kw):
        raise RuntimeError("outbox insert failed")

    monkeypatch.setattr(invitations, "enqueue", broken)
    with pytest.raises(RuntimeError):
        create_invitation(db, mail_settings, workspace, "a@example.test", now=T0)
    with db.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM invitations")).scalar_one() == 0
    assert outbox_rows(db) == []


def test_permanent_refusal_fails_at_once(db, mail_settings, start_smtp):
    sink = Sink()
    start_smtp(sink)
    enqueue_email(db, mail_settings, "bounce@example.test", "nope", "body", now=T0)
    enqueue_email(db, mail_settings, "fine@example.test", "yes", "body", now=T0)
    assert run_outbox_workers(db, mail_settings, 2, now=T0) == Counter(failed=1, sent=1)
    bounced = next(r for r in outbox_rows(db) if r["recipient"] == "bounce@example.test")
    assert bounced["attempts"] == 1 and "550" in bounced["last_error"]
    assert [m["To"] for m in sink.messages] == ["fine@example.test"]


def test_housekeeping_returns_expired_claims_respecting_max_attempts(db, mail_settings, redis_client):
    s = mail_settings
    a = enqueue_email(db, s, "a@example.test", "a", "body", now=T0)
    with db.begin() as c:
        b = c.execute(sa.text("INSERT INTO email_outbox (recipient, subject, body, kind, message_id, max_attempts, "
                              "next_attempt_at) VALUES ('b@example.test', 'b', 'body', 'test', '<b@x>', 1, :t) "
                              "RETURNING id"), {"t": T0}).scalar_one()
        got = claim_rows.claim(c, "email_outbox", limit=5, claim_seconds=s.email_claim_seconds, now=T0)
    assert {x.id for x in got} == {a, b}  # two workers claimed and then died
    token_a = next(x.token for x in got if x.id == a)

    assert housekeeping(db, s, now=T0 + dt.timedelta(seconds=60)) == HousekeepingReport(0, 0)  # claims still live
    expired = T0 + dt.timedelta(seconds=s.email_claim_seconds + 1)
    rep = housekeeping(db, s, now=expired)
    assert (rep.returned, rep.failed) == (1, 0 + 1)
    by_id = {r["id"]: r for r in outbox_rows(db)}
    assert (by_id[a]["status"], by_id[a]["claim_token"]) == ("pending", None)
    assert by_id[b]["status"] == "failed" and "final attempt" in by_id[b]["last_error"]
    with db.begin() as c:  # the dead worker wakes up: its token is no longer current
        assert claim_rows.record(c, "email_outbox", a, token_a, ok=True, now=expired) is None

    sink_sent = run_outbox_workers(db, s, 1, now=expired, sender=lambda msg, settings: None)
    assert sink_sent == Counter(sent=1)  # returned row is sent by a live worker (attempt 2)
    assert {r["id"]: (r["status"], r["attempts"]) for r in outbox_rows(db)}[a] == ("sent", 2)

    # retention: housekeeping deletes nothing; the outbox_cleanup maintenance job deletes terminal rows
    # older than MAGPIE_OUTBOX_RETENTION_SECONDS and keeps newer ones
    from magpie.wiring.jobs import run_job

    old = expired - dt.timedelta(seconds=s.outbox_retention_seconds + 60)
    with db.begin() as c:
        c.execute(sa.text("UPDATE email_outbox SET sent_at = :t WHERE id = :id"), {"t": old, "id": a})
        c.execute(sa.text("UPDATE email_outbox SET updated_at = :t WHERE id = :id"), {"t": old, "id": b})
    enqueue_email(db, s, "c@example.test", "c", "body", now=expired)
    run_outbox_workers(db, s, 1, now=expired, sender=lambda msg, settings: None)
    assert run_housekeeping(redis_client, db, s, now=expired) == HousekeepingReport(0, 0)
    assert len(outbox_rows(db)) == 3
    res = run_job("outbox_cleanup", s, engine=db, redis=redis_client, now=expired)
    assert res["result"]["deleted"] == 2, res
    assert [r["recipient"] for r in outbox_rows(db)] == ["c@example.test"]


def test_housekeeping_is_leader_coordinated(db, mail_settings, redis_client):
    from magpie.coordination.leader import LeaderLock

    other = LeaderLock(redis_client, mail_settings.redis_prefix, "outbox-housekeeping", 5000)
    assert other.acquire()
    try:
        assert run_housekeeping(redis_client, db, mail_settings, now=T0) is None
    finally:
        other.release()
    assert run_housekeeping(redis_client, db, mail_settings, now=T0) is not None


def test_an_unexpected_sender_failure_is_retried_with_its_text(db, mail_settings):
    enqueue_email(db, mail_settings, "a@example.test", "s", "b", now=T0)

    def broken(msg, settings):
        raise KeyError("surprise")

    assert run_outbox_workers(db, mail_settings, 1, now=T0, sender=broken) == Counter(retry=1)
    [row] = outbox_rows(db)
    assert (row["status"], row["attempts"], row["last_error"]) == ("pending", 1, "KeyError: 'surprise'")


def test_outbox_lists_newest_first_by_status_and_kind(db, mail_settings):
    first = enqueue_email(db, mail_settings, "a@example.test", "s", "b", kind="alert", now=T0)
    second = enqueue_email(db, mail_settings, "b@example.test", "s", "b", kind="notice", now=T0)
    assert [r["id"] for r in list_outbox(db)] == [second, first]
    assert [r["id"] for r in list_outbox(db, kind="alert")] == [first]
    assert list_outbox(db, status="sent") == [] and len(list_outbox(db, status="pending", limit=1)) == 1
    with pytest.raises(ValueError):
        list_outbox(db, status="bogus")
    with pytest.raises(TypeError):
        OUTBOX.list_rows(db, recipient="a@example.test")  # only declared filters


def test_outbox_rejects_header_injection(db, mail_settings):
    with pytest.raises(ValueError):
        enqueue_email(db, mail_settings, "a@example.test\r\nBcc: x@example.test", "s", "b")
    with pytest.raises(ValueError):
        enqueue_email(db, mail_settings, "a@example.test", "s\r\nBcc: x@example.test", "b")
    assert enqueue_email(db, mail_settings, "a@example.test", "s", "b", dedupe_key="k") is not None
    assert enqueue_email(db, mail_settings, "a@example.test", "s", "b", dedupe_key="k") is None
    assert len(list_outbox(db)) == 1


# ------------------------------------------------------------------------------------------ TLS and auth


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


# implicit TLS: aiosmtpd cannot tell that AUTH is already encrypted, and warns about it
@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
@pytest.mark.parametrize("mode", ["starttls", "tls"])
def test_tls_modes_with_credentials(db, mail_settings, start_smtp, tmp_path, mode):
    import ssl

    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    logins = []

    def authenticator(server, session, envelope, mechanism, auth_data):
        logins.append((auth_data.login, auth_data.password))
        return AuthResult(success=(auth_data.login, auth_data.password) == (b"magpie", b"s3cret"))

    sink = Sink()
    if mode == "starttls":
        tls_kw = {"tls_context": server_ctx, "require_starttls": True}
    else:
        tls_kw = {"ssl_context": server_ctx}
    start_smtp(sink, authenticator=authenticator, auth_required=True, auth_require_tls=(mode == "starttls"), **tls_kw)
    # smtplib falls back from AUTH PLAIN to LOGIN after a refusal, and aiosmtpd then waits for more input:
    # a short session timeout keeps the failing attempt quick
    s = mail_settings.model_copy(update={"smtp_tls": mode, "smtp_ca_file": cert, "smtp_user": "magpie",
                                         "smtp_password": "wrong", "smtp_timeout": 1.0})
    enqueue_email(db, s, "ops@example.test", "tls", "body", now=T0)
    assert run_outbox_workers(db, s, 1, now=T0) == Counter(retry=1)  # bad password: retried, not dropped
    s = s.model_copy(update={"smtp_password": "s3cret"})
    assert run_outbox_workers(db, s, 1, now=T0 + dt.timedelta(hours=1)) == Counter(sent=1)
    assert len(sink.messages) == 1 and logins[-1] == (b"magpie", b"s3cret")

    untrusted = s.model_copy(update={"smtp_ca_file": None})  # the system store does not know this cert
    enqueue_email(db, untrusted, "ops@example.test", "tls 2", "body", now=T0)
    assert run_outbox_workers(db, untrusted, 1, now=T0 + dt.timedelta(hours=1)) == Counter(retry=1)
    assert "certificate" in outbox_rows(db)[-1]["last_error"].lower()
