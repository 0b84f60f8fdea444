"""Outputs: retention rules, owners, accounts, disk levels, the CLI, and a full disk on Docker.

The rules are pure and table-driven; the full disk is a real tmpfs the test
fills, with real sessions on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import TEST_HOST, DockerHarness
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from test_runtime import make_site, run, ssh_login

from gpuresa.access import Account
from gpuresa.backends.engines.create_payloads import MainContainer, ftp_payload, main_payload
from gpuresa.backends.engines.output_container import accounts_text
from gpuresa.backends.engines.output_service import OutputService
from gpuresa.backends.port_safety import port_warnings, unprivileged_port_start
from gpuresa.cli import main
from gpuresa.commands.daemon_commands import status_report
from gpuresa.commands.output_commands import human_size
from gpuresa.config.reading import parse_config
from gpuresa.config.schema import Share, Size
from gpuresa.config.sections import StorageConfig
from gpuresa.daemon import journal_path
from gpuresa.daemon.output_duties import OutputDuties
from gpuresa.errors import ConfigError
from gpuresa.journal.store import Journal
from gpuresa.mail.notices import end_message, start_message
from gpuresa.model import Session, SessionSpec
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.disk import (
    disk_level,
    disk_warnings,
    free_bytes,
    measure,
    mount_of,
    quota_problem,
)
from gpuresa.outputs.host_ca import HostCA, certificate_validity
from gpuresa.outputs.messages import end_details, removal_notice_message
from gpuresa.outputs.owners import output_owner, uid_overlaps
from gpuresa.outputs.records import OutputFolder, OutputRecords, notice_due, removal_due
from gpuresa.outputs.running_area import running_path
from gpuresa.sessions.errors import SessionError

NOW = datetime(2025, 3, 10, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


def storage(**values: Any) -> StorageConfig:
    return parse_config({"storage": values}).storage


# --- retention --------------------------------------------------------------------------


def folder(
    ended: datetime | None, notice: datetime | None = None, busy: bool = False
) -> OutputFolder:
    return OutputFolder("alice", "alice/x", Path("/o/alice/x"), ended, "k", notice, busy)


@pytest.mark.parametrize(
    ("case", "retention", "ended", "notice", "busy", "notice_now", "remove_now"),
    [
        ("fresh output", "7d", NOW - DAY, None, False, False, False),
        ("a day before the end of retention", "7d", NOW - 6 * DAY, None, False, True, False),
        ("retention over but never told", "7d", NOW - 30 * DAY, None, False, True, False),
        ("told a day ago, retention over", "7d", NOW - 7 * DAY, NOW - DAY, False, False, True),
        ("told late: a full day still", "7d", NOW - 30 * DAY, NOW - DAY / 2, False, False, False),
        ("in use by a session", "7d", NOW - 30 * DAY, NOW - 2 * DAY, True, False, False),
        ("kept forever", "forever", NOW - 900 * DAY, None, False, False, False),
        ("shorter retention than notice", "1h", NOW - 2 * DAY, NOW - DAY, False, False, True),
    ],
)
def test_notices_and_removals_follow_the_rules(
    case: str,
    retention: str,
    ended: datetime,
    notice: datetime | None,
    busy: bool,
    notice_now: bool,
    remove_now: bool,
) -> None:
    rules = storage(output_retention=retention)
    output = folder(ended, notice, busy)
    assert notice_due(output, NOW, rules) is notice_now, case
    assert removal_due(output, NOW, rules) is remove_now, case


def test_a_short_retention_removes_a_folder_only_after_its_notice(
    tmp_path: Path, docker_harness: DockerHarness
) -> None:
    site = make_site(tmp_path, docker_harness.client)
    config = dataclasses.replace(
        site.config,
        storage=dataclasses.replace(
            site.config.storage,
            output_retention=timedelta(seconds=30),
            output_removal_notice=timedelta(seconds=10),
        ),
    )
    service = OutputService(config, site.runtime())
    output = tmp_path / "output" / "alice" / "20250310-1200-k"
    (output / "sub").mkdir(parents=True)
    (output / "sub" / "result.txt").write_text("r")
    os.symlink("/etc", output / "link-to-etc")
    ended = NOW
    service.records.record_end("alice/20250310-1200-k", "alice", "k", ended)

    assert service.due_removal_notices(ended + timedelta(seconds=19)) == []
    assert service.due_removals(ended + timedelta(days=9)) == []  # never told yet
    [due] = service.due_removal_notices(ended + timedelta(seconds=20))
    subject, body = removal_notice_message(
        due, config, "gpu1.example.org", ended + timedelta(seconds=30)
    )
    assert f"sftp -P {config.storage.sftp_port} alice@gpu1.example.org" in body
    assert "will be removed" in subject
    service.notice_sent(due, ended + timedelta(seconds=25))
    assert service.due_removal_notices(ended + timedelta(seconds=26)) == []
    # removal waits a full notice period after the notice went out
    assert service.prune(ended + timedelta(seconds=34)) == []
    assert [item.path for item in service.prune(ended + timedelta(seconds=35), dry_run=True)] == [
        output
    ]
    assert output.is_dir()
    assert [item.path for item in service.prune(ended + timedelta(seconds=35))] == [output]
    assert not output.exists() and Path("/etc/passwd").exists()
    assert service.folders() == []


def test_an_unrecorded_folder_gets_a_full_retention_from_first_sight(
    tmp_path: Path, docker_harness: DockerHarness
) -> None:
    site = make_site(tmp_path, docker_harness.client)
    service = OutputService(site.config, site.runtime())
    (tmp_path / "output" / "bob" / "old").mkdir(parents=True)
    (tmp_path / "output" / "bob" / "new").mkdir(parents=True)
    (tmp_path / "output" / "not a login").mkdir()
    (tmp_path / "output" / "root").mkdir()
    settled = time.time() - 2 * 3600
    os.utime(tmp_path / "output" / "bob" / "old", (settled, settled))
    # "new" changed a moment ago: maybe a session being made, left alone
    assert [(item.relative, item.busy) for item in service.folders(NOW)] == [
        ("bob/new", True),
        ("bob/old", False),
    ]
    [found] = [item for item in service.folders(NOW) if not item.busy]
    assert (found.user, found.ended) == ("bob", NOW)
    assert service.due_removal_notices(NOW + 5 * DAY) == []
    assert len(service.due_removal_notices(NOW + 6 * DAY)) == 1


def test_outputs_commands_list_and_prune(
    tmp_path: Path, docker_harness: DockerHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    site = make_site(tmp_path, docker_harness.client)
    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f"""
