"""The host's FTPS certificate: the admin's, else made once, kept in the state directory.

The FTP sidecars' certificate: `storage.ftp_tls_cert`/`ftp_tls_key` when set,
else a self-signed one made once into `<state_dir>/tls/`; a copy the
sidecar's remapped root can read is mounted read-only into sidecars.
SSH host keys are not shared (see `host_ca`).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import shutil
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from gpuresa.config.sections import Config
from gpuresa.safe_files import create_once, private_folder, replace_file

log = logging.getLogger(__name__)

TLS_FOLDER = "tls"
SESSION_COPY = "session"


class HostCredentials:
    """The FTPS certificate of this host (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.tls_folder = config.daemon.state_dir / TLS_FOLDER

    # --- FTPS ---------------------------------------------------------------------------------

    def tls_files(self) -> tuple[Path, Path]:
        """The certificate and key the FTP sidecars use: the admin's, else made once."""
        storage = self.config.storage
        if storage.ftp_tls_cert is not None and storage.ftp_tls_key is not None:
            return storage.ftp_tls_cert, storage.ftp_tls_key
        private_folder(self.tls_folder)
        certificate = self.tls_folder / "ftp-cert.pem"
        key = self.tls_folder / "ftp-key.pem"
        if not certificate.is_file():
            name = self.config.host().public_name or self.config.daemon.host
            log.info("making a self-signed FTPS certificate for %s in %s", name, certificate)
            # one file holds both, made once: a key and a certificate always match
            pem_key, pem_certificate = self_signed(name)
            create_once(self.tls_folder / "ftp.pem", pem_key + pem_certificate)
            bundle = (self.tls_folder / "ftp.pem").read_bytes()
            marker = b"-----BEGIN CERTIFICATE-----"
            replace_file(key, bundle[: bundle.index(marker)])
            replace_file(certificate, bundle[bundle.index(marker) :], mode=0o644)
        return certificate, key

    def tls_fingerprint(self) -> str:
        """The SHA-256 fingerprint of the FTPS certificate, as clients show it."""
        certificate = x509.load_pem_x509_certificate(self.tls_files()[0].read_bytes())
        digest = certificate.fingerprint(hashes.SHA256()).hex().upper()
        return ":".join(digest[index : index + 2] for index in range(0, len(digest), 2))

    def sidecar_tls(self, uid: int, gid: int) -> Path:
        """A copy of the certificate and key readable by a sidecar's root; its folder."""
        certificate, key = self.tls_files()
        # one copy per id range: sessions of different ranges (Podman) each read their own
        folder = private_folder(self.tls_folder / f"{SESSION_COPY}-{uid}", uid, gid)
        _copy_if_changed(certificate, folder / "cert.pem", uid, gid)
        _copy_if_changed(key, folder / "key.pem", uid, gid)
        return folder


def _copy_if_changed(source: Path, target: Path, uid: int, gid: int) -> None:
    data = source.read_bytes()
    try:
        details = target.lstat()
        if (details.st_uid, details.st_gid) == (uid, gid) and target.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    replace_file(target, data, uid=uid, gid=gid)


def self_signed(name: str) -> tuple[bytes, bytes]:
    """A new RSA key and a ten-year self-signed certificate for `name`, both PEM."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    try:
        alternative: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        alternative = x509.DNSName(name)
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([alternative]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return pem_key, certificate.public_bytes(serialization.Encoding.PEM)


def remove_session_copies(config: Config) -> None:
    """Forget the copies made for sessions (they are made again on the next start)."""
    state = config.daemon.state_dir
    for folder in (state / TLS_FOLDER).glob(f"{SESSION_COPY}-*"):
        shutil.rmtree(folder, ignore_errors=True)
