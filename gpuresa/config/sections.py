"""The configuration: one TOML file read into frozen dataclasses.

Every section is a dataclass below; `config.example.toml` documents each key
with its default, and a test keeps the two in step. Problems are collected, not
raised one at a time, so an admin fixes a file in one pass.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from gpuresa.config.database import url_problem
from gpuresa.config.schema import (
    Field,
    Loader,
    PortRange,
    Share,
    Size,
    at_least,
    matches,
    positive_duration,
    valid_regex,
)
from gpuresa.errors import ConfigError, UserError

DEFAULT_CONFIG_PATH = Path("/etc/gpuresa/config.toml")
CONFIG_ENVIRONMENT_VARIABLE = "GPURESA_CONFIG"

NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}"
LOGIN = r"[a-z_][a-z0-9_-]{0,31}"


def _valid_timezone(value: str) -> str | None:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        return f"unknown time zone {value!r} (use an IANA name such as 'Europe/Paris')"
    return None


def _durations_positive(values: tuple[timedelta, ...]) -> str | None:
    if any(value <= timedelta(0) for value in values):
        return "every warning must be longer than 0s"
    return None


def _logins(values: tuple[str, ...]) -> str | None:
    import re

    bad = [value for value in values if not re.fullmatch(LOGIN, value)]
    return f"not valid logins: {', '.join(map(repr, bad))}" if bad else None


def _login_keys(values: Mapping[str, Any]) -> str | None:
    return _logins(tuple(values))


def _login_values(values: Mapping[str, str]) -> str | None:
    return _logins(tuple(values.values()))


def _room_hosts(values: Mapping[str, str]) -> str | None:
    import re

    bad = [value for value in values.values() if not re.fullmatch(NAME, value)]
    return f"not host names: {', '.join(map(repr, bad))}" if bad else None


def _gpu_indices(value: tuple[int, ...] | str) -> str | None:
    if isinstance(value, tuple):
        if any(index < 0 for index in value):
            return "GPU indices must be 0 or more"
        if len(set(value)) != len(value):
            return "GPU indices must not repeat"
    return None


def _at_least_a_day(value: timedelta) -> str | None:
    # the journal must remember what the calendars' window still shows
    return None if value >= timedelta(days=1) else "must be at least 1d"


@dataclass(frozen=True)
class DaemonConfig:
    """[daemon]: this machine's role and the service's timing."""

    host: str = Field("localhost", check=matches(NAME, "a host name"))
    state_dir: Path = Path("/var/lib/gpuresa")
    poll_interval: timedelta = Field(timedelta(seconds=30), check=positive_duration)
    prepare_ahead: timedelta = timedelta(minutes=5)
    stop_grace: timedelta = timedelta(seconds=30)
    cancel_grace: timedelta = timedelta(minutes=5)
    # a poll that loses most bookings with a session is believed only after this long
    vanish_confirm: timedelta = Field(timedelta(minutes=15), check=positive_duration)
    orphan_grace: timedelta = timedelta(minutes=10)
    warnings: tuple[timedelta, ...] = Field(
        (timedelta(minutes=15), timedelta(minutes=5)), check=_durations_positive
    )
    docker_retry_max: timedelta = Field(timedelta(minutes=1), check=positive_duration)
    journal_retention: timedelta = Field(timedelta(days=180), check=_at_least_a_day)


@dataclass(frozen=True)
class ReservationsConfig:
    """[reservations]: how calendar events become reservations, site-wide."""

    timezone: str = Field("UTC", check=_valid_timezone)
    window_past: timedelta = timedelta(days=1)
    window_ahead: timedelta = Field(timedelta(days=14), check=positive_duration)
    max_duration: timedelta = Field(timedelta(days=7), check=positive_duration)
    allowed_users: tuple[str, ...] = Field((), check=_logins)


@dataclass(frozen=True)
class CalendarConfig:
    """[[calendars]]: one calendar source and the rules that read its events."""

    name: str = Field(check=matches(NAME, "a name of letters, digits, '.', '_' or '-'"))
    url: str = Field(check=matches(r"\S+", "a URL or an absolute path"))
    kind: Literal["caldav", "ics", "grr"] = "caldav"
    username: str | None = None
    password_file: Path | None = None
    password_credential: str | None = None
    auth: Literal["basic", "digest"] = "basic"
    verify_tls: bool = True
    host: str | None = Field(None, check=matches(NAME, "a host name"))
    accept_tentative: bool = False
    user_from: Literal["summary", "organizer", "attendee"] = "summary"
    summary_regex: str | None = Field(None, check=valid_regex)
    email_logins: Mapping[str, str] = Field(factory=dict, check=_login_values)
    default_template: str | None = None
    default_cuda: str | None = None
    default_gpus: int = Field(1, check=at_least(1))
    # kind "grr" only (GRR's MySQL/MariaDB database; see gpuresa.reservations.sources.grr)
    unix_socket: Path | None = None
    table_prefix: str = Field("grr_", check=matches(r"[A-Za-z0-9_]{0,32}", "letters, digits, '_'"))
    rooms: Mapping[str, str] = Field(factory=dict, check=_room_hosts)


def _names(value: tuple[str, ...]) -> str | None:
    import re

    for name in value:
        if not re.fullmatch(r"[A-Za-z0-9.:_-]+", name):
            return f"expected host names or addresses, got {name!r}"
    return None


@dataclass(frozen=True)
class HostConfig:
    """[[hosts]]: one GPU server, its GPUs and the ports its sessions may use."""

    name: str = Field(check=matches(NAME, "a host name"))
    engine: Literal["docker", "podman", "udocker", "slurm"] = "docker"
    engine_socket: str | None = Field(
        None, check=matches(r"(unix|tcp|ssh)://\S+", "a URL such as unix:///run/podman/podman.sock")
    )
    gpus: tuple[int, ...] | Literal["auto"] = Field(
        "auto", check=_gpu_indices, expected='a list of GPU indices or "auto"'
    )
    gpu_mode: Literal["nvidia", "cdi", "devices", "none"] = "nvidia"
    bind_address: str = "0.0.0.0"
    public_name: str | None = None
    # other names users reach the host by: its SSH host certificates name them too
    aliases: tuple[str, ...] = Field((), check=_names)
    # privileged ports (below 1024), which no host user can bind: see README "Ports"
    ssh_ports: PortRange = PortRange(223, 254)
    ftp_ports: PortRange = PortRange(255, 286)
    ftp_passive_ports: PortRange = PortRange(287, 382)
    ftp_passive_per_session: int = Field(3, check=at_least(1))
    driver_libraries: tuple[Path, ...] = ()
    driver_binaries: tuple[Path, ...] = (Path("/usr/bin/nvidia-smi"),)


@dataclass(frozen=True)
class UdockerConfig:
    """[udocker]: how hosts with engine = "udocker" run sessions as their users, without a
    root engine (see gpuresa/backends/udocker)."""

    # the interpreter users run udocker with (gpuresa's own may not be readable by them)
    python: Path = Path("/usr/bin/python3")
    runc: Path = Path("/usr/sbin/runc")
    # gpuresa's udocker folder, which users traverse (state_dir is root's alone):
    # default <state_dir>-udocker, next to it
    root: Path | None = None
    # each login's udocker repository: <repositories>/<login> (default <root>/users)
    repositories: Path | None = None
    # who builds the templates' images before they are saved and loaded into udocker
    image_engine: Literal["docker", "podman", "none"] = "docker"
    image_engine_socket: str | None = Field(
        None, check=matches(r"(unix|tcp|ssh)://\S+", "a URL such as unix:///run/podman/podman.sock")
    )
    # image archives (docker/podman save, OCI) by "template" or "template:cuda"
    images: Mapping[str, Path] = Field(factory=dict)


@dataclass(frozen=True)
class TemplatesConfig:
    """[templates]: which session templates exist and which bookings may use."""

    directory: Path | None = None
    allowed: tuple[str, ...] = ("tensorflow", "digits", "pytorch")
    base_image: str | None = None
    image_prefix: str = "gpuresa"


@dataclass(frozen=True)
class UsersConfig:
    """[users]: logins, their keys, uids and e-mail addresses."""

    keys_dir: Path = Path("/etc/gpuresa/keys")
    host_authorized_keys: bool = True
    uid_base: int = Field(20000, check=at_least(1000))
    uids: Mapping[str, int] = Field(factory=dict, check=_login_keys)
    emails: Mapping[str, str] = Field(factory=dict, check=_login_keys)
    email_domain: str | None = None


@dataclass(frozen=True)
class InputMount:
    """[[storage.inputs]]: a host folder mounted read-only in every session."""

    source: Path
    target: Path


_FREE_SPACE = 'a size such as "20g" or a share such as "5%"'


@dataclass(frozen=True)
class StorageConfig:
    """[storage]: input folders, where each session's output is kept, and for how long."""

    inputs: tuple[InputMount, ...] = ()
    output_root: Path = Path("/srv/gpuresa/output")
    output_pattern: str = Field(
        "{user}/{start:%Y%m%d-%H%M}-{key}",
        check=matches(r"[^/].*", "a relative path pattern"),
    )
    output_target: Path = Path("/output")
    hand_output_to_user: bool = True
    # the output service and its rules live in gpuresa/outputs/
    output_retention: timedelta | Literal["forever"] = Field(
        timedelta(days=7), expected='a duration such as "7d", or "forever"'
    )
    output_removal_notice: timedelta = timedelta(days=1)
    output_uid_base: int = Field(1_500_000_000, check=at_least(65536))
    sftp_port: int = Field(222, check=lambda value: _port_or_off(value))
    ftp_plain: bool = False
    ftp_tls_cert: Path | None = None
    ftp_tls_key: Path | None = None
    # thresholds of free space on the output disk, read once here (see outputs.disk)
    free_warn: Size | Share = Field(Share(0.10), expected=_FREE_SPACE)
    free_refuse: Size | Share = Field(Share(0.03), expected=_FREE_SPACE)
    session_quota: str | None = Field("auto", check=lambda value: _quota(value))