[daemon]
host = "{site.config.daemon.host}"
state_dir = "{tmp_path / "state"}"
[[hosts]]
name = "{site.config.daemon.host}"
gpu_mode = "none"
gpus = []
[users]
keys_dir = "{tmp_path / "keys"}"
[storage]
output_root = "{tmp_path / "output"}"
output_retention = "1s"
output_removal_notice = "0s"
"""
    )
    settled = time.time() - 2 * 3600
    for login in ("alice", "bob"):
        (tmp_path / "output" / login / "run-1").mkdir(parents=True)
        (tmp_path / "output" / login / "run-1" / "data.bin").write_bytes(b"x" * 2048)
        os.utime(tmp_path / "output" / login / "run-1", (settled, settled))
    assert main(["outputs", "list", "--json", "--user", "alice", "--config", str(config_file)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["user"], row["in_use"]) for row in rows] == [("alice", False)]
    assert rows[0]["bytes"] >= 2048
    assert main(["outputs", "prune", "--dry-run", "--config", str(config_file)]) == 0
    assert "nothing to remove" in capsys.readouterr().out  # first sight starts the retention
    records = OutputRecords(tmp_path / "state" / "outputs")
    records.record_end("alice/run-1", "alice", "k", NOW)
    assert main(["outputs", "prune", "--config", str(config_file)]) == 0
    assert "removed" in capsys.readouterr().out
    assert not (tmp_path / "output" / "alice" / "run-1").exists()
    assert (tmp_path / "output" / "bob" / "run-1").exists()


@pytest.mark.parametrize(
    ("count", "shown"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3 << 20, "3.0 MiB"),
     (int(2.5 * (1 << 30)), "2.5 GiB"), (2000 << 40, "2000.0 TiB")],
)  # fmt: skip
def test_sizes_are_shown_in_the_unit_that_fits(count: int, shown: str) -> None:
    assert human_size(count) == shown


def test_outputs_list_shows_what_files_hold_and_what_they_take_on_disk(
    tmp_path: Path, docker_harness: DockerHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 3 MiB file kept sparse (zeros copied out of a session's image) is 3 MiB, not 0.0."""
    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f'[daemon]\nhost = "{TEST_HOST}"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[[hosts]]\nname = "{TEST_HOST}"\ngpu_mode = "none"\ngpus = []\n'
        f'[users]\nkeys_dir = "{tmp_path}"\n[storage]\noutput_root = "{tmp_path / "output"}"\n'
    )
    run = tmp_path / "output" / "alice" / "run-1"
    run.mkdir(parents=True)
    (run / "dense.bin").write_bytes(os.urandom(3 << 20))
    with (run / "zeros.bin").open("wb") as sparse:
        sparse.truncate(3 << 20)
    # what a user may leave to inflate the figure: links and a FIFO, never followed or read
    outside = tmp_path / "huge.bin"
    with outside.open("wb") as huge:
        huge.truncate(1 << 30)
    (run / "link").symlink_to(outside)
    os.mkfifo(run / "fifo")
    settled = time.time() - 2 * 3600
    os.utime(run, (settled, settled))
    assert main(["outputs", "list", "--json", "--config", str(config_file)]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["bytes"] == 6 << 20
    assert 3 << 20 <= row["disk_bytes"] < (3 << 20) + (1 << 20)
    assert main(["outputs", "list", "--config", str(config_file)]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["USER", "SIZE", "ON", "DISK"]
    assert line.split()[:5] == ["alice", "6.0", "MiB", "3.0", "MiB"]


# --- owners and accounts --------------------------------------------------------------


def test_owners_are_the_host_account_else_a_derived_uid() -> None:
    config = parse_config({"users": {"uids": {"carol": 3000}}})
    accounts = {"alice": Account("alice", 1001, 1001, Path("/home/alice"))}
    alice = output_owner("alice", config, accounts.get)
    carol = output_owner("carol", config, accounts.get)
    assert (alice.uid, alice.host_account) == (1001, True)
    assert (carol.uid, carol.gid, carol.host_account) == (1_500_003_000, 1_500_003_000, False)
    # alice's primary group is not known as hers here: a private derived gid
    assert alice.gid == 1_500_001_001
    off = parse_config({"storage": {"hand_output_to_user": False}})
    assert output_owner("alice", off, accounts.get).uid == 1_500_001_001
    passwd, group = accounts_text([alice, carol], 1_499_999_999)
    assert "alice:x:1001:1500001001:gpuresa outputs:/:/usr/sbin/nologin" in passwd.splitlines()
    assert passwd.splitlines()[1].startswith("sshd:x:1499999999:")
    assert "carol:x:1500003000:" in group.splitlines()


def test_derived_uids_clash_with_subordinate_ranges_are_found() -> None:
    config = parse_config({"storage": {"output_uid_base": 100000}})
    assert uid_overlaps(config, "dockremap:100000:65536\nx:2000000:10\n") == [
        "dockremap:100000:65536"
    ]
    assert uid_overlaps(parse_config({}), "dockremap:100000:65536\n") == []


# --- config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"output_pattern": "{start:%Y}/{user}-{key}"}, 'must start with "{user}/"'),
        ({"free_warn": "lots"}, "storage.free_warn"),
        ({"free_warn": "5%", "free_refuse": "10%"}, "more than storage.free_warn"),
        ({"ftp_tls_cert": "/etc/cert.pem"}, "set both or neither"),
        ({"sftp_port": 70000}, "storage.sftp_port"),
        ({"output_retention": "sometimes"}, '"forever"'),
        ({"session_quota": "big"}, "storage.session_quota"),
    ],
)
def test_bad_storage_settings_are_refused(values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"storage": values})
    assert complaint in str(caught.value)


