"""The SMTP gateway against real aiosmtpd servers, and the text of every notice."""

from __future__ import annotations

import email.message
import email.utils
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import SMTPServer, _CollectingHandler, free_port

from gpuresa.config.reporting_sections import NotifyConfig
from gpuresa.config.sections import UsersConfig
from gpuresa.mail.notices import (
    banner_text,
    cancel_message,
    end_message,
    failure_message,
    rejection_message,
    start_message,
    wall_text,
    warning_message,
)
from gpuresa.mail.smtp import SUBJECT_LIMIT, Notifier, NotifyError, valid_address
from gpuresa.mail.wording import format_remaining, format_time, one_line
from gpuresa.model import Rejection, Session

PARIS = "Europe/Paris"
# 16:00 UTC on a summer Friday: 18:00 CEST in Paris
END = datetime(2024, 5, 3, 16, 0, tzinfo=UTC)
START = END - timedelta(hours=4)
SESSION = Session(
    key="booking-42@20240503T120000Z",
    user="alice",
    host="gpu1",
    template="pytorch",
    cuda="12.4",
    gpu_count=2,
    gpu_indices=(0, 1),
    start=START,
    end=END,
    ssh_port=20001,
    ftp_port=21001,
    ftp_passive_first=30000,
    ftp_passive_last=30009,
    state="running",
    output_dir=Path("/var/lib/gpuresa/output/alice/20240503-1400-booking-42"),
    ftp_user="alice-ftp",
    ftp_password="s3cret-Pa55",
    email="alice@example.org",
)
REJECTION = Rejection(
    key="booking-43",
    uid="booking-43",
    calendar="gpu1",
    reason="unknown template 'tensorflw' (allowed: tensorflow, digits, pytorch)",
    user="bob",
    email="bob@example.org",
    start=START,
    end=END,
)


def notifier_for(server: SMTPServer, **settings: Any) -> Notifier:
    config = NotifyConfig(
        enabled=True,
        smtp_host=server.host,
        smtp_port=server.port,
        sender="gpuresa@example.org",
        admin="gpu-admins@example.org",
        timeout=timedelta(seconds=5),
    )
    return Notifier(replace(config, **settings), UsersConfig(email_domain="example.org"))


# --- every kind of notice, through a real server ------------------------------------------

MessageBuilder = Callable[[], tuple[str, str]]

KINDS: list[tuple[str, MessageBuilder, list[str], list[str]]] = [
    (
        "start",
        lambda: start_message(SESSION, "gpu1.example.org", PARIS),
        ["ready", "gpu1", "18:00 CEST"],
        [
            "FTP host:      gpu1.example.org",
            "FTP port:      21001",
            "FTP login:     alice-ftp",
            "FTP password:  s3cret-Pa55",
            "Friday 2024-05-03 18:00 CEST (UTC+02:00)",
            "/output",
            "Passive ports: 30000-30009",
        ],
    ),
    (
        "warning",
        lambda: warning_message(SESSION, timedelta(minutes=15), PARIS),
        ["ends in 15 minutes"],
        ["Friday 2024-05-03 18:00 CEST (UTC+02:00)", "/output"],
    ),
    (
        "end",
        lambda: end_message(SESSION, SESSION.output_dir, PARIS),
        ["has ended"],
        [str(SESSION.output_dir), "18:00 CEST (UTC+02:00)"],
    ),
    (
        "rejection",
        lambda: rejection_message(REJECTION, PARIS),
        ["rejected", "Friday 2024-05-03 14:00 CEST"],
        ["Reason:    unknown template 'tensorflw'", "Hello bob,", "booking-43"],
    ),
    (
        "cancel",
        lambda: cancel_message(SESSION, START + timedelta(hours=1, minutes=5), PARIS),
        ["Cancelled", "15:05 CEST"],
        [
            "Friday 2024-05-03 15:05 CEST (UTC+02:00)",
            "instead of Friday 2024-05-03 18:00",
            "/output",
        ],
    ),
    (
        "failure",
        lambda: failure_message(SESSION.key, "alice", "image gpuresa/pytorch missing", host="gpu1"),
        ["could not be started", "gpu1"],
        ["image gpuresa/pytorch missing", "The administrators received a copy"],
    ),
]


