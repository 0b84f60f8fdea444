"""`gpuresa trust`: the lines users trust a host's sessions with, as the sessions present them."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from gpuresa.cli import main
from gpuresa.config.reading import load_config
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.host_ca import HostCA


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'[daemon]\nhost = "gpu1"\nstate_dir = "{tmp_path / "state"}"\n'
        '[[hosts]]\nname = "gpu1"\ngpus = []\ngpu_mode = "none"\n'
        'public_name = "gpu1.example.org"\naliases = ["10.0.0.7"]\n'
    )
    return path


def test_the_known_hosts_line_is_the_host_cas(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trust", "known-hosts", "--config", str(config_file)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("@cert-authority [gpu1.example.org]:*,[gpu1]:*,[10.0.0.7]:* ")
    # the CA that signs the sessions' host keys, made once: a second call prints the same
    assert line == HostCA(load_config(config_file)).known_hosts_line()
    assert main(["trust", "known-hosts", "--config", str(config_file)]) == 0
    assert capsys.readouterr().out.strip() == line


def test_the_ftps_certificate_is_the_one_the_sidecars_present(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trust", "ftps-certificate", "--config", str(config_file)]) == 0
    printed = capsys.readouterr().out
    certificate = x509.load_pem_x509_certificate(printed.encode())
    credentials = HostCredentials(load_config(config_file))
    served, _key = credentials.tls_files()
    assert printed == served.read_text()
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert names.value.get_values_for_type(x509.DNSName) == ["gpu1.example.org"]
    # everything at once: the line, then the certificate with its fingerprint
    assert main(["trust", "--config", str(config_file)]) == 0
    both = capsys.readouterr().out
    fingerprint = certificate.fingerprint(hashes.SHA256()).hex().upper()
    assert "@cert-authority" in both and printed in both
    assert credentials.tls_fingerprint().replace(":", "") == fingerprint
    assert credentials.tls_fingerprint() in both