def test_the_sftp_port_may_not_be_a_session_port() -> None:
    with pytest.raises(ConfigError, match=r"storage\.sftp_port: 230 is in hosts"):
        parse_config({"hosts": [{"name": "localhost"}], "storage": {"sftp_port": 230}})
    # off: the pattern is free
    parse_config({"storage": {"sftp_port": 0, "output_pattern": "{key}"}})


def test_defaults_keep_outputs_off_the_state_disk_and_hand_them_over() -> None:
    defaults = parse_config({})
    assert defaults.storage.output_root == Path("/srv/gpuresa/output")
    assert not defaults.storage.output_root.is_relative_to(defaults.daemon.state_dir)
    assert defaults.storage.hand_output_to_user is True
    assert defaults.storage.output_retention == timedelta(days=7)


# --- disk -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "total", "warn", "refuse", "level"),
    [
        (50, 100, "10%", "3%", "ok"),
        (10, 100, "10%", "3%", "ok"),
        (9, 100, "10%", "3%", "warn"),
        (2, 100, "10%", "3%", "refuse"),
        (5 * 1024**3, 10**13, "10g", "2g", "warn"),
        (1024**3, 10**13, "10g", "2g", "refuse"),
        (0, 0, "10%", "3%", "ok"),
    ],
)
def test_disk_levels(free: int, total: int, warn: str, refuse: str, level: str) -> None:
    assert disk_level(free, total, storage(free_warn=warn, free_refuse=refuse)) == level