@pytest.mark.parametrize(
    ("kind", "build", "in_subject", "in_body"), KINDS, ids=[kind[0] for kind in KINDS]
)
def test_each_notice_arrives_with_its_subject_recipient_and_body(
    smtp_server: SMTPServer,
    kind: str,
    build: MessageBuilder,
    in_subject: list[str],
    in_body: list[str],
) -> None:
    notifier = notifier_for(smtp_server)
    subject, body = build()
    notifier.send("alice@example.org", subject, body, key=SESSION.key)
    [message] = smtp_server.wait_for(1)
    assert message["To"] == "alice@example.org"
    assert message["From"] == "gpuresa@example.org"
    for fragment in in_subject:
        assert fragment in message["Subject"]
    assert message["Subject"].startswith("[gpuresa] ")
    text = message.get_content()
    for fragment in in_body:
        assert fragment in text
    assert message["Date"] is not None
    assert message["Message-ID"].endswith("@example.org>")
    assert message["Cc"] is None
    assert smtp_server.envelopes == [("gpuresa@example.org", ["alice@example.org"])]


def test_start_notice_holds_the_exact_ssh_line(smtp_server: SMTPServer) -> None:
    subject, body = start_message(SESSION, "gpu1.example.org", PARIS)
    notifier_for(smtp_server).send("alice@example.org", subject, body)
    [message] = smtp_server.wait_for(1)
    assert "ssh -p 20001 alice@gpu1.example.org" in message.get_content().splitlines()


def test_failure_notice_copies_the_admin(smtp_server: SMTPServer) -> None:
    subject, body = failure_message("k1", "alice", "no GPU free")
    notifier_for(smtp_server).send("alice@example.org", subject, body, copy_admin=True)
    [message] = smtp_server.wait_for(1)
    assert message["Cc"] == "gpu-admins@example.org"
    assert smtp_server.envelopes[0][1] == ["alice@example.org", "gpu-admins@example.org"]


def test_untrusted_unicode_text_arrives_intact(smtp_server: SMTPServer) -> None:
    # the reason quotes what a person typed in the booking form
    typed = "modèle «pytörch» — 日本語 🚀"
    rejection = replace(REJECTION, reason=f"unknown template {typed!r}")
    subject, body = rejection_message(rejection, PARIS)
    notifier_for(smtp_server).send("bob@example.org", f"{subject} {typed}", body)
    [message] = smtp_server.wait_for(1)
    assert typed in message.get_content()
    assert message["Subject"] == f"{subject} {typed}"


@pytest.mark.parametrize(
    "subject",
    [
        "[gpuresa] " + "a long subject in plain ASCII that must fold between words " * 2,
        "[gpuresa] réservation " + "日本語 «pytörch» — 🚀 " * 12,
    ],
)
def test_long_subjects_fold_and_read_back_exactly(smtp_server: SMTPServer, subject: str) -> None:
    notifier = notifier_for(smtp_server)
    expected = one_line(subject, SUBJECT_LIMIT)
    raw = notifier.compose("alice@example.org", subject, "body").as_bytes()
    assert max(len(line) for line in raw.splitlines()) <= 78
    notifier.send("alice@example.org", subject, "body")
    [message] = smtp_server.wait_for(1)
    assert message["Subject"] == expected


def test_newlines_in_untrusted_text_add_no_header(smtp_server: SMTPServer) -> None:
    injected = "Hello\r\nBcc: evil@example.net\r\nX-Injected: yes\n\nfake body"
    notifier = notifier_for(smtp_server)
    notifier.send("alice@example.org", injected, "body")
    # the key of a booking is its UID, typed by anyone who can write the calendar
    rejection = replace(
        REJECTION, key="k\r\nX-Injected: yes", reason="bad\r\nBcc: evil@example.net"
    )
    notifier.send("bob@example.org", *rejection_message(rejection, PARIS), key=rejection.key)
    messages = smtp_server.wait_for(2)
    for message in messages:
        assert message["X-Injected"] is None
        assert message["Bcc"] is None
        assert "\n" not in message["Subject"]
    assert messages[0]["Subject"] == "Hello Bcc: evil@example.net X-Injected: yes fake body"
    assert [recipients for _, recipients in smtp_server.envelopes] == [
        ["alice@example.org"],
        ["bob@example.org"],
    ]


