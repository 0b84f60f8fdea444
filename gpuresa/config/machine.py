"""Problems of the configuration on this machine: files, folders and secrets it names.

The schema (`gpuresa.config.reading`) says whether a file is well formed, and
reads the same anywhere, so the documented example parses in any test. What
is checked here depends on the machine: a password file that is not there, a
credential systemd will not give, an input folder that does not exist. The
daemon would fail on each of them later, one at a time, and often only when
a session starts; `gpuresa config validate` runs both kinds of check and
lists every problem at once, each with its key path.
"""

from __future__ import annotations

import os
import re
import ssl
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

from gpuresa.config.key_paths import name_calendars
from gpuresa.config.sections import Config
from gpuresa.config.unit_credentials import (
    UNIT_NAME,
    UnitCredentials,
    file_problem,
    kind_problem,
    read_unit_credentials,
)

UnitReader = Callable[[], UnitCredentials]


class _Unit:
    """The installed unit's credentials, read once and only if a check needs them."""

    def __init__(self, reader: UnitReader) -> None:
        self.reader = reader
        self.read: UnitCredentials | None = None

    def get(self) -> UnitCredentials:
        if self.read is None:
            self.read = self.reader()
        return self.read


def machine_problems(
    config: Config,
    environment: Mapping[str, str] | None = None,
    unit_reader: UnitReader = read_unit_credentials,
) -> list[str]:
    """Every problem of `config` on this machine, each with its key path.

    `environment` is this process's (for $CREDENTIALS_DIRECTORY) unless given;
    `unit_reader` finds the installed systemd unit's credentials. Never raises.
    """
    environment = os.environ if environment is None else environment
    unit = _Unit(unit_reader)
    problems: list[str] = []
    for index, calendar in enumerate(config.calendars):
        where = f"calendars[{index}]"
        # caldav and ics read a password only for an account; grr always has one
        if calendar.username is not None:
            problems.extend(
                _secret_problems(
                    where, calendar.password_file, calendar.password_credential, environment, unit
                )
            )
        url = Path(calendar.url)
        if calendar.kind == "ics" and url.is_absolute():
            problem = kind_problem(url, lambda mode: True, "file")
            if problem is not None:
                problems.append(f"{where}.url: {problem}")
        if calendar.unix_socket is not None:
            problem = kind_problem(calendar.unix_socket, stat.S_ISSOCK, "socket")
            if problem is not None:
                problems.append(f"{where}.unix_socket: {problem}")
    notify = config.notify
    if notify.enabled and notify.username is not None:
        problems.extend(
            _secret_problems(
                "notify", notify.password_file, notify.password_credential, environment, unit
            )
        )
    if notify.enabled and notify.security != "none" and notify.ca_file is not None:
        problems.extend(_ca_problems(notify.ca_file))
    problems.extend(_folder_problems(config))
    problems.extend(_home_problems(config, os.uname().release))
    storage = config.storage
    if storage.ftp_tls_cert is not None and storage.ftp_tls_key is not None:
        problems.extend(_certificate_problems(storage.ftp_tls_cert, storage.ftp_tls_key))
    if "CREDENTIALS_DIRECTORY" not in environment:
        problems.extend(_unit_problems(unit.get(), config))
    return name_calendars(problems, [calendar.name for calendar in config.calendars])


def _secret_problems(
    where: str,
    file: Path | None,
    credential: str | None,
    environment: Mapping[str, str],
    unit: _Unit,
) -> list[str]:
    """Whether the secret of `where` can be read where the daemon will read it."""
    if credential:
        return _credential_problems(where, credential, environment, unit)
    if file is not None:
        problem = file_problem(file)
        return [f"{where}.password_file: {problem}"] if problem else []
    return []


def _credential_problems(
    where: str, credential: str, environment: Mapping[str, str], unit: _Unit
) -> list[str]:
    key = f"{where}.password_credential"
    suggested = f"LoadCredential={credential}:/etc/gpuresa/{credential}"
    directory = environment.get("CREDENTIALS_DIRECTORY")
    if directory:
        # inside the service (or a shell that imitates it): the folder systemd filled
        problem = file_problem(Path(directory) / credential)
        if problem is None:
            return []
        return [
            f"{key}: {problem} ($CREDENTIALS_DIRECTORY); systemd puts it there from a "
            f"{suggested} line in {UNIT_NAME}"
        ]
    found = unit.get()
    if found.unit is None:
        return [
            f"{key}: {credential!r} is read from $CREDENTIALS_DIRECTORY/{credential}, which "
            f"systemd makes for the service from a {suggested} line of its unit; here "
            f"$CREDENTIALS_DIRECTORY is not set and no {UNIT_NAME} is installed (in "
            f"/etc/systemd/system): install gpuresa's unit with that line, or use password_file"
        ]
    source = found.sources.get(credential)
    if source is None:
        return [
            f"{key}: {found.unit} (and its drop-ins) has no LoadCredential={credential}: line, "
            f"so the service would have no {credential!r}: add {suggested} "
            f"(`systemctl edit gpuresa`), or use password_file"
        ]
    if source.file is None:
        return []  # SetCredential= gives it inline
    problem = file_problem(source.file)
    if problem is None:
        return []
    return [f"{key}: {problem} (its LoadCredential= line is at {source.line})"]