def test_threshold_spellings() -> None:
    read = storage(free_warn="2.5%", free_refuse="3G")
    assert read.free_warn == Share(0.025) and read.free_refuse == Size(3 * 1024**3)
    assert free_bytes(read.free_warn, 1000) == 25
    assert free_bytes(read.free_refuse, 0) == 3 * 1024**3
    # a size still written as text (session_quota) is read as the config reads sizes
    assert free_bytes("3G", 0) == 3 * 1024**3
    with pytest.raises(ValueError):
        free_bytes("3 gigs", 0)


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 8:2 / /srv rw,relatime shared:2 - xfs /dev/sdb1 rw,prjquota
31 22 8:3 / /data rw,relatime shared:3 - ext4 /dev/sdc1 rw
32 22 0:5 / /tmp rw shared:4 - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/srv/gpuresa/output", None),
        ("/data/output", "not mounted with prjquota"),
        ("/tmp/output", "tmpfs, which has no project quotas"),
        ("/var/output", "not mounted with prjquota"),
    ],
)
def test_project_quota_support_is_read_from_the_mount(path: str, problem: str | None) -> None:
    found = quota_problem(mount_of(Path(path), MOUNTINFO))
    assert (found is None) if problem is None else (problem in (found or ""))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs of the test's own, unmounted at the end."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount_point)], check=True
    )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_output_disk_refuses_new_sessions_and_spares_running_ones(
    tmp_path: Path, small_disk: Path, docker_harness: DockerHarness, images: None
) -> None:
    site = make_site(tmp_path, docker_harness.client)
    site.config = dataclasses.replace(
        site.config,
        storage=dataclasses.replace(
            site.config.storage,
            output_root=small_disk / "output",
            free_warn=Share(0.50),
            free_refuse=Share(0.25),
            # no cap: the session itself fills the disk here (caps: test_output_cap.py)
            session_quota="none",
            # no lasting home: its own disk check would apply this test's free_refuse (25%)
            # to the machine's disk, whose free space is not this test's to set
            home_quota="off",
        ),
    )
    with_cap = dataclasses.replace(
        site.config, storage=dataclasses.replace(site.config.storage, session_quota="4m")
    )
    warnings = disk_warnings(with_cap)
    assert any("tmpfs, which has no project quotas" in warning for warning in warnings)
    assert not any("same filesystem" in warning for warning in warnings)
    runtime = site.runtime()
    running = runtime.start(site.spec(runtime, "alice"))
    assert measure(site.config.storage, site.config.daemon.state_dir).level == "ok"

    with ssh_login(running, "alice", site.key("alice")) as client:
        assert run(client, "head -c 18M /dev/zero > /output/big")[0] == 0
    state = measure(site.config.storage, site.config.daemon.state_dir)
    assert state.level == "warn"
    with ssh_login(running, "alice", site.key("alice")) as client:
        assert run(client, "head -c 8M /dev/zero > /output/bigger")[0] == 0
    state = measure(site.config.storage, site.config.daemon.state_dir)
    assert state.level == "refuse" and state.refusal is not None
    with pytest.raises(SessionError, match="output disk is nearly full") as refused:
        runtime.start(site.spec(runtime, "bob"))
    assert "storage.free_refuse" in str(refused.value)
    assert [session.user for session in runtime.list_sessions()] == ["alice"]
    # `gpuresa status` says so
    Journal(journal_path(site.config)).close()
    disk = status_report(site.config, datetime.now(UTC))["output_disk"]
    assert disk["level"] == "refuse" and "storage.free_refuse" in disk["refusal"]
    with ssh_login(running, "alice", site.key("alice")) as client:
        assert run(client, "echo still-here > /output/note && cat /output/note") == (
            0,
            "still-here\n",
        )


