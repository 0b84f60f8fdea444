"""The host's SSH certificate authority and the host keys it certifies.

No two sessions of a host, and not its output service, share a host key: a
session's root can read its own sshd's private key, so a shared key would let
any user pose as every other session. Instead:

- one CA key per host (Ed25519), made once into `<state_dir>/host-ca/` (root's,
  0700/0600) and never mounted anywhere; users trust it with ONE
  `@cert-authority` line in known_hosts, valid for every session of the host;
- each session gets a fresh Ed25519 host key when it is prepared, in its own
  host-side folder (owned by the session's root on the host, mounted read-only
  in that session only), with a host certificate valid from shortly before
  the session's start to its end plus `daemon.stop_grace`. When the booking is
  extended the certificate is signed again and replaced in place: the
  session's sshd re-executes itself for every connection and reads the
  certificate file then, so new logins see the new end with no restart;
- the output service has its own key and a certificate of `SERVICE_VALIDITY`,
  signed again whenever the daemon checks the service and less than
  `SERVICE_RENEW` is left.

A key or certificate taken from an ended session is refused by OpenSSH once
its validity is over, and a key without a certificate is refused by the
`@cert-authority` line. The principals are the names users connect with:
`public_name` (else the host's name), the host's name, its `aliases` and
its `bind_address` unless that is a wildcard.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from gpuresa.config.sections import Config

log = logging.getLogger(__name__)

CA_FOLDER = "host-ca"
CA_KEY = "ca_ed25519"
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


def _write(path: Path, data: bytes, mode: int, uid: int = 0, gid: int = 0) -> None:
    """Replace `path` by a fresh file holding `data` (uid:gid, `mode`); never through a link."""
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=".new-")
    try:
        os.write(descriptor, data)
        os.fchown(descriptor, uid, gid)
        os.fchmod(descriptor, mode)
    finally:
        os.close(descriptor)
    try:
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def _folder(path: Path, uid: int = 0, gid: int = 0) -> Path:
    """`path` as a folder of uid:gid alone (0700); refuses a link."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.is_symlink():
        raise OSError(f"{path} is a symbolic link")
    os.chown(path, uid, gid)
    os.chmod(path, 0o700)
    return path


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
    loaded = serialization.load_ssh_public_identity(certificate)
    if not isinstance(loaded, serialization.SSHCertificate):
        raise ValueError("not an OpenSSH certificate")
    return (
        dt.datetime.fromtimestamp(loaded.valid_after, dt.UTC),
        dt.datetime.fromtimestamp(loaded.valid_before, dt.UTC),
    )