@pytest.mark.parametrize(
    "address",
    [
        "alice@example.org\r\nBcc: evil@example.net",
        "alice@example.org, evil@example.net",
        "Alice <alice@example.org>",
        "alice",
        "élise@example.org",
        "",
    ],
)
def test_an_invalid_recipient_is_refused_before_any_connection(address: str) -> None:
    # a closed port: a connection attempt would fail with another message
    notifier = Notifier(NotifyConfig(enabled=True, smtp_port=free_port()), UsersConfig())
    with pytest.raises(NotifyError, match="not a valid e-mail address"):
        notifier.send(address, "subject", "body")


def test_a_disabled_notifier_sends_nothing(smtp_server: SMTPServer) -> None:
    notifier_for(smtp_server, enabled=False).send("alice@example.org", "disabled", "body")
    notifier_for(smtp_server).send("alice@example.org", "enabled", "body")
    # each send returns once the server has the message (none for the disabled one)
    messages = smtp_server.wait_for(1)
    assert [message["Subject"] for message in smtp_server.messages] == ["enabled"]
    assert len(messages) == 1


def test_an_unreachable_server_fails_quickly() -> None:
    notifier = Notifier(
        NotifyConfig(enabled=True, smtp_host="127.0.0.1", smtp_port=free_port()), UsersConfig()
    )
    started = time.monotonic()
    with pytest.raises(NotifyError, match=r"cannot reach SMTP server 127\.0\.0\.1") as caught:
        notifier.send("alice@example.org", "subject", "body")
    assert time.monotonic() - started < 5
    assert "\n" not in str(caught.value)


# --- addresses --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("emails", "domain", "event_email", "expected"),
    [
        # the [users] map wins over the booking's own address
        (
            {"alice": "a.martin@lab.example"},
            "example.org",
            "alice@elsewhere.example",
            "a.martin@lab.example",
        ),
        # then login@email_domain, even when the booking gives its own address:
        # whoever books as alice must not receive alice's credentials
        ({}, "example.org", "mallory@elsewhere.example", "alice@example.org"),
        ({}, "example.org", None, "alice@example.org"),
        # a bad configured address falls back to the domain
        ({"alice": "not an address"}, "example.org", "mallory@x.example", "alice@example.org"),
        # ... and without a domain to nothing, never to the booking's address
        ({"alice": "not an address"}, None, "mallory@x.example", None),
        # the booking's address only when nothing is configured for the login
        ({"bob": "bob@lab.example"}, None, "alice@elsewhere.example", "alice@elsewhere.example"),
        # a booking address that could inject headers is skipped
        ({}, None, "alice@x.example\nBcc: evil@example.net", None),
        # nothing known
        ({}, None, None, None),
    ],
)
def test_address_for_prefers_the_map_then_the_domain_then_the_booking(
    emails: dict[str, str], domain: str | None, event_email: str | None, expected: str | None
) -> None:
    notifier = Notifier(NotifyConfig(), UsersConfig(emails=emails, email_domain=domain))
    assert notifier.address_for("alice", event_email) == expected


def test_valid_address_strips_blanks_and_rejects_lists() -> None:
    assert valid_address("  alice@example.org \n") == "alice@example.org"
    assert valid_address("a@b.example;c@d.example") is None
    assert valid_address(None) is None


# --- TLS and login against a real server -------------------------------------------------------