@pytest.fixture(scope="module")
def images(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    site = make_site(tmp_path_factory.mktemp("images"), docker_client)
    site.runtime().ensure_image("pytorch", None)
    site.runtime().ensure_ftp_image()


def test_the_state_disk_shared_with_outputs_is_named(tmp_path: Path) -> None:
    config = parse_config(
        {
            "daemon": {"state_dir": str(tmp_path / "state")},
            "storage": {"output_root": str(tmp_path / "out")},
        }
    )
    assert any("same filesystem" in warning for warning in disk_warnings(config))


# --- words ----------------------------------------------------------------------------


def test_the_end_email_says_how_to_download_and_until_when() -> None:
    config = parse_config({"storage": {"sftp_port": 2222}, "reservations": {"timezone": "UTC"}})
    session = Session(
        key="booking-42", user="alice", host="gpu1", template="pytorch", cuda=None,
        gpu_count=0, gpu_indices=(),
        start=NOW - DAY, end=NOW, ssh_port=20001, ftp_port=21001, ftp_passive_first=22000,
        ftp_passive_last=22009, state="stopped",
        output_dir=Path("/srv/gpuresa/output/alice/20250309-1200-booking-42"),
    )  # fmt: skip
    details = end_details(config, session, "gpu1.example.org", NOW)
    _, body = end_message(session, session.output_dir, "UTC", details=details)
    assert "\n  sftp -P 2222 alice@gpu1.example.org\n" in body
    assert "removed on Monday 2025-03-17 12:00 UTC" in body
    forever = parse_config({"storage": {"output_retention": "forever"}})
    assert "kept until an administrator" in end_details(forever, session, "gpu1", NOW)


def test_each_port_has_a_cert_authority_line_naming_every_name_users_connect_with(
    tmp_path: Path,
) -> None:
    config = parse_config(
        {
            "daemon": {"host": "gpu1", "state_dir": str(tmp_path / "state")},
            "hosts": [{"name": "gpu1", "public_name": "gpu1.example.org", "aliases": ["10.0.0.7"]}],
        }
    )
    ca = HostCA(config)
    assert ca.principals() == ["gpu1.example.org", "gpu1", "10.0.0.7"]
    line = ca.known_hosts_line(223)
    assert line == (
        f"@cert-authority [gpu1.example.org]:223,[gpu1]:223,[10.0.0.7]:223 {ca.public_line(223)}"
    )
    assert line.split()[2] == "ssh-ed25519"
    # a line per session port and the sftp port, each with a CA of its own
    lines = ca.known_hosts_text().splitlines()
    assert len(lines) == len(config.host().ssh_ports) + 1 and lines[0] == line
    assert lines[-1].startswith("@cert-authority [gpu1.example.org]:222,")
    assert len({line.split()[-1] for line in lines}) == len(lines)
    # the CA keys are root's alone, in a folder of root's alone
    folder = (tmp_path / "state" / "host-ca").stat()
    key = (tmp_path / "state" / "host-ca" / "port-223_ed25519").stat()
    assert (folder.st_uid, stat.S_IMODE(folder.st_mode)) == (0, 0o700)
    assert (key.st_uid, stat.S_IMODE(key.st_mode)) == (0, 0o600)


def test_a_session_certificate_covers_its_time_and_is_signed_again_on_extension(
    tmp_path: Path,
) -> None:
    config = parse_config(
        {
            "daemon": {"state_dir": str(tmp_path / "state"), "stop_grace": "45s"},
            "hosts": [{"name": "localhost", "public_name": "gpu1.example.org"}],
        }
    )
    ca = HostCA(config)
    folder = tmp_path / "session" / "host-keys"
    folder.parent.mkdir()
    ca.issue_session_key(folder, 100000, 100001, "booking-42", NOW, NOW + DAY, 224)
    private = (folder / "ssh_host_ed25519_key").stat()
    assert (private.st_uid, private.st_gid, stat.S_IMODE(private.st_mode)) == (
        100000,
        100001,
        0o600,
    )
    assert (folder.stat().st_uid, stat.S_IMODE(folder.stat().st_mode)) == (100000, 0o700)
    certificate = (folder / "ssh_host_ed25519_key-cert.pub").read_bytes()
    assert certificate_validity(certificate) == (
        NOW - timedelta(minutes=5),
        NOW + DAY + timedelta(seconds=45),
    )
    loaded = serialization.load_ssh_public_identity(certificate)
    assert isinstance(loaded, serialization.SSHCertificate)
    assert loaded.type == serialization.SSHCertificateType.HOST
    assert loaded.valid_principals == [b"gpu1.example.org", b"localhost"]
    signer = loaded.signature_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    assert signer == ca.public_line(224).encode()  # its port's CA
    loaded.verify_cert_signature()
    # extended by a day: the same key, a new certificate up to the new end
    ca.renew_session_certificate(folder, "booking-42", NOW, NOW + 2 * DAY)
    renewed = (folder / "ssh_host_ed25519_key-cert.pub").read_bytes()
    assert certificate_validity(renewed)[1] == NOW + 2 * DAY + timedelta(seconds=45)
    again = serialization.load_ssh_public_identity(renewed)
    assert isinstance(again, serialization.SSHCertificate)
    assert again.public_key() == loaded.public_key()
    assert again.signature_key() == loaded.signature_key()
    # a second session gets a key of its own
    other = tmp_path / "other" / "host-keys"
    other.parent.mkdir()
    ca.issue_session_key(other, 100000, 100000, "booking-43", NOW, NOW + DAY, 225)
    mine = (folder / "ssh_host_ed25519_key").read_bytes()
    assert (other / "ssh_host_ed25519_key").read_bytes() != mine


def test_the_output_service_certificate_is_renewed_before_it_runs_out(tmp_path: Path) -> None:
    config = parse_config(
        {"daemon": {"state_dir": str(tmp_path / "state")}, "hosts": [{"name": "localhost"}]}
    )
    legacy = tmp_path / "state" / "host-keys"
    legacy.mkdir(parents=True)
    (legacy / "ssh_host_ed25519_key").write_text("the old shared key")
    ca = HostCA(config)
    folder = ca.service_keys(NOW)
    assert not legacy.exists()  # the shared keys of old are gone
    key = (folder / "ssh_host_ed25519_key").read_bytes()
    first = (folder / "ssh_host_ed25519_key-cert.pub").read_bytes()
    assert certificate_validity(first)[1] == NOW + timedelta(days=30)
    ca.service_keys(NOW + timedelta(days=19))  # 11 days left: kept
    assert (folder / "ssh_host_ed25519_key-cert.pub").read_bytes() == first
    ca.service_keys(NOW + timedelta(days=21))  # 9 days left: signed again, same key
    renewed = (folder / "ssh_host_ed25519_key-cert.pub").read_bytes()
    assert certificate_validity(renewed)[1] == NOW + timedelta(days=51)
    assert (folder / "ssh_host_ed25519_key").read_bytes() == key
    assert stat.S_IMODE((folder / "ssh_host_ed25519_key").stat().st_mode) == 0o600


def test_config_validate_warns_about_ports_a_host_user_can_bind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    defaults = parse_config({"hosts": [{"name": "localhost"}]})
    assert port_warnings(defaults, 1024) == []
    high = parse_config(
        {
            "hosts": [{"name": "localhost", "ssh_ports": "200-210", "ftp_ports": "1000-1030"}],
            "storage": {"sftp_port": 2222},
        }
    )
    warnings = port_warnings(high, 1024)
    assert [warning.split(":")[0] for warning in warnings] == [
        "hosts[0].ftp_ports",
        "storage.sftp_port",
    ]
    # a machine that lets users bind from 80 up: the defaults are bindable too
    assert len(port_warnings(defaults, 80)) == 3  # ssh, ftp control, sftp: passive ports never
    # on this machine, through the command
    start = unprivileged_port_start()
    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[users]\nkeys_dir = "{tmp_path}"\n[storage]\noutput_root = "{tmp_path / "output"}"\n'
        f'[[hosts]]\nname = "localhost"\nssh_ports = "{start}-{start + 9}"\n'
    )
    assert main(["config", "validate", "--config", str(config_file)]) == 0
    output = capsys.readouterr().out
    assert f"warning: hosts[0].ssh_ports: {start}-{start + 9} is bindable" in output
    assert "ftp_ports" not in output  # the default range is below 1024


