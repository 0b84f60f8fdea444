"""`config validate` on this machine: the files, folders and secrets a config names.

Every check is shown accepting (a site where everything is there has no
problem) and rejecting (one thing taken away gives one problem, with its key
path). Files are real, in the test's folder; the systemd unit is a real unit
file read from a folder the test gives.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuresa.cli import main
from gpuresa.config.machine import machine_problems
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.config.unit_credentials import UnitCredentials, read_unit_credentials
from gpuresa.errors import ConfigError, UserError
from gpuresa.outputs.credentials import self_signed
from gpuresa.reservations.sources import grr_connection

ROOT = Path(__file__).parents[1]


@dataclass
class Site:
    """A config whose every file and folder exists under `folder`."""

    folder: Path
    credentials: Path

    @property
    def environment(self) -> dict[str, str]:
        return {"CREDENTIALS_DIRECTORY": str(self.credentials)}

    def text(self) -> str:
        folder = self.folder
        return f"""
[daemon]
host = "gpu1"
state_dir = "{folder / "state"}"
[[calendars]]
name = "lab"
url = "https://calendar.example.org/dav/lab/"
username = "gpuresa"
password_file = "{folder / "caldav-password"}"
host = "gpu1"
[[calendars]]
name = "feed"
kind = "ics"
url = "{folder / "feed"}"
username = "reader"
password_credential = "feed-password"
host = "gpu1"
[[hosts]]
name = "gpu1"
[templates]
directory = "{folder / "templates"}"
[users]
keys_dir = "{folder / "keys"}"
[storage]
output_root = "{folder / "disk" / "output"}"
ftp_tls_cert = "{folder / "ftp-cert.pem"}"
ftp_tls_key = "{folder / "ftp-key.pem"}"
[[storage.inputs]]
source = "{folder / "datasets"}"
target = "/data"
[notify]
enabled = true
security = "starttls"
ca_file = "{folder / "smtp-ca.pem"}"
username = "gpuresa"
password_file = "{folder / "smtp-password"}"
"""

    def config(self, text: str | None = None) -> Config:
        return parse_config(tomllib.loads(text or self.text()), "site.toml")


def no_unit() -> UnitCredentials:
    return UnitCredentials(None)


@pytest.fixture
def site(tmp_path: Path) -> Site:
    for name in ("feed", "templates", "keys", "disk", "datasets", "credentials"):
        (tmp_path / name).mkdir()
    for name in ("caldav-password", "smtp-password", "credentials/feed-password"):
        (tmp_path / name).write_text("s3cret\n")
    key, certificate = self_signed("gpu1.example.org")
    (tmp_path / "ftp-cert.pem").write_bytes(certificate)
    (tmp_path / "ftp-key.pem").write_bytes(key)
    (tmp_path / "smtp-ca.pem").write_bytes(certificate)
    return Site(tmp_path, tmp_path / "credentials")


def test_a_site_with_everything_in_place_has_no_problem(site: Site) -> None:
    assert machine_problems(site.config(), site.environment, no_unit) == []


# (what the test takes away or spoils, the key of the one problem, a fragment of it)
Spoil = Callable[[Path], None]


def remove(name: str) -> Spoil:
    def spoil(folder: Path) -> None:
        path = folder / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()

    return spoil


def replace_with_folder(name: str) -> Spoil:
    def spoil(folder: Path) -> None:
        (folder / name).unlink()
        (folder / name).mkdir()

    return spoil


def file_instead(name: str) -> Spoil:
    def spoil(folder: Path) -> None:
        (folder / name).rmdir()
        (folder / name).write_text("")

    return spoil


def overwrite(name: str, data: bytes) -> Spoil:
    def spoil(folder: Path) -> None:
        (folder / name).write_bytes(data)

    return spoil


@pytest.mark.parametrize(
    ("spoil", "key", "fragment"),
    [
        (remove("caldav-password"), "calendars[lab].password_file", "No such file"),
        (replace_with_folder("caldav-password"), "calendars[lab].password_file", "not a file"),
        (
            remove("credentials/feed-password"),
            "calendars[feed].password_credential",
            "LoadCredential=feed-password:/etc/gpuresa/feed-password",
        ),
        (remove("feed"), "calendars[feed].url", "does not exist"),
        (remove("smtp-password"), "notify.password_file", "No such file"),
        (remove("smtp-ca.pem"), "notify.ca_file", "No such file"),
        (overwrite("smtp-ca.pem", b"not a certificate\n"), "notify.ca_file", "no PEM"),
        (remove("datasets"), "storage.inputs[0].source", "datasets does not exist, so no"),
        (file_instead("datasets"), "storage.inputs[0].source", "datasets is not a folder"),
        (remove("keys"), "users.keys_dir", "keys does not exist"),
        (remove("disk"), "storage.output_root", "does not exist, so"),
        (remove("templates"), "templates.directory", "does not exist"),
        (remove("ftp-key.pem"), "storage.ftp_tls_key", "No such file"),
        (remove("ftp-cert.pem"), "storage.ftp_tls_cert", "No such file"),
        (
            overwrite("ftp-key.pem", self_signed("other.example.org")[0]),
            "storage.ftp_tls_cert",
            "private key",
        ),
    ],
)
def test_each_machine_check_rejects(site: Site, spoil: Spoil, key: str, fragment: str) -> None:
    spoil(site.folder)
    problems = machine_problems(site.config(), site.environment, no_unit)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{key}: "), problems
    assert fragment in problems[0]


def test_folders_the_daemon_makes_need_their_parent_only(site: Site) -> None:
    text = site.text().replace(str(site.folder / "state"), str(site.folder / "absent" / "state"))
    [problem] = machine_problems(site.config(text), site.environment, no_unit)
    assert problem.startswith(f"daemon.state_dir: {site.folder / 'absent'} does not exist")
    # a file where the output folder should be
    (site.folder / "disk" / "output").write_text("")
    [problem] = machine_problems(site.config(), site.environment, no_unit)
    assert problem == f"storage.output_root: {site.folder / 'disk' / 'output'} is not a folder"


def test_keys_dir_problem_says_who_could_still_log_in(site: Site) -> None:
    (site.folder / "keys").rmdir()
    [problem] = machine_problems(site.config(), site.environment, no_unit)
    assert "only logins with a host account" in problem
    text = site.text().replace("[users]\n", "[users]\nhost_authorized_keys = false\n")
    [problem] = machine_problems(site.config(text), site.environment, no_unit)
    assert "so no one could log in" in problem


def test_secrets_that_will_not_be_read_are_not_checked(site: Site) -> None:
    """A calendar without an account, and notices off, read no password."""
    for name in ("caldav-password", "smtp-password", "smtp-ca.pem"):
        (site.folder / name).unlink()
    text = site.text().replace('username = "gpuresa"\n', "").replace("enabled = true", "")
    assert machine_problems(site.config(text), site.environment, no_unit) == []


# --- credentials, from $CREDENTIALS_DIRECTORY or the installed unit ----------------------


def write_unit(folder: Path, body: str, drop_in: str | None = None) -> Path:
    """A gpuresa.service in `folder` (a unit directory), and a drop-in."""
    folder.mkdir(exist_ok=True)
    (folder / "gpuresa.service").write_text(
        f"[Unit]\nDescription=gpuresa\n[Service]\nExecStart=/usr/local/bin/gpuresa run\n{body}"
    )
    if drop_in is not None:
        (folder / "gpuresa.service.d").mkdir(exist_ok=True)
        (folder / "gpuresa.service.d" / "override.conf").write_text(f"[Service]\n{drop_in}")
    return folder


def unit_reader(*directories: Path) -> Callable[[], UnitCredentials]:
    return lambda: read_unit_credentials(directories, stores=(directories[0] / "credstore",))


def test_without_credentials_directory_the_unit_says_where_each_credential_comes_from(
    site: Site,
) -> None:
    units = site.folder / "units"
    secret = site.folder / "credentials" / "feed-password"
    # no unit installed: say where the credential is read and how systemd gives it
    [problem] = machine_problems(site.config(), {}, no_unit)
    assert problem.startswith("calendars[feed].password_credential: 'feed-password' is read")
    assert "$CREDENTIALS_DIRECTORY is not set" in problem
    assert "LoadCredential=feed-password:/etc/gpuresa/feed-password" in problem
    # a unit without its line
    write_unit(units, "LoadCredential=other:/nowhere\n")
    problems = machine_problems(site.config(), {}, unit_reader(units))
    assert any("has no LoadCredential=feed-password: line" in problem for problem in problems)
    # accepted: the unit's line names a file that is there
    write_unit(units, f"LoadCredential=feed-password:{secret}\n")
    assert machine_problems(site.config(), {}, unit_reader(units)) == []
    # rejected: the file the line names is missing
    write_unit(units, f"LoadCredential=feed-password:{site.folder / 'gone'}\n")
    [problem] = machine_problems(site.config(), {}, unit_reader(units))
    assert problem.startswith("calendars[feed].password_credential: cannot read")
    assert f"{units / 'gpuresa.service'}:5" in problem
    # a drop-in (`systemctl edit`) resets and gives the line again, with a file that is there
    write_unit(
        units,
        f"LoadCredential=feed-password:{site.folder / 'gone'}\n",
        drop_in=f"LoadCredential=\nLoadCredential=feed-password:{secret}\n",
    )
    assert machine_problems(site.config(), {}, unit_reader(units)) == []
    # a credential store (`LoadCredential=ID` with no path)
    shutil.rmtree(units / "gpuresa.service.d")
    write_unit(units, "LoadCredential=feed-password\n")
    [problem] = machine_problems(site.config(), {}, unit_reader(units))
    assert str(units / "credstore" / "feed-password") in problem
    (units / "credstore").mkdir()
    shutil.copy(secret, units / "credstore" / "feed-password")
    assert machine_problems(site.config(), {}, unit_reader(units)) == []


def test_a_unit_line_whose_file_is_missing_stops_the_service_even_if_unused(site: Site) -> None:
    units = write_unit(
        site.folder / "units",
        f"LoadCredential=feed-password:{site.folder / 'credentials' / 'feed-password'}\n"
        f"LoadCredential=smtp-login:{site.folder / 'no-smtp-password'}\n",
    )
    [problem] = machine_problems(site.config(), {}, unit_reader(units))
    assert problem.startswith(f"{units / 'gpuresa.service'}:6: LoadCredential=smtp-login: ")
    assert "does not start gpuresa.service without it" in problem
    # inside the service, systemd already loaded what it could: the unit is not read
    assert machine_problems(site.config(), site.environment, unit_reader(units)) == []


def test_calendars_are_named_the_same_by_validate_and_by_the_daemon(site: Site) -> None:
    text = site.text().replace('url = "https://calendar', 'kind = "grr"\nurl = "https://calendar')
    with pytest.raises(ConfigError) as caught:
        site.config(text)
    assert any(problem.startswith("calendars[lab].url: ") for problem in caught.value.problems)
    grr = (
        site.text()
        .replace(
            'url = "https://calendar.example.org/dav/lab/"\n',
            'kind = "grr"\nurl = "mysql://127.0.0.1:9/grr"\nrooms = { "GPU 1" = "gpu1" }\n',
        )
        .replace('host = "gpu1"\n[[calendars]]', "[[calendars]]", 1)
    )
    (site.folder / "caldav-password").unlink()
    [problem] = machine_problems(site.config(grr), site.environment, no_unit)
    assert problem.startswith("calendars[lab].password_file: cannot read")
    with pytest.raises(UserError, match=r"^calendars\[lab\]: cannot read secret file"):
        grr_connection.connect(site.config(grr).calendars[0], grr_connection.Deadline())
    # a name two calendars share names neither: the position does
    twice = site.text().replace('name = "feed"', 'name = "lab"')
    with pytest.raises(ConfigError) as caught:
        site.config(twice)
    assert "calendars[1].name: 'lab' is used by another calendar" in caught.value.problems


# --- hostile files ---------------------------------------------------------------------


def test_a_fifo_or_a_link_loop_as_a_secret_is_reported_without_hanging(site: Site) -> None:
    """A host user who can write where the admin points (a typo'd path in /tmp, say)."""
    (site.folder / "caldav-password").unlink()
    os.mkfifo(site.folder / "caldav-password")  # nobody ever writes to it
    (site.folder / "smtp-password").unlink()
    (site.folder / "smtp-password").symlink_to(site.folder / "smtp-password")
    started = time.monotonic()
    problems = machine_problems(site.config(), site.environment, no_unit)
    assert time.monotonic() - started < 5
    assert [problem.split(":")[0] for problem in problems] == [
        "calendars[lab].password_file",
        "notify.password_file",
    ]
    assert "is not a file" in problems[0]
    assert "symbolic links" in problems[1]


def test_a_garbled_unit_file_is_read_without_failing(site: Site) -> None:
    units = site.folder / "units"
    units.mkdir()
    (units / "gpuresa.service").write_bytes(
        b"\xff\xfe[Service\nLoadCredential\n=x\n[Service]\nLoadCredential=:\x00\n"
        + b"LoadCredential=feed-password:relative/name\n" * 3
    )
    problems = machine_problems(site.config(), {}, unit_reader(units))
    assert any(str(units / "credstore" / "relative/name") in problem for problem in problems)


def test_a_grr_socket_that_is_a_plain_file_is_reported(site: Site, tmp_path: Path) -> None:
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(tmp_path / "mysqld.sock"))
    try:
        grr = (
            site.text()
            .replace(
                'url = "https://calendar.example.org/dav/lab/"\n',
                'kind = "grr"\nurl = "mysql://localhost/grr"\nrooms = { "GPU 1" = "gpu1" }\n'
                f'unix_socket = "{tmp_path / "mysqld.sock"}"\n',
            )
            .replace('host = "gpu1"\n[[calendars]]', "[[calendars]]", 1)
        )
        assert machine_problems(site.config(grr), site.environment, no_unit) == []
        plain = grr.replace("mysqld.sock", "caldav-password")
        [problem] = machine_problems(site.config(plain), site.environment, no_unit)
        assert problem.startswith("calendars[lab].unix_socket: ")
    finally:
        listening.close()