class HostCA:
    """This host's SSH CA (see the module docstring); given the config."""

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

    def _key(self) -> ed25519.Ed25519PrivateKey:
        """The CA's private key, made once (the first of several makers wins)."""
        _folder(self.folder)
        path = self.folder / CA_KEY
        if not path.is_file():
            log.info("making this host's SSH host certificate authority in %s", path)
            descriptor, name = tempfile.mkstemp(dir=self.folder, prefix=".new-")
            try:
                os.write(descriptor, _private_bytes(ed25519.Ed25519PrivateKey.generate()))
            finally:
                os.close(descriptor)
            try:
                os.link(name, path)  # fails when another maker was first: its key is kept
            except FileExistsError:
                pass
            finally:
                os.unlink(name)
        try:
            key = serialization.load_ssh_private_key(path.read_bytes(), None)
        except ValueError as error:
            raise OSError(f"{path} cannot be read as a key: {error}") from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise OSError(f"{path} is not an Ed25519 key")
        return key

    def public_line(self) -> str:
        """The CA's public key as OpenSSH writes it: "ssh-ed25519 AAAA..."."""
        return _public_line(self._key().public_key())

    def known_hosts_line(self) -> str:
        """The one known_hosts line that trusts every session and the output service.

        "[name]:*" matches every port of that name (sessions never use 22).
        """
        patterns = ",".join(f"[{name}]:*" for name in self.principals())
        return f"@cert-authority {patterns} {self.public_line()}"

    def sign(
        self,
        public_key: ed25519.Ed25519PublicKey,
        key_id: str,
        valid_after: dt.datetime,
        valid_before: dt.datetime,
    ) -> bytes:
        """A host certificate for `public_key` over that window, one line of OpenSSH text."""
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
        return builder.sign(self._key()).public_bytes() + b"\n"

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
        self, folder: Path, uid: int, gid: int, key: str, start: dt.datetime, end: dt.datetime
    ) -> None:
        """A fresh host key and its certificate in `folder` (the session's own, uid:gid's).

        The private key is uid:gid's, 0600 (the session's root reads it, nobody
        else); the public key and certificate are public.
        """
        _folder(folder, uid, gid)
        private = ed25519.Ed25519PrivateKey.generate()
        _write(folder / HOST_KEY, _private_bytes(private), 0o600, uid, gid)
        _write(folder / PUBLIC, (_public_line(private.public_key()) + "\n").encode(), 0o644)
        self.renew_session_certificate(folder, key, start, end)

    def renew_session_certificate(
        self, folder: Path, key: str, start: dt.datetime, end: dt.datetime
    ) -> None:
        """Sign the session's host key again for [start, end] (after an extension).

        Raises `OSError` when its public key cannot be read (no such session).
        """
        public = serialization.load_ssh_public_key((folder / PUBLIC).read_bytes())
        if not isinstance(public, ed25519.Ed25519PublicKey):
            raise OSError(f"{folder / PUBLIC} is not an Ed25519 key")
        after, before = self.session_window(start, end)
        host = self.config.daemon.host
        certificate = self.sign(public, f"gpuresa:{host}:session:{key}", after, before)
        _write(folder / CERTIFICATE, certificate, 0o644)

    # --- the output service -----------------------------------------------------------------

    def service_keys(self, now: dt.datetime | None = None) -> Path:
        """The output service's key folder (root's): its key, made once, and a current certificate.

        The certificate is signed again when missing, when less than
        `SERVICE_RENEW` of it is left, or when the host's names or CA changed.
        The shared host keys of earlier versions are removed. Raises `OSError`
        when a key cannot be read or written.
        """
        now = now or dt.datetime.now(dt.UTC)
        folder = _folder(self.config.daemon.state_dir / SERVICE_FOLDER)
        path = folder / HOST_KEY
        if not path.is_file():
            log.info("making the output service's SSH host key in %s", path)
            _write(path, _private_bytes(ed25519.Ed25519PrivateKey.generate()), 0o600)
        private = serialization.load_ssh_private_key(path.read_bytes(), None)
        if not isinstance(private, ed25519.Ed25519PrivateKey):
            raise OSError(f"{path} is not an Ed25519 key")
        if self._service_renewal_due(folder / CERTIFICATE, now):
            host = self.config.daemon.host
            certificate = self.sign(
                private.public_key(),
                f"gpuresa:{host}:outputs",
                now - CLOCK_SKEW,
                now + SERVICE_VALIDITY,
            )
            _write(folder / CERTIFICATE, certificate, 0o644)
            log.info(
                "signed the output service's host certificate until %s", now + SERVICE_VALIDITY
            )
        _retire_shared_keys(self.config)
        return folder

    def _service_renewal_due(self, path: Path, now: dt.datetime) -> bool:
        try:
            loaded = serialization.load_ssh_public_identity(path.read_bytes())
        except (OSError, ValueError):
            return True
        if not isinstance(loaded, serialization.SSHCertificate):
            return True
        principals = [name.decode() for name in loaded.valid_principals]
        ca = _public_line(self._key().public_key()).encode()
        signed_by = loaded.signature_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        left = dt.datetime.fromtimestamp(loaded.valid_before, dt.UTC) - now
        return left < SERVICE_RENEW or principals != self.principals() or signed_by != ca


def _retire_shared_keys(config: Config) -> None:
    """Remove the host keys every session once shared: they were readable in sessions."""
    legacy = config.daemon.state_dir / LEGACY_FOLDER
    if legacy.is_dir() and not legacy.is_symlink():
        log.warning(
            "removing the shared SSH host keys in %s (host certificates replace them)", legacy
        )
        shutil.rmtree(legacy, ignore_errors=True)