def _unit_problems(found: UnitCredentials, config: Config) -> list[str]:
    """Credential files the unit loads that are missing although the config does not use them
    (systemd will not start the service without them; the used ones are reported with their key)."""
    used = {calendar.password_credential for calendar in config.calendars}
    used.add(config.notify.password_credential)
    problems = []
    for name, source in sorted(found.sources.items()):
        if name in used or source.file is None:
            continue
        missing = kind_problem(source.file, lambda mode: True, "file")
        if missing is None:
            continue
        problems.append(
            f"{source.line}: LoadCredential={name}: {missing}, and systemd "
            f"does not start {UNIT_NAME} without it: create it, or remove the line "
            "(`systemctl edit gpuresa`) since the config does not use it"
        )
    return problems


def _folder_problems(config: Config) -> list[str]:
    problems = []
    for index, mount in enumerate(config.storage.inputs):
        problem = _folder(mount.source)
        if problem is not None:
            problems.append(
                f"storage.inputs[{index}].source: {problem}, so no session could start: "
                "create it, or remove this [[storage.inputs]]"
            )
    users = config.users
    problem = _folder(users.keys_dir)
    if problem is not None:
        who = (
            "only logins with a host account and a ~/.ssh/authorized_keys"
            if users.host_authorized_keys
            else "no one"
        )
        problems.append(
            f"users.keys_dir: {problem}, so {who} could log in to their sessions: create it "
            "(install -d -m 0750) and put each user's key in it as <login>.pub"
        )
    folders = [
        ("storage.output_root", config.storage.output_root),
        ("daemon.state_dir", config.daemon.state_dir),
    ]
    if config.storage.home_root is not None and config.storage.home_quota != "off":
        folders.append(("storage.home_root", config.storage.home_root))
    for key, folder in folders:
        problem = _folder(folder)
        if problem is None:
            continue
        if problem.endswith("does not exist"):
            # the daemon makes the folder, not the disk or the tree it should be on
            above = _folder(folder.parent)
            if above is None:
                continue
            problem = (
                f"{above}, so {folder} cannot be made: mount the disk meant for it or create it"
            )
        problems.append(f"{key}: {problem}")
    if config.templates.directory is not None:
        problem = _folder(config.templates.directory)
        if problem is not None:
            problems.append(f"templates.directory: {problem}")
    return problems


# idmapped mounts (`mount_setattr`): what shows each session its user's home
IDMAPPED_MOUNTS_SINCE = (5, 12)


def _home_problems(config: Config, kernel: str) -> list[str]:
    """Why the lasting homes would fail on a kernel of release `kernel`."""
    if config.storage.home_quota == "off" or all(h.engine == "slurm" for h in config.hosts):
        return []
    numbers = tuple(int(part) for part in re.findall(r"\d+", kernel)[:2])
    if len(numbers) == 2 and numbers < IDMAPPED_MOUNTS_SINCE:
        return [
            f"storage.home_quota: each session sees its user's home through an idmapped "
            f"mount, which needs Linux 5.12 or later (this kernel is {kernel}), so no session "
            'could start: set home_quota = "off" for sessions without a lasting home'
        ]
    return []


def _folder(path: Path) -> str | None:
    return kind_problem(path, stat.S_ISDIR, "folder")


def _ca_problems(ca_file: Path) -> list[str]:
    problem = file_problem(ca_file)
    if problem is not None:
        return [f"notify.ca_file: {problem}"]
    try:
        ssl.create_default_context(cafile=str(ca_file))
    except (OSError, ssl.SSLError) as error:
        return [f"notify.ca_file: {ca_file} holds no PEM certificate ({error})"]
    return []


def _certificate_problems(cert: Path, key: Path) -> list[str]:
    problems = [
        f"storage.{name}: {problem}"
        for name, path in (("ftp_tls_cert", cert), ("ftp_tls_key", key))
        if (problem := file_problem(path)) is not None
    ]
    if problems:
        return problems
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as error:
        return [
            f"storage.ftp_tls_cert: {cert} and {key} are no PEM certificate and its "
            f"private key ({error})"
        ]
    return []