# --- through the command -------------------------------------------------------------------


def as_user(uid: int, work: Callable[[], list[str]]) -> list[str]:
    """What `work` returns when run by `uid` (in a child process that drops root)."""
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's coverage is not collected
        try:
            os.close(reading)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(writing, json.dumps(work()).encode())
        except BaseException as error:
            os.write(writing, json.dumps([f"failed: {error!r}"]).encode())
        finally:
            os._exit(0)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        answer = pipe.read()
    os.waitpid(child, 0)
    result: list[str] = json.loads(answer)
    return result


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder another user can reach (pytest's own are root's alone); removed after."""
    folder = Path(tempfile.mkdtemp(prefix="gpuresa-validate-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def test_what_the_checking_user_cannot_read_or_reach_is_reported(
    site: Site, open_folder: Path
) -> None:
    """Whoever runs the check is told about a secret they cannot read (root's, 0600) and
    about folders they cannot reach, without a traceback."""
    secret = open_folder / "caldav-password"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    config = site.config(site.text().replace(str(site.folder / "caldav-password"), str(secret)))
    problems = as_user(65534, lambda: machine_problems(config, site.environment, no_unit))
    assert f"calendars[lab].password_file: cannot read {secret}: Permission denied" in problems
    # the site's other files are in pytest's folder, which only root may enter
    assert f"users.keys_dir: cannot reach {site.folder / 'keys'}: Permission denied" in " ".join(
        problems
    )


def test_validate_lists_every_problem_and_exits_1(
    site: Site, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = site.folder / "config.toml"
    config.write_text(site.text())
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(site.credentials))
    assert main(["config", "validate", "--config", str(config)]) == 0
    assert f"{config}: OK" in capsys.readouterr().out
    for name in ("datasets", "keys"):
        (site.folder / name).rmdir()
    (site.folder / "caldav-password").unlink()
    assert main(["config", "validate", "--config", str(config)]) == 1
    captured = capsys.readouterr()
    assert "OK" not in captured.out
    assert "3 problems in the configuration" in captured.err
    for key in ("calendars[lab].password_file", "storage.inputs[0].source", "users.keys_dir"):
        assert f"  - {key}: " in captured.err


def test_homes_need_a_kernel_with_idmapped_mounts_and_a_place_for_their_root(
    site: Site,
) -> None:
    from gpuresa.config.machine import _home_problems

    config = site.config()
    [problem] = _home_problems(config, "5.10.0-28-amd64")
    assert problem.startswith("storage.home_quota: ") and "5.10.0-28-amd64" in problem
    assert _home_problems(config, "5.12.0") == [] and _home_problems(config, "6.1.0-13") == []
    off = site.text().replace("[storage]\n", '[storage]\nhome_quota = "off"\n')
    assert _home_problems(site.config(off), "5.10.0") == []
    # a home root set where nothing can make it
    text = site.text().replace(
        "[storage]\n", f'[storage]\nhome_root = "{site.folder / "absent" / "homes"}"\n'
    )
    [problem] = machine_problems(site.config(text), site.environment, no_unit)
    assert problem.startswith(f"storage.home_root: {site.folder / 'absent'} does not exist")
