"""Whether the configured ports are safe from host users: warnings, never errors.

A port a host user can bind while no session holds it (between sessions, or
while the output service is being made again) lets that user answer in place of
gpuresa. Ports below `net.ipv4.ip_unprivileged_port_start` (1024 by default)
can only be bound by root, so gpuresa's default ranges lie below 1024. A host
whose sessions' SSH servers run as their logins (a Slurm job's, see
`Capabilities.ssh_as_login`) is the other way round: its ports must be
unprivileged, and the session's own host key proves it.
"""

from __future__ import annotations

from pathlib import Path

from gpuresa.config.capabilities import host_capabilities
from gpuresa.config.sections import Config

UNPRIVILEGED_START = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start")


def unprivileged_port_start(path: Path = UNPRIVILEGED_START) -> int:
    """The first port any user may bind on this machine (1024 when unreadable)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 1024


def port_warnings(config: Config, first_unprivileged: int | None = None) -> list[str]:
    """One warning per configured session or service port range a host user could bind.

    Given the config and the first unprivileged port (read from /proc when None).
    """
    start = unprivileged_port_start() if first_unprivileged is None else first_unprivileged
    why = (
        f"a host user can bind ports from {start} (net.ipv4.ip_unprivileged_port_start) "
        "and answer in place of gpuresa while no session holds them; use ports below "
        f"{start}"
    )
    warnings = []
    for index, host in enumerate(config.hosts):
        if host_capabilities(host).ssh_as_login:
            if host.ssh_ports.first < start:
                warnings.append(
                    f"hosts[{index}].ssh_ports: {host.ssh_ports} starts below {start}: the "
                    "sessions' sshd runs as the booking's login and cannot bind it; use "
                    f"ports from {start} up, as its default does (the session's own host "
                    "key proves the session there)"
                )
            continue
        # passive ports are left out: they cannot be privileged (FTP servers refuse
        # them) and a data connection is tied to its control connection's TLS session
        for name in ("ssh_ports", "ftp_ports"):
            ports = getattr(host, name)
            if ports.last >= start:
                warnings.append(f"hosts[{index}].{name}: {ports} is bindable: {why}")
    sftp = config.storage.sftp_port
    if sftp and sftp >= start:
        warnings.append(f"storage.sftp_port: {sftp} is bindable: {why}")
    return warnings
