"""Problems of the configuration that involve more than one key."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuresa.config.calendar_sections import CalendarConfig, write_back_checks
from gpuresa.config.database import url_problem
from gpuresa.config.schema import Share, Size

if TYPE_CHECKING:
    # sections.py checks a Config with these functions once it is built
    from gpuresa.config.sections import Config


def cross_checks(config: Config) -> list[str]:
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
        problems.extend(write_back_checks(f"calendars[{index}]", calendar))
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
        if host.engine in ("docker", "podman") and host.ftp_passive_ports.first <= 1024:
            # vsftpd silently ignores a passive range at or below 1024 and takes a random
            # port that nobody published: every data connection would be refused
            problems.append(
                f"hosts[{index}].ftp_passive_ports: {host.ftp_passive_ports} starts at or "
                "below 1024, which the FTP server cannot use for passive data connections; "
                "use ports from 1025 up, below net.ipv4.ip_local_port_range"
            )
        if len(host.ftp_passive_ports) < host.ftp_passive_per_session:
            problems.append(
                f"hosts[{index}].ftp_passive_ports: fewer ports than "
                f"ftp_passive_per_session ({host.ftp_passive_per_session})"
            )
    problems.extend(_storage_checks(config))
    notify = config.notify
    if (
        notify.enabled
        and notify.username
        and not (notify.password_file or notify.password_credential)
    ):
        problems.append(
            "notify.username: the SMTP login needs notify.password_file or "
            "notify.password_credential (or remove username to send without a login)"
        )
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


def uncapped_output_warnings(config: Config) -> list[str]:
    """The hosts whose sessions' outputs `storage.session_quota` cannot cap, each with its
    key paths; none when session_quota is "none".

    A udocker session writes its output as its login, on the host, in the
    login's own folder: no project quota or image binds it (docs/udocker.md,
    "What is not capped").
    """
    quota = (config.storage.session_quota or "none").strip().lower()
    if quota == "none":
        return []
    return [
        f"storage.session_quota ({config.storage.session_quota!r}) is not enforced on "
        f"hosts[{index}] ({host.name!r}, engine udocker): its sessions write their outputs "
        'as their logins, on the host, uncapped (docs/udocker.md, "What is not capped"); '
        'where every host is a udocker one, set storage.session_quota = "none"'
        for index, host in enumerate(config.hosts)
        if host.engine == "udocker"
    ]