# --- the daemon's round -----------------------------------------------------------------


def test_a_round_tells_once_removes_after_the_notice_and_reports_the_disk(
    tmp_path: Path, docker_harness: DockerHarness, images: None
) -> None:
    site = make_site(tmp_path, docker_harness.client)
    config = dataclasses.replace(
        site.config,
        storage=dataclasses.replace(
            site.config.storage,
            sftp_port=0,  # the service itself is tested in test_outputs_service.py
            output_retention=timedelta(seconds=30),
            output_removal_notice=timedelta(seconds=10),
            free_warn=Share(1.0),  # every disk is "low": the warning path runs
            free_refuse=Share(0.0),
        ),
    )
    service = OutputService(config, site.runtime())
    duties = OutputDuties(service, "gpu1.example.org")
    output = tmp_path / "output" / "alice" / "run-1"
    output.mkdir(parents=True)
    service.records.record_end("alice/run-1", "alice", "booking-1", NOW)
    running = site.runtime().start(site.spec(site.runtime(), "bob"))
    users: list[tuple[str, str, str]] = []
    admins: list[tuple[str, str]] = []

    def to_user(
        key: str, kind: str, user: str, email: str | None, message: tuple[str, str]
    ) -> bool:
        users.append((key, kind, message[1]))
        return True

    def to_admin(key: str, kind: str, subject: str, body: str) -> bool:
        admins.append((key, kind))
        return True

    line = duties.run(NOW + timedelta(seconds=5), [running], to_user, to_admin)
    assert "output service off" in line and "0 output(s) removed" in line
    assert [(key, kind) for key, kind, _ in users] == [(running.key, "output-disk-low")]
    assert admins == [("output-disk", "warn-2025-03-10")]
    users.clear()
    duties.run(NOW + timedelta(seconds=20), [running], to_user, to_admin)
    notices = [body for key, kind, body in users if kind == "output-removal"]
    assert len(notices) == 1 and "sftp -P 0" not in notices[0] and "run-1" in notices[0]
    assert len(admins) == 1  # the admin hears of a level once
    users.clear()
    duties.run(NOW + timedelta(seconds=29), [running], to_user, to_admin)
    assert [kind for _, kind, _ in users if kind == "output-removal"] == []
    assert output.is_dir()  # notice sent at +20 s: kept until +30 s
    line = duties.run(NOW + timedelta(seconds=30), [running], to_user, to_admin)
    assert "1 output(s) removed" in line and not output.exists()
    assert running_path(site.config, running.key).is_dir()  # in use: never touched