def _port_or_off(value: int) -> str | None:
    return None if 0 <= value <= 65535 else f"expected a port (1-65535) or 0 for off, got {value}"


def _fraction_below_one(value: Size | Share) -> str | None:
    if isinstance(value, Share) and value.fraction >= 1:
        return "must be less than 100% (the host keeps the reserve)"
    return None


@dataclass(frozen=True)
class LimitsConfig:
    """[limits]: resources each session container may use.

    Unset `cpus` and `memory` give each session the host's CPUs and memory,
    less the reserve, in proportion to the GPUs it booked (see
    `gpuresa.runtime.limits`); set, they apply to every session as they are.
    """

    cpus: float | None = Field(None, check=lambda value: _positive_cpus(value))
    memory: Size | None = Field(None, check=lambda value: _at_least_size(value, 16 << 20))
    reserve_cpus: float = Field(1.0, check=at_least(0))
    reserve_memory: Size | Share = Field(Share(0.10), check=_fraction_below_one)
    shm_size: Size = Size(8 << 30)
    pids: int = Field(4096, check=at_least(64))
    # each session's writable layer (what it writes outside its mounts); "off" for none
    layer_size: Size | Literal["off"] = Field(
        Size(30 << 30), check=lambda value: _at_least_size(value, 64 << 20)
    )


