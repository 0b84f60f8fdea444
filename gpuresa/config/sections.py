"""The configuration: one TOML file read into frozen dataclasses.

`Config` is the whole file, `load_config`/`parse_config` read it. The sections
of the host side (hosts, templates, users, storage, limits, udocker, slurm) are
below; the calendar side is in `calendar_sections`, notify and telemetry in
`reporting_sections`, the checks across keys in `checks`.
`config.example.toml` documents each key with its default, and a test keeps the
two in step. Problems are collected, not raised one at a time, so an admin fixes
a file in one pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal, cast

from gpuresa.config.calendar_sections import CalendarConfig, DaemonConfig, ReservationsConfig
from gpuresa.config.names import NAME, valid_login_keys
from gpuresa.config.reporting_sections import NotifyConfig, TelemetryConfig
from gpuresa.config.rules_sections import RulesConfig
from gpuresa.config.schema import (
    Field,
    PortRange,
    Share,
    Size,
    at_least,
    matches,
    positive_duration,
    positive_or_unset,
)
from gpuresa.errors import UserError


def _gpu_indices(value: tuple[int, ...] | str) -> str | None:
    if isinstance(value, tuple):
        if any(index < 0 for index in value):
            return "GPU indices must be 0 or more"
        if len(set(value)) != len(value):
            return "GPU indices must not repeat"
    return None


def _names(value: tuple[str, ...]) -> str | None:
    import re

    for name in value:
        if not re.fullmatch(r"[A-Za-z0-9.:_-]+", name):
            return f"expected host names or addresses, got {name!r}"
    return None


# the default SSH ports of a host's sessions, and of a Slurm cluster's (see HostConfig)
SSH_PORTS = PortRange(223, 254)
CLUSTER_SSH_PORTS = PortRange(22223, 22254)


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
    # unset: the engine's own, set by __post_init__ (consumers never see None)
    gpu_mode: Literal["nvidia", "cdi", "devices", "none"] = Field(None)
    bind_address: str = "0.0.0.0"
    public_name: str | None = None
    # other names users reach the host by: its SSH host certificates name them too
    aliases: tuple[str, ...] = Field((), check=_names)
    # privileged ports (below 1024), which no host user can bind: see docs/ports.md;
    # unset: `SSH_PORTS`, or `CLUSTER_SSH_PORTS` on a cluster (set by __post_init__)
    ssh_ports: PortRange = Field(None)
    ftp_ports: PortRange = PortRange(255, 286)
    # FTP servers refuse passive ports at or below 1024; a data connection is safe
    # on a port anyone could bind because it must resume the control connection's
    # TLS session (see templates/ftp)
    ftp_passive_ports: PortRange = PortRange(24000, 24095)
    ftp_passive_per_session: int = Field(3, check=at_least(1))
    driver_libraries: tuple[Path, ...] = ()
    driver_binaries: tuple[Path, ...] = (Path("/usr/bin/nvidia-smi"),)
    # a firm session nobody logged into this long after its start is released, its GPUs
    # offered to others (a calendar's own `release_unused` wins); unset: never
    release_unused: timedelta | None = Field(None, check=positive_or_unset)

    def __post_init__(self) -> None:
        # None until here when the file leaves it unset (its type says what consumers see)
        if cast(object, self.gpu_mode) is None:
            # udocker has no device requests: its sessions get GPUs as device nodes
            default = "devices" if self.engine == "udocker" else "nvidia"
            object.__setattr__(self, "gpu_mode", default)
        if cast(object, self.ssh_ports) is None:
            # a Slurm job's sshd runs as the booking's login, which cannot bind a
            # privileged port: its own host key proves the session instead
            ports = CLUSTER_SSH_PORTS if self.engine == "slurm" else SSH_PORTS
            object.__setattr__(self, "ssh_ports", ports)


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
    # after a login's session comes up, unpack a spare container of its image for the
    # login's next session, which then starts without unpacking (see backends.udocker.spares)
    spare_containers: bool = True


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
    uids: Mapping[str, int] = Field(factory=dict, check=valid_login_keys)
    emails: Mapping[str, str] = Field(factory=dict, check=valid_login_keys)
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
    # each user's home that lasts between sessions (gpuresa/homes/): an image per login;
    # unset: "homes" beside output_root, on the disk kept for users' data
    home_root: Path | None = None
    home_quota: Size | Literal["off"] = Field(
        Size(10 << 30), check=lambda value: _at_least_size(value, 64 << 20)
    )
    home_retention: timedelta | Literal["forever"] = Field(
        timedelta(days=180), expected='a duration such as "180d", or "forever"'
    )
    home_removal_notice: timedelta = timedelta(days=14)


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
    `gpuresa.sessions.limits`); set, they apply to every session as they are.
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
class SlurmConfig:
    """[slurm]: a host of engine "slurm" is a cluster; see gpuresa/backends/slurm/."""

    timeout: timedelta = Field(timedelta(seconds=10), check=positive_duration)
    shared_dir: Path = Path("/var/lib/gpuresa/slurm")
    partition: str | None = Field(None, check=matches(NAME, "a partition name"))
    gres_reservations: Literal["auto", "yes", "no"] = "auto"
    start_timeout: timedelta = Field(timedelta(seconds=60), check=positive_duration)
    # what a session's job runs: the template's container with udocker, as the user, or
    # ("none") the node's own sshd
    container: Literal["udocker", "none"] = "udocker"


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
    rules: RulesConfig = RulesConfig()
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
