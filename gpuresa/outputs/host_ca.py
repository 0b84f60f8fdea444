"""The host's SSH certificate authorities and the host keys they certify.

No two sessions of a host, and not its output service, share a host key: a
session's root can read its own sshd's private key, so a shared key would let
any user pose as every other session. Instead:

- one CA key per port (Ed25519): each port of the host's `ssh_ports` and the
  output service's `sftp_port` has its own, made once into
  `<state_dir>/host-ca/` (root's, 0700/0600) and never mounted anywhere; users
  trust each with one `@cert-authority [name]:PORT` line in known_hosts, so a
  certificate is worth something on its own port only;
- each session gets a fresh Ed25519 host key when it is prepared, in its own
  host-side folder (owned by the session's root on the host, mounted read-only
  in that session only), with a host certificate of its port's CA valid from
  shortly before the session's start to its end plus `daemon.stop_grace`.
  When the booking is extended the certificate is signed again by the same CA
  and replaced in place: the session's sshd re-executes itself for every
  connection and reads the certificate file then, so new logins see the new
  end with no restart;
- the output service has its own key and a certificate of `SERVICE_VALIDITY`
  from the sftp port's CA, signed again whenever the daemon checks the service
  and less than `SERVICE_RENEW` is left.

Why a CA per port: a session's root holds its host key and certificate, and
OpenSSH matches a certificate's principals against the host name alone, never
the port. Under one CA trusted on every port, that key served by any host
user's sshd on an unprivileged port would be taken for the host. The port can
only be bound in the known_hosts pattern, and a pattern trusts a CA wholly:
one CA per port is the only way to keep each certificate on its port. The
lines are many (one per port) but are pasted once, work with plain
`ssh -p PORT host` and with every tool that reads known_hosts (sftp, scp,
rsync, VS Code, git); a `HostKeyAlias` per port would have needed an
ssh_config block per port and a different host name for every session, which
tools outside OpenSSH's own ignore.

Upgrade from the single CA of earlier versions (`ca_ed25519`, trusted as
`[name]:*`): sessions it certified keep their certificate, and renewals of
theirs are signed by it, until their end, so their users are not locked out
midway; while one of its certificates is valid, `known_hosts_text` adds its
line, restricted to the session ports. New sessions and the output service
are certified by the per-port CAs only.

A key or certificate taken from an ended session is refused by OpenSSH once
its validity is over, a key without a certificate is refused by the
`@cert-authority` lines, and a certificate served on any other port is
refused because no line of that port names its CA. The principals are the
names users connect with: `public_name` (else the host's name), the host's
name, its `aliases` and its `bind_address` unless that is a wildcard.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from gpuresa.config.sections import Config
from gpuresa.safe_files import create_once, private_folder, replace_file

log = logging.getLogger(__name__)

CA_FOLDER = "host-ca"
# one CA per port ("*": the port)
PORT_CA_KEYS = "port-*_ed25519"
# the single CA of earlier versions, trusted on every port: never made any more (see above)
LEGACY_CA_KEY = "ca_ed25519"
# where sessions' host keys are (sessions.files)
SESSION_CERTIFICATES = "sessions/*/host-keys"
SERVICE_FOLDER = "output-service-keys"
HOST_KEY = "ssh_host_ed25519_key"
CERTIFICATE = f"{HOST_KEY}-cert.pub"
PUBLIC = f"{HOST_KEY}.pub"
# a client's clock may be a little ahead or behind: certificates start this much early
CLOCK_SKEW = dt.timedelta(minutes=5)
SERVICE_VALIDITY = dt.timedelta(days=30)
SERVICE_RENEW = dt.timedelta(days=10)
# the shared host keys of earlier versions: removed, never trusted again
LEGACY_FOLDER = "host-keys"


def _private_bytes(key: ed25519.Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )


def _public_line(key: ed25519.Ed25519PublicKey) -> str:
    return key.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()


def certificate_validity(certificate: bytes) -> tuple[dt.datetime, dt.datetime]:
    """The (valid after, valid before) instants of an OpenSSH certificate, in UTC."""
    loaded = _certificate(certificate)
    return (
        dt.datetime.fromtimestamp(loaded.valid_after, dt.UTC),
        dt.datetime.fromtimestamp(loaded.valid_before, dt.UTC),
    )


class HostCA:
    """This host's SSH CAs, one per port (see the module docstring); given the config."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.folder = config.daemon.state_dir / CA_FOLDER

    def principals(self) -> list[str]:
        """The names certificates are valid for: public name, host name, aliases, bind address."""
        host = self.config.host()
        names = [host.public_name or host.name, host.name, *host.aliases]
        if host.bind_address not in ("0.0.0.0", "::", ""):
            names.append(host.bind_address)  # what `gpuresa session start` tells users
        return list(dict.fromkeys(name for name in names if name))

    def ports(self) -> list[int]:
        """The ports that have a CA of their own: the session ports, then the sftp port."""
        ports = list(self.config.host().ssh_ports)
        if self.config.storage.sftp_port:
            ports.append(self.config.storage.sftp_port)
        return list(dict.fromkeys(ports))

    def _key(self, port: int) -> ed25519.Ed25519PrivateKey:
        """Port `port`'s CA private key, made once (the first of several makers wins)."""
        private_folder(self.folder)
        path = self.folder / PORT_CA_KEYS.replace("*", str(port))
        if not path.is_file():
            log.info("making the SSH host certificate authority of port %d in %s", port, path)
            create_once(path, _private_bytes(ed25519.Ed25519PrivateKey.generate()))
        return _load_key(path)

    def _legacy_key(self) -> ed25519.Ed25519PrivateKey | None:
        """The single CA of earlier versions, or None where there never was one."""
        path = self.folder / LEGACY_CA_KEY
        if path.is_symlink() or not path.is_file():
            return None
        return _load_key(path)

    def public_line(self, port: int) -> str:
        """Port `port`'s CA public key as OpenSSH writes it: "ssh-ed25519 AAAA..."."""
        return _public_line(self._key(port).public_key())

    def known_hosts_line(self, port: int) -> str:
        """The known_hosts line that trusts the session (or service) on `port`, there alone."""
        return self._line((port,), self.public_line(port))

    def _line(self, ports: tuple[int, ...], public: str) -> str:
        patterns = ",".join(f"[{name}]:{port}" for port in ports for name in self.principals())
        return f"@cert-authority {patterns} {public}"

    def known_hosts_text(self, now: dt.datetime | None = None) -> str:
        """What users add to known_hosts once: a line per port, ending in a newline.

        While a session certified by the single CA of earlier versions may
        still run, a comment and that CA's line (for the session ports only)
        follow.
        """
        lines = [self.known_hosts_line(port) for port in self.ports()]
        legacy = self._legacy_key()
        until = self.legacy_until(now or dt.datetime.now(dt.UTC))
        if legacy is not None and until is not None:
            session_ports = tuple(self.config.host().ssh_ports)
            lines.append(
                f"# for sessions started before an upgrade, until {until:%Y-%m-%d %H:%M} UTC"
            )
            lines.append(self._line(session_ports, _public_line(legacy.public_key())))
        return "\n".join(lines) + "\n"

    def legacy_until(self, now: dt.datetime) -> dt.datetime | None:
        """The end of the last session certificate of the old single CA still valid at `now`."""
        legacy = self._legacy_key()
        if legacy is None:
            return None
        signer = _public_line(legacy.public_key())
        ends = []
        for path in self.config.daemon.state_dir.glob(f"{SESSION_CERTIFICATES}/{CERTIFICATE}"):
            try:
                loaded = _certificate(path.read_bytes())
            except (OSError, ValueError):
                continue  # not a certificate (any more): it certifies nothing
            end = dt.datetime.fromtimestamp(loaded.valid_before, dt.UTC)
            if _signer(loaded) == signer and end > now:
                ends.append(end)
        return max(ends, default=None)

    def sign(
        self,
        public_key: ed25519.Ed25519PublicKey,
        key_id: str,
        valid_after: dt.datetime,
        valid_before: dt.datetime,
        authority: ed25519.Ed25519PrivateKey,
    ) -> bytes:
        """A host certificate for `public_key` over that window by `authority`, one line of text."""
        builder = (
            serialization.SSHCertificateBuilder()
            .public_key(public_key)
            .serial(secrets.randbits(64))
            .type(serialization.SSHCertificateType.HOST)
            .key_id(re.sub(r"[^A-Za-z0-9@._:+-]", "_", key_id).encode())
            .valid_principals([name.encode() for name in self.principals()])
            .valid_after(int(valid_after.timestamp()))
            .valid_before(int(valid_before.timestamp()))
        )
        return builder.sign(authority).public_bytes() + b"\n"

    # --- sessions ---------------------------------------------------------------------------

    def session_window(
        self, start: dt.datetime, end: dt.datetime
    ) -> tuple[dt.datetime, dt.datetime]:
        """When a session's certificate is valid: from shortly before start to end + stop grace.

        An end moved before the start gives a window of one second, long past.
        """
        after = start - CLOCK_SKEW
        return after, max(end + self.config.daemon.stop_grace, after + dt.timedelta(seconds=1))

    def issue_session_key(
        self,
        folder: Path,
        uid: int,
        gid: int,
        key: str,
        start: dt.datetime,
        end: dt.datetime,
        port: int,
    ) -> None:
        """A fresh host key in `folder` (the session's own, uid:gid's), certified by `port`'s CA.

        The private key is uid:gid's, 0600 (the session's root reads it, nobody
        else); the public key and certificate are public.
        """
        private_folder(folder, uid, gid)
        private = ed25519.Ed25519PrivateKey.generate()
        replace_file(folder / HOST_KEY, _private_bytes(private), 0o600, uid, gid)
        replace_file(folder / PUBLIC, (_public_line(private.public_key()) + "\n").encode(), 0o644)
        self._sign_session(folder, key, start, end, self._key(port))

    def renew_session_certificate(
        self, folder: Path, key: str, start: dt.datetime, end: dt.datetime
    ) -> None:
        """Sign the session's host key again for [start, end] (after an extension).

        The CA that signed its current certificate signs again: its port's, or
        the old single CA for a session certified before an upgrade. Raises
        `OSError` when its public key cannot be read (no such session) or no
        CA of this host signed its certificate.
        """
        try:
            signer = _signer(_certificate((folder / CERTIFICATE).read_bytes()))
        except ValueError as error:
            raise OSError(f"{folder / CERTIFICATE}: {error}") from None
        # every port's CA made so far: a port taken out of the config keeps its sessions
        authorities = [_load_key(path) for path in sorted(self.folder.glob(PORT_CA_KEYS))]
        legacy = self._legacy_key()
        authorities += [legacy] if legacy is not None else []
        for authority in authorities:
            if _public_line(authority.public_key()) == signer:
                self._sign_session(folder, key, start, end, authority)
                return
        raise OSError(f"{folder / CERTIFICATE} was signed by no CA of this host's ports")

    def _sign_session(
        self,
        folder: Path,
        key: str,
        start: dt.datetime,
        end: dt.datetime,
        authority: ed25519.Ed25519PrivateKey,
    ) -> None:
        # the folder is the session root's: never read through a link planted there
        descriptor = os.open(folder / PUBLIC, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(descriptor, "rb") as handle:
            public = serialization.load_ssh_public_key(handle.read(64 * 1024))
        if not isinstance(public, ed25519.Ed25519PublicKey):
            raise OSError(f"{folder / PUBLIC} is not an Ed25519 key")
        after, before = self.session_window(start, end)
        host = self.config.daemon.host
        certificate = self.sign(public, f"gpuresa:{host}:session:{key}", after, before, authority)
        replace_file(folder / CERTIFICATE, certificate, 0o644)

    # --- the output service -----------------------------------------------------------------

    def service_keys(self, now: dt.datetime | None = None) -> Path:
        """The output service's key folder (root's): its key, made once, and a current certificate.

        The certificate (by the sftp port's CA) is signed again when missing,
        when less than `SERVICE_RENEW` of it is left, or when the host's names,
        port or CA changed. The shared host keys of earlier versions are
        removed. Raises `OSError` when a key cannot be read or written.
        """
        now = now or dt.datetime.now(dt.UTC)
        folder = private_folder(self.config.daemon.state_dir / SERVICE_FOLDER)
        path = folder / HOST_KEY
        if not path.is_file():
            log.info("making the output service's SSH host key in %s", path)
            replace_file(path, _private_bytes(ed25519.Ed25519PrivateKey.generate()), 0o600)
        private = _load_key(path)
        authority = self._key(self.config.storage.sftp_port)
        if self._service_renewal_due(folder / CERTIFICATE, now, authority):
            host = self.config.daemon.host
            certificate = self.sign(
                private.public_key(),
                f"gpuresa:{host}:outputs",
                now - CLOCK_SKEW,
                now + SERVICE_VALIDITY,
                authority,
            )
            replace_file(folder / CERTIFICATE, certificate, 0o644)
            log.info(
                "signed the output service's host certificate until %s", now + SERVICE_VALIDITY
            )
        _retire_shared_keys(self.config)
        return folder

    def _service_renewal_due(
        self, path: Path, now: dt.datetime, authority: ed25519.Ed25519PrivateKey
    ) -> bool:
        try:
            loaded = _certificate(path.read_bytes())
        except (OSError, ValueError):
            return True
        principals = [name.decode() for name in loaded.valid_principals]
        left = dt.datetime.fromtimestamp(loaded.valid_before, dt.UTC) - now
        return (
            left < SERVICE_RENEW
            or principals != self.principals()
            or _signer(loaded) != _public_line(authority.public_key())
        )


def _load_key(path: Path) -> ed25519.Ed25519PrivateKey:
    """The Ed25519 private key in `path`; raises `OSError` when it is anything else."""
    try:
        key = serialization.load_ssh_private_key(path.read_bytes(), None)
    except ValueError as error:
        raise OSError(f"{path} cannot be read as a key: {error}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise OSError(f"{path} is not an Ed25519 key")
    return key


def _certificate(text: bytes) -> serialization.SSHCertificate:
    """The OpenSSH certificate in `text`; raises `ValueError` when it is none."""
    try:
        loaded = serialization.load_ssh_public_identity(text)
    except UnsupportedAlgorithm as error:  # a file of another kind, or garbled
        raise ValueError(str(error)) from None
    if not isinstance(loaded, serialization.SSHCertificate):
        raise ValueError("not an OpenSSH certificate")
    return loaded


def _signer(certificate: serialization.SSHCertificate) -> str:
    """The public key (OpenSSH text) of the CA that signed `certificate`."""
    return (
        certificate.signature_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


def _retire_shared_keys(config: Config) -> None:
    """Remove the host keys every session once shared: they were readable in sessions."""
    legacy = config.daemon.state_dir / LEGACY_FOLDER
    if legacy.is_dir() and not legacy.is_symlink():
        log.warning(
            "removing the shared SSH host keys in %s (host certificates replace them)", legacy
        )
        shutil.rmtree(legacy, ignore_errors=True)