def _positive_cpus(value: float | None) -> str | None:
    return None if value is None or value >= 0.01 else "must be at least 0.01"


def _at_least_size(value: object, minimum: int) -> str | None:
    if isinstance(value, Size) and value.bytes < minimum:
        return f"must be at least {Size(minimum)}"
    return None


def _quota(value: str | None) -> str | None:
    if value is not None and value.lower() in ("auto", "none"):
        return None
    return _size(value)


def _size(value: str | None) -> str | None:
    if value is None:
        return None
    return matches(r"\d+[bkmgt]?", 'a size such as "8g" or "512m"')(value.lower())


@dataclass(frozen=True)
class NotifyConfig:
    """[notify]: e-mail to users through an SMTP server."""

    enabled: bool = False
    smtp_host: str = "localhost"
    smtp_port: int = Field(25, check=at_least(1))
    security: Literal["none", "starttls", "tls"] = "none"
    ca_file: Path | None = None
    username: str | None = None
    password_file: Path | None = None
    password_credential: str | None = None
    sender: str = "gpuresa@localhost"
    admin: str | None = None
    timeout: timedelta = Field(timedelta(seconds=20), check=positive_duration)
    give_up_after: timedelta = Field(timedelta(days=3), check=positive_duration)


def _listen_address(value: str | None) -> str | None:
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f'expected "address:port" such as "127.0.0.1:9464", got {value!r}'
    return None


