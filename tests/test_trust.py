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


def test_the_known_hosts_lines_are_the_host_cas_one_per_port(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trust", "known-hosts", "--config", str(config_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    ca = HostCA(load_config(config_file))
    # the default session ports 223-254, then the sftp port 222: each trusted there alone
    ports = [*range(223, 255), 222]
    assert [line.split()[1] for line in lines] == [
        f"[gpu1.example.org]:{port},[gpu1]:{port},[10.0.0.7]:{port}" for port in ports
    ]
    assert not any(":*" in line for line in lines)
    assert lines == [ca.known_hosts_line(port) for port in ports]
    assert len({line.split()[-1] for line in lines}) == len(ports)  # a CA per port
    # the CAs that sign the sessions' host keys, made once: a second call prints the same
    assert main(["trust", "known-hosts", "--config", str(config_file)]) == 0
    assert capsys.readouterr().out.splitlines() == lines


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
    assert HostCA(load_config(config_file)).known_hosts_text() in both and printed in both
    assert credentials.tls_fingerprint().replace(":", "") == fingerprint
    assert credentials.tls_fingerprint() in both