def test_sessions_mount_the_host_keys_and_sidecars_the_certificate_read_only() -> None:
    config = parse_config({"hosts": [{"name": "localhost", "gpu_mode": "none", "gpus": []}]})
    spec = SessionSpec(
        key="k", user="alice", host="localhost", template="pytorch", cuda=None,
        gpu_count=0, gpu_indices=(),
        start=NOW, end=NOW + DAY, ssh_port=20000, ftp_port=21000, ftp_passive_first=22000,
        ftp_passive_last=22009,
    )  # fmt: skip
    # what else a main container needs changes with the runtime; only the host keys matter here
    others: dict[str, Any] = {
        field.name: Path("/s") if field.type in ("Path", Path) else ""
        for field in dataclasses.fields(MainContainer)
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    }
    main_container = MainContainer(
        **{**others, "image": "i", "uid": 2000, "output_dir": Path("/o/alice/x")},
        host_keys_dir=Path("/var/lib/gpuresa/host-keys/session"),
    )
    mounts = main_payload(config, spec, main_container, {})["HostConfig"]["Mounts"]
    assert {
        "Type": "bind",
        "Source": "/var/lib/gpuresa/host-keys/session",
        "Target": "/etc/ssh/gpuresa-host-keys",
        "ReadOnly": True,
    } in mounts
    sidecar = ftp_payload(
        config, spec, "f", 2000, "alice", "pw", Path("/o/alice/x"), {},
        tls_dir=Path("/var/lib/gpuresa/tls/session"),
    )  # fmt: skip
    assert {
        "Type": "bind",
        "Source": "/var/lib/gpuresa/tls/session",
        "Target": "/etc/gpuresa-ftp/tls",
        "ReadOnly": True,
    } in sidecar["HostConfig"]["Mounts"]
    assert "FTP_PLAIN=no" in sidecar["Env"]
    plain = parse_config({"hosts": [{"name": "localhost"}], "storage": {"ftp_plain": True}})
    assert (
        "FTP_PLAIN=yes" in ftp_payload(plain, spec, "f", 2000, "alice", "pw", Path("/o"), {})["Env"]
    )