def _percent(value: int) -> str | None:
    return None if 0 <= value <= 100 else "a percentage from 0 to 100"


@dataclass(frozen=True)
class TelemetryConfig:
    """[telemetry]: GPU sampling, use per booking, idle and unbooked GPUs, metrics, status page."""

    backend: Literal["auto", "nvml", "nvidia-smi", "none"] = "auto"
    sample_interval: timedelta = Field(timedelta(minutes=1), check=positive_duration)
    idle_threshold: int = Field(5, check=_percent)
    idle_after: timedelta = Field(timedelta(hours=2), check=positive_duration)
    idle_action: Literal["notify", "notify-admin"] = "notify"
    report_unbooked: bool = True
    recreate_lost: bool = True
    listen: str | None = Field(None, check=_listen_address)
    page_days: int = Field(3, check=at_least(1))
    job_mapping_dir: Path | None = None


@dataclass(frozen=True)
class SlurmConfig:
    """[slurm]: a host of engine "slurm" is a cluster; see gpuresa/backends/slurm/."""

    timeout: timedelta = Field(timedelta(seconds=10), check=positive_duration)
    shared_dir: Path = Path("/var/lib/gpuresa/slurm")
    partition: str | None = Field(None, check=matches(NAME, "a partition name"))
    gres_reservations: Literal["auto", "yes", "no"] = "auto"
    start_timeout: timedelta = Field(timedelta(seconds=60), check=positive_duration)


@dataclass(frozen=True)
class Config:
    """The whole configuration file."""

    daemon: DaemonConfig = DaemonConfig()
    reservations: ReservationsConfig = ReservationsConfig()
    calendars: tuple[CalendarConfig, ...] = ()
    hosts: tuple[HostConfig, ...] = ()
    templates: TemplatesConfig = TemplatesConfig()
    users: UsersConfig = UsersConfig()
    storage: StorageConfig = StorageConfig()
    limits: LimitsConfig = LimitsConfig()
    udocker: UdockerConfig = UdockerConfig()
    notify: NotifyConfig = NotifyConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    slurm: SlurmConfig = SlurmConfig()
    source: str = Field("<defaults>", expected="(set by the loader)")

    def host(self, name: str | None = None) -> HostConfig:
        """The [[hosts]] entry named `name` (default: this daemon's host)."""
        wanted = name or self.daemon.host
        for host in self.hosts:
            if host.name == wanted:
                return host
        raise UserError(f"no [[hosts]] entry is named {wanted!r} in {self.source}")

    def calendar(self, name: str) -> CalendarConfig:
        for calendar in self.calendars:
            if calendar.name == name:
                return calendar
        known = ", ".join(calendar.name for calendar in self.calendars) or "none"
        raise UserError(f"no calendar is named {name!r} (configured: {known})")