@dataclass
class Certificate:
    certificate: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certificate, self.key)
        return context


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    """A self-signed certificate for 127.0.0.1 and localhost."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuresa test SMTP")])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory = tmp_path_factory.mktemp("tls")
    certificate_file = directory / "certificate.pem"
    key_file = directory / "key.pem"
    certificate_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Certificate(certificate_file, key_file)


class _Authenticator:
    """Accepts one login and password, as a real relay would."""

    def __init__(self, login: str, password: str) -> None:
        self.login = login.encode()
        self.password = password.encode()

    def __call__(
        self, server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any
    ) -> Any:
        from aiosmtpd.smtp import AuthResult, LoginPassword

        accepted = (
            isinstance(auth_data, LoginPassword)
            and auth_data.login == self.login
            and auth_data.password == self.password
        )
        # handled=False: aiosmtpd itself answers 235 or 535
        return AuthResult(success=accepted, handled=False)


def secure_server(certificate: Certificate, *, implicit_tls: bool) -> Iterator[SMTPServer]:
    """A real aiosmtpd with TLS (STARTTLS required, or TLS from the first byte) and login."""
    from aiosmtpd.controller import Controller

    server = SMTPServer(host="127.0.0.1", port=free_port())
    context = certificate.server_context()
    options: dict[str, Any] = (
        {"ssl_context": context}
        if implicit_tls
        else {"tls_context": context, "require_starttls": True}
    )
    controller = Controller(
        _CollectingHandler(server),
        hostname=server.host,
        port=server.port,
        authenticator=_Authenticator("gpuresa", "relay-password"),
        auth_required=True,
        # aiosmtpd only knows of STARTTLS; with implicit TLS every byte is encrypted
        auth_require_tls=not implicit_tls,
        **options,
    )
    controller.start()
    try:
        yield server
    finally:
        controller.stop()


@pytest.fixture
def starttls_server(certificate: Certificate) -> Iterator[SMTPServer]:
    yield from secure_server(certificate, implicit_tls=False)


@pytest.fixture
def tls_server(certificate: Certificate) -> Iterator[SMTPServer]:
    yield from secure_server(certificate, implicit_tls=True)


def test_starttls_and_login_with_a_password_file(
    starttls_server: SMTPServer, certificate: Certificate, tmp_path: Path
) -> None:
    password_file = tmp_path / "smtp-password"
    password_file.write_text("relay-password\n")
    notifier = notifier_for(
        starttls_server,
        security="starttls",
        ca_file=certificate.certificate,
        username="gpuresa",
        password_file=password_file,
    )
    notifier.send("alice@example.org", *warning_message(SESSION, timedelta(minutes=5), PARIS))
    [message] = starttls_server.wait_for(1)
    assert "ends in 5 minutes" in message["Subject"]


@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
def test_implicit_tls_and_login_with_a_systemd_credential(
    tls_server: SMTPServer,
    certificate: Certificate,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "smtp-password").write_text("relay-password")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    notifier = notifier_for(
        tls_server,
        security="tls",
        ca_file=certificate.certificate,
        username="gpuresa",
        password_credential="smtp-password",
    )
    notifier.send("alice@example.org", "over TLS", "body")
    [message] = tls_server.wait_for(1)
    assert message["Subject"] == "over TLS"


def test_a_refused_login_raises(
    starttls_server: SMTPServer, certificate: Certificate, tmp_path: Path
) -> None:
    password_file = tmp_path / "smtp-password"
    password_file.write_text("wrong")
    notifier = notifier_for(
        starttls_server,
        security="starttls",
        ca_file=certificate.certificate,
        username="gpuresa",
        password_file=password_file,
    )
    with pytest.raises(NotifyError, match="refused the login of 'gpuresa': 535") as caught:
        notifier.send("alice@example.org", "subject", "body")
    assert "\n" not in str(caught.value)
    assert starttls_server.messages == []


def test_an_untrusted_certificate_is_refused(starttls_server: SMTPServer) -> None:
    # no ca_file: the system's CAs do not know the self-signed certificate
    notifier = notifier_for(starttls_server, security="starttls")
    with pytest.raises(NotifyError, match=r"TLS with SMTP server .* failed"):
        notifier.send("alice@example.org", "subject", "body")


def test_starttls_required_but_not_offered(smtp_server: SMTPServer) -> None:
    notifier = notifier_for(smtp_server, security="starttls")
    with pytest.raises(NotifyError, match="does not offer STARTTLS"):
        notifier.send("alice@example.org", "subject", "body")


def test_a_login_without_a_password_setting_raises(smtp_server: SMTPServer) -> None:
    notifier = notifier_for(smtp_server, username="gpuresa")
    with pytest.raises(NotifyError, match=r"neither notify\.password_file nor"):
        notifier.send("alice@example.org", "subject", "body")


def test_a_missing_credentials_directory_raises(smtp_server: SMTPServer) -> None:
    notifier = notifier_for(smtp_server, username="gpuresa", password_credential="smtp-password")
    with pytest.raises(NotifyError, match="CREDENTIALS_DIRECTORY is not set"):
        notifier.send("alice@example.org", "subject", "body")


# --- text inside the session and in words -------------------------------------------------------


def test_banner_names_the_end_and_hides_terminal_escapes() -> None:
    session = replace(SESSION, key="evil\x1b]0;owned\x07\x1b[2J\nsecond line")
    banner = banner_text(session, PARIS)
    assert "Friday 2024-05-03 18:00 CEST (UTC+02:00)" in banner
    assert "/output" in banner
    assert "\x1b" not in banner and "\x07" not in banner
    # escapes shown as text, the line break as a space
    assert "Reservation: evil\\x1b]0;owned\\x07\\x1b[2J second line" in banner


def test_wall_text_says_how_long_and_until_when() -> None:
    text = wall_text(timedelta(minutes=5), END, "America/New_York")
    assert "ends in 5 minutes, at 12:00 EDT (UTC-04:00)" in text
    assert "/output" in text


def test_end_time_is_shown_in_the_site_zone_across_dst() -> None:
    # the last Sunday of October: Paris goes back to UTC+01:00
    winter = datetime(2024, 10, 27, 12, 0, tzinfo=UTC)
    assert format_time(winter, PARIS) == "Sunday 2024-10-27 13:00 CET (UTC+01:00)"
    assert format_time(winter, "Asia/Kolkata").endswith("(UTC+05:30)")


@pytest.mark.parametrize(
    ("remaining", "words"),
    [
        (timedelta(minutes=15), "15 minutes"),
        (timedelta(minutes=1), "1 minute"),
        (timedelta(seconds=30), "30 seconds"),
        (timedelta(hours=1, minutes=5), "1 hour 5 minutes"),
        (timedelta(days=2, hours=3), "2 days 3 hours"),
        (timedelta(minutes=14, seconds=59), "15 minutes"),
        (timedelta(seconds=-3), "0 seconds"),
    ],
)
def test_format_remaining(remaining: timedelta, words: str) -> None:
    assert format_remaining(remaining) == words


def test_one_line_folds_and_cuts() -> None:
    assert one_line("a\r\n\tb\u2028c  d") == "a b c d"
    assert one_line("x" * 50, 10) == "x" * 9 + "…"


def test_compose_sets_every_header() -> None:
    notifier = Notifier(NotifyConfig(sender="GPU service <gpuresa@lab.example>"), UsersConfig())
    message = notifier.compose("alice@example.org", "Subject", "body", copy=["admin@lab.example"])
    assert isinstance(message, email.message.EmailMessage)
    for header in ("Date", "Message-ID", "From", "To", "Cc", "Subject"):
        assert message[header], header
    assert message["Message-ID"].endswith("@lab.example>")
    assert message.get_content_type() == "text/plain"
    assert message.get_content_charset() == "utf-8"
    sent = email.utils.parsedate_to_datetime(message["Date"])
    assert abs(sent - datetime.now(UTC)) < timedelta(minutes=1)


def test_a_rejection_without_dates_or_user_still_reads_well() -> None:
    rejection = Rejection(key="k", uid="k", calendar="gpu1", reason="no user in the summary")
    subject, body = rejection_message(rejection, PARIS)
    assert subject == "[gpuresa] Booking rejected"
    assert body.startswith("Hello,\n")
    assert "From:" not in body


def test_a_server_that_never_answers_times_out() -> None:
    # a listening socket that never accepts: the TCP handshake succeeds, no greeting comes
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        notifier = Notifier(
            NotifyConfig(
                enabled=True,
                smtp_host="127.0.0.1",
                smtp_port=silent.getsockname()[1],
                timeout=timedelta(seconds=1),
            ),
            UsersConfig(),
        )
        started = time.monotonic()
        with pytest.raises(NotifyError, match="did not answer within 1s") as caught:
            notifier.send("alice@example.org", "subject", "body")
        assert time.monotonic() - started < 5
        assert "\n" not in str(caught.value)