def test_the_start_email_says_ftps_and_carries_the_details() -> None:
    session = Session(
        key="k", user="alice", host="gpu1", template="pytorch", cuda=None,
        gpu_count=0, gpu_indices=(),
        start=NOW, end=NOW + DAY, ssh_port=20001, ftp_port=21001, ftp_passive_first=22000,
        ftp_passive_last=22009, state="running", output_dir=Path("/o/alice/x"),
        ftp_user="alice", ftp_password="pw",
    )  # fmt: skip
    _, body = start_message(session, "gpu1.example.org", "UTC", details="\nHOST KEYS HERE\n")
    assert "FTPS" in body and "ssl-force true" in body
    assert "\nHOST KEYS HERE\n" in body


def test_config_validate_says_when_quotas_cannot_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f"""
[daemon]
state_dir = "{tmp_path / "state"}"
[users]
keys_dir = "{tmp_path}"
[storage]
output_root = "/dev/shm/gpuresa-test-output"
session_quota = "100g"
"""
    )
    assert main(["config", "validate", "--config", str(config_file)]) == 0
    output = capsys.readouterr().out
    assert "warning: storage.session_quota is kept with a filesystem image" in output
    assert "tmpfs, which has no project quotas" in output


def test_host_credentials_are_made_once_even_by_many_at_once(tmp_path: Path) -> None:
    config = parse_config(
        {"daemon": {"state_dir": str(tmp_path / "state")}, "hosts": [{"name": "localhost"}]}
    )
    makers = [HostCredentials(config) for _ in range(8)]
    authorities = [HostCA(config) for _ in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        lines = list(pool.map(lambda ca: ca.public_line(223), authorities))
        files = list(pool.map(lambda maker: maker.tls_files(), makers))
    assert all(found == lines[0] for found in lines) and lines[0].startswith("ssh-ed25519 ")
    certificate, key = files[0]
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    private = serialization.load_pem_private_key(key.read_bytes(), None)
    public = x509.load_pem_x509_certificate(certificate.read_bytes()).public_key()
    assert private.public_key().public_numbers() == public.public_numbers()  # type: ignore[union-attr]