def _cross_checks(config: Config) -> list[str]:
    """Problems that involve more than one key."""
    problems = []
    host_names = [host.name for host in config.hosts]
    for index, name in enumerate(host_names):
        if name in host_names[:index]:
            problems.append(f"hosts[{index}].name: {name!r} is used by another host")
    calendar_names = [calendar.name for calendar in config.calendars]
    for index, name in enumerate(calendar_names):
        if name in calendar_names[:index]:
            problems.append(f"calendars[{index}].name: {name!r} is used by another calendar")
    if config.hosts and config.daemon.host not in host_names:
        problems.append(
            f"daemon.host: {config.daemon.host!r} is not one of the [[hosts]] "
            f"({', '.join(host_names)})"
        )
    for index, calendar in enumerate(config.calendars):
        if calendar.host is not None and calendar.host not in host_names:
            problems.append(
                f"calendars[{index}].host: {calendar.host!r} is not one of the [[hosts]]"
            )
        if (
            calendar.kind == "ics"
            and calendar.url.startswith("/") is False
            and not (calendar.url.startswith("http://") or calendar.url.startswith("https://"))
        ):
            problems.append(
                f"calendars[{index}].url: an ics calendar needs an absolute path or an "
                f"http(s) URL, got {calendar.url!r}"
            )
        if calendar.kind == "caldav" and not calendar.url.startswith(("http://", "https://")):
            problems.append(
                f"calendars[{index}].url: a caldav calendar needs an http(s) URL, "
                f"got {calendar.url!r}"
            )
        problems.extend(_grr_checks(index, calendar, host_names))
    for index, host in enumerate(config.hosts):
        ranges = {
            "ssh_ports": host.ssh_ports,
            "ftp_ports": host.ftp_ports,
            "ftp_passive_ports": host.ftp_passive_ports,
        }
        names = list(ranges)
        for position, first in enumerate(names):
            for second in names[position + 1 :]:
                if ranges[first].overlaps(ranges[second]):
                    problems.append(
                        f"hosts[{index}].{second}: overlaps {first} "
                        f"({ranges[second]} and {ranges[first]})"
                    )
        if host.engine == "podman" and host.gpu_mode == "nvidia":
            problems.append(
                f"hosts[{index}].gpu_mode: Podman has no NVIDIA device requests; "
                'use "cdi" (NVIDIA Container Toolkit\'s CDI spec) or "devices"'
            )
        if host.engine == "udocker" and host.gpu_mode in ("nvidia", "cdi"):
            problems.append(
                f"hosts[{index}].gpu_mode: udocker sessions get GPUs as device nodes only; "
                'use "devices" or "none"'
            )
        if len(host.ftp_passive_ports) < host.ftp_passive_per_session:
            problems.append(
                f"hosts[{index}].ftp_passive_ports: fewer ports than "
                f"ftp_passive_per_session ({host.ftp_passive_per_session})"
            )
    problems.extend(_storage_checks(config))
    for index, mount in enumerate(config.storage.inputs):
        if mount.target == config.storage.output_target:
            problems.append(
                f"storage.inputs[{index}].target: {mount.target} is the output folder's target"
            )
    return problems


def _grr_checks(index: int, calendar: CalendarConfig, host_names: list[str]) -> list[str]:
    """Problems of a calendar of kind "grr" (its database, its rooms), or of GRR-only keys."""
    where = f"calendars[{index}]"
    if calendar.kind != "grr":
        grr_only = [key for key in ("unix_socket", "rooms") if getattr(calendar, key)]
        return [f'{where}.{key}: only for a calendar of kind "grr"' for key in grr_only]
    problems = []
    problem = url_problem(calendar.url)
    if problem is not None:
        problems.append(f"{where}.url: {problem}")
    if calendar.username is None:
        problems.append(f"{where}.username: a grr calendar needs the database account's name")
    if calendar.password_file is None and calendar.password_credential is None:
        problems.append(f"{where}.password_file: set it or password_credential (the account's)")
    if calendar.host is not None:
        problems.append(f"{where}.host: a grr calendar gives each room's host in rooms")
    if calendar.user_from == "attendee":
        problems.append(f'{where}.user_from: "summary" or "organizer" for a grr calendar')
    if not calendar.rooms:
        problems.append(
            f'{where}.rooms: which GRR rooms are which hosts, e.g. {{ "GPU 1" = "gpu1" }}'
        )
    for room, host in calendar.rooms.items():
        if host not in host_names:
            problems.append(f"{where}.rooms.{room}: {host!r} is not one of the [[hosts]]")
        if room.startswith("#") and not room[1:].isdigit():
            problems.append(f"{where}.rooms.{room}: '#' and a room id (digits), or a room name")
    return problems


def _storage_checks(config: Config) -> list[str]:
    """[storage] problems that involve more than one key (see gpuresa/outputs/)."""
    storage = config.storage
    problems = []
    if storage.sftp_port and not storage.output_pattern.startswith("{user}/"):
        problems.append(
            'storage.output_pattern: must start with "{user}/" so that the output service '
            "can confine each login to its own folder (or set storage.sftp_port = 0)"
        )
    for index, host in enumerate(config.hosts):
        for name in ("ssh_ports", "ftp_ports", "ftp_passive_ports"):
            if storage.sftp_port in getattr(host, name):
                problems.append(
                    f"storage.sftp_port: {storage.sftp_port} is in hosts[{index}].{name}"
                )
    if (storage.ftp_tls_cert is None) != (storage.ftp_tls_key is None):
        problems.append("storage.ftp_tls_cert and storage.ftp_tls_key: set both or neither")
    # a share and a size compare only on a given disk: checked when both are of a kind
    refuse, warn = storage.free_refuse, storage.free_warn
    shares = isinstance(refuse, Share) and isinstance(warn, Share) and refuse > warn
    sizes = isinstance(refuse, Size) and isinstance(warn, Size) and refuse > warn
    if shares or sizes:
        problems.append(
            f"storage.free_refuse: '{refuse}' is more than storage.free_warn "
            f"('{warn}'); sessions would be refused before anyone is warned"
        )
    return problems


def parse_config(data: Mapping[str, Any], source: str = "<config>") -> Config:
    """Build a `Config` from parsed TOML; raises `ConfigError` listing every problem."""
    loader = Loader()
    if "source" in data:
        loader.problem("source", "unknown key")
    document = dict(data)
    document["source"] = source
    config = loader.load(Config, document)
    if config is not None:
        loader.problems.extend(_cross_checks(config))
    if loader.problems or config is None:
        raise ConfigError(source, loader.problems)
    return config


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The config file to read: --config, else $GPURESA_CONFIG, else the default."""
    if explicit:
        return Path(explicit)
    from_environment = os.environ.get(CONFIG_ENVIRONMENT_VARIABLE)
    if from_environment:
        return Path(from_environment)
    return DEFAULT_CONFIG_PATH


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and check the config file; raises `UserError`/`ConfigError` with advice."""
    file = config_path(path)
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise UserError(
            f"{file}: no such config file; copy one from `gpuresa config example` "
            f"or pass --config PATH (or set {CONFIG_ENVIRONMENT_VARIABLE})"
        ) from None
    except OSError as error:
        raise UserError(f"{file}: cannot read the config file: {error.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(str(file), [f"not UTF-8 text ({error.reason})"]) from None
    except tomllib.TOMLDecodeError as error:
        # tomllib's message already names the line and column
        raise ConfigError(str(file), [f"TOML syntax error: {error}"]) from None
    return parse_config(data, str(file))


def read_secret(
    key_path: str, file: Path | None, credential: str | None, *, required: bool = True
) -> str | None:
    """A password from a file or a systemd credential, never from the config itself.

    `credential` names a file in $CREDENTIALS_DIRECTORY (systemd's LoadCredential=).
    Returns None when neither is set and `required` is false; raises `UserError`
    naming `key_path` otherwise.
    """
    if credential:
        directory = os.environ.get("CREDENTIALS_DIRECTORY")
        if not directory:
            raise UserError(
                f"{key_path}: credential {credential!r} is configured but "
                "$CREDENTIALS_DIRECTORY is not set (use LoadCredential= in the systemd unit, "
                "or a password_file)"
            )
        file = Path(directory) / credential
    if file is None:
        if required:
            raise UserError(f"{key_path}: no password_file or password_credential is set")
        return None
    try:
        return file.read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as error:
        raise UserError(f"{key_path}: cannot read secret file {file}: {error.strerror}") from None


def example_text() -> str:
    """The documented example configuration (`config.example.toml`)."""
    packaged = Path(__file__).parents[1] / "config.example.toml"
    if packaged.exists():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).parents[2] / "config.example.toml").read_text(encoding="utf-8")
