"""The create payloads of a session's two containers, as plain data: main and FTP sidecar.

Pure functions (no Docker, no files, no clock), so the tests pin the exact API
payload of each GPU mode and of the security settings. The runtime sends these
dictionaries as they are (`POST /containers/create`); the names and labels they
carry come from `payload`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gpuresa.config.sections import Config, HostConfig, LimitsConfig
from gpuresa.gpus.access import GpuAccess
from gpuresa.homes.paths import home_target
from gpuresa.model import SessionSpec
from gpuresa.sessions.labels import (
    FTP_ROLE,
    MAIN_ROLE,
    ROLE_LABEL,
    SESSION_FILES_TARGET,
    format_gpus,
    safe_key,
    session_name,
)
from gpuresa.sessions.limits import SessionLimits, ftp_limit_settings, limit_settings

SSH_CONTAINER_PORT = 22
FTP_CONTAINER_PORT = 2121
# where the session's own SSH host key and certificate appear (see outputs.host_ca)
HOST_KEYS_TARGET = PurePosixPath("/etc/ssh/gpuresa-host-keys")
FTP_TLS_TARGET = PurePosixPath("/etc/gpuresa-ftp/tls")

# What sshd, sudo and the entrypoint need, found by trying each one away:
# CHOWN (groupadd, useradd), SETUID/SETGID (sshd's privilege separation, sudo),
# SYS_CHROOT (sshd's pre-auth chroot), DAC_OVERRIDE/FOWNER (root through sudo
# reads and fixes the user's files), KILL (root signals the user's processes;
# gpuresa's own stop does). Not NET_BIND_SERVICE: Docker lets a container bind
# port 22 in its own network namespace; not AUDIT_WRITE: a user namespace
# cannot write the host's audit log anyway.
MAIN_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID", "SYS_CHROOT")
# vsftpd: CHOWN (groupadd at start), SETUID/SETGID (drop to the login), SYS_CHROOT.
FTP_CAPABILITIES = ("CHOWN", "SETGID", "SETUID", "SYS_CHROOT")
FTP_PIDS_LIMIT = 128
# What the engine keeps of a container's stdout and stderr, on its own disk and outside
# every quota: root in a session writes to /proc/1/fd/1 at will. Docker keeps two files
# of 10 MB at most (the current one and one rotated); Podman takes its "json-file" as
# its own k8s-file, honours max-size (conmon empties the file when it is reached) and
# ignores max-file. Enough for the last lines a failed start is told by (`readiness`).
LOG_MAX_SIZE = "10m"
LOG_MAX_FILES = 2
LOG_CONFIG: dict[str, Any] = {
    "Type": "json-file",
    "Config": {"max-size": LOG_MAX_SIZE, "max-file": str(LOG_MAX_FILES)},
}


def _bind(
    source: Path | PurePosixPath, target: Path | PurePosixPath, *, read_only: bool
) -> dict[str, Any]:
    return {"Type": "bind", "Source": str(source), "Target": str(target), "ReadOnly": read_only}


def _limits(limits: LimitsConfig) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "ShmSize": limits.shm_size.bytes,
        "PidsLimit": limits.pids,
    }
    if limits.cpus is not None:
        settings["NanoCpus"] = int(limits.cpus * 1_000_000_000)
    if limits.memory is not None:
        settings["Memory"] = limits.memory.bytes
    return settings


def resource_limits(limits: LimitsConfig) -> dict[str, Any]:
    """The HostConfig settings of `[limits]` as set (shared memory, processes, CPUs, memory).

    Sessions get their share of the host instead (see `runtime.limits`).
    """
    return _limits(limits)


def _environment(values: Mapping[str, str]) -> list[str]:
    return [f"{name}={value}" for name, value in sorted(values.items())]


@dataclass(frozen=True)
class MainContainer:
    """What the main container needs beyond the spec: gathered by the runtime."""

    image: str
    uid: int
    output_dir: Path
    session_files: Path
    command: tuple[str, ...] = ()
    gpu: GpuAccess = field(default_factory=GpuAccess)
    # what the engine adds to HostConfig (Podman: the session's own user namespace)
    engine_settings: Mapping[str, Any] = field(default_factory=dict)
    # the session's own SSH host key and certificate (its root reads them)
    host_keys_dir: Path | None = None
    # the session's CPUs and memory (see `runtime.limits`); None: `[limits]` as set
    limits: SessionLimits | None = None
    # the session's view of its user's lasting home (see `homes.store`); None: homes off
    home_dir: Path | None = None


def main_payload(
    config: Config, spec: SessionSpec, main: MainContainer, labels: Mapping[str, str]
) -> dict[str, Any]:
    """The create payload of a session's main container (sshd, the user's work).

    Mounts come from the config only (inputs read-only, the output folder
    read-write, the session's host-written files and driver files
    read-only); never privileged, never the Docker
    socket, every capability dropped but `MAIN_CAPABILITIES`. No
    no-new-privileges: it would stop sudo.
    """
    host = config.host(spec.host)
    network = session_name(spec.host, spec.key)
    inputs = config.storage.inputs
    environment = {
        "GPURESA_SESSION": spec.key,
        "GPURESA_USER": spec.user,
        "GPURESA_UID": str(main.uid),
        "GPURESA_TEMPLATE": spec.template,
        "GPURESA_CUDA": spec.cuda or "",
        "GPURESA_GPUS": format_gpus(spec.gpu_indices) or "none",
        "GPURESA_OUTPUT": str(config.storage.output_target),
        "GPURESA_INPUTS": ":".join(str(mount.target) for mount in inputs),
        **main.gpu.environment,
    }
    mounts = [
        *(_bind(mount.source, mount.target, read_only=True) for mount in inputs),
        _bind(main.output_dir, config.storage.output_target, read_only=False),
        _bind(main.session_files, SESSION_FILES_TARGET, read_only=True),
        *main.gpu.mounts,
    ]
    if main.home_dir is not None:
        mounts.append(_bind(main.home_dir, home_target(spec.user), read_only=False))
    if main.host_keys_dir is not None:
        mounts.append(_bind(main.host_keys_dir, HOST_KEYS_TARGET, read_only=True))
    host_config: dict[str, Any] = {
        "NetworkMode": network,
        "PortBindings": {
            f"{SSH_CONTAINER_PORT}/tcp": [
                {"HostIp": host.bind_address, "HostPort": str(spec.ssh_port)}
            ]
        },
        "Mounts": mounts,
        "Devices": main.gpu.devices,
        "DeviceRequests": main.gpu.device_requests,
        "CapDrop": ["ALL"],
        "CapAdd": list(MAIN_CAPABILITIES),
        "SecurityOpt": [],
        "Privileged": False,
        "Init": True,
        "RestartPolicy": {"Name": "no"},
        "LogConfig": LOG_CONFIG,
        **(
            _limits(config.limits)
            if main.limits is None
            else limit_settings(config.limits, main.limits)
        ),
        **main.engine_settings,
    }
    return {
        "Image": main.image,
        "Cmd": list(main.command),
        "Hostname": _hostname(spec),
        "Env": _environment(environment),
        "Labels": {**labels, ROLE_LABEL: MAIN_ROLE},
        "ExposedPorts": {f"{SSH_CONTAINER_PORT}/tcp": {}},
        "HostConfig": host_config,
        "NetworkingConfig": {"EndpointsConfig": {network: {"Aliases": ["session"]}}},
    }


def _hostname(spec: SessionSpec) -> str:
    """What users see in their prompt: `<host>-<template>`, a valid host name."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"{spec.host}-{spec.template}".lower()).strip("-")
    return name[:63].strip("-") or "session"


def passive_address(host: HostConfig) -> str:
    """The name or address FTP clients reach this host by: public name, else bound address.

    Empty when the ports are bound to every address and no public name is set.
    The runtime turns a name into an IPv4 address (PASV replies carry numbers).
    """
    if host.public_name:
        return host.public_name
    if host.bind_address in ("0.0.0.0", "::", ""):
        return ""
    return host.bind_address


def ftp_payload(
    config: Config,
    spec: SessionSpec,
    image: str,
    uid: int,
    ftp_user: str,
    ftp_password: str,
    output_dir: Path,
    labels: Mapping[str, str],
    announced_address: str = "",
    engine_settings: Mapping[str, Any] | None = None,
    tls_dir: Path | None = None,
) -> dict[str, Any]:
    """The create payload of a session's FTP sidecar (vsftpd on the output folder).

    With `tls_dir` (cert.pem and key.pem) it speaks explicit TLS, required
    unless storage.ftp_plain.

    The passive ports are published on the same numbers inside and out: the
    PASV reply names the port the server listens on, and `announced_address`
    (an IPv4 address; empty: vsftpd's own, which clients that trust the control
    connection's address, most of them, ignore). `engine_settings` are added
    to HostConfig (Podman: the main container's user namespace, forced).
    """
    host = config.host(spec.host)
    network = session_name(spec.host, spec.key)
    passive = range(spec.ftp_passive_first, spec.ftp_passive_last + 1)
    bindings = {
        f"{FTP_CONTAINER_PORT}/tcp": [
            {"HostIp": host.bind_address, "HostPort": str(spec.ftp_port)}
        ],
        **{
            f"{port}/tcp": [{"HostIp": host.bind_address, "HostPort": str(port)}]
            for port in passive
        },
    }
    environment = {
        "GPURESA_SESSION": safe_key(spec.key),
        "FTP_USER": ftp_user,
        "FTP_UID": str(uid),
        "FTP_PASSWORD": ftp_password,
        "FTP_PASSIVE_FIRST": str(spec.ftp_passive_first),
        "FTP_PASSIVE_LAST": str(spec.ftp_passive_last),
        "FTP_PASSIVE_ADDRESS": announced_address,
        "FTP_PLAIN": "yes" if config.storage.ftp_plain else "no",
    }
    mounts = [_bind(output_dir, PurePosixPath("/output"), read_only=False)]
    if tls_dir is not None:
        mounts.append(_bind(tls_dir, FTP_TLS_TARGET, read_only=True))
    return {
        "Image": image,
        "Cmd": [],
        "Hostname": "ftp",
        "Env": _environment(environment),
        "Labels": {**labels, ROLE_LABEL: FTP_ROLE},
        "ExposedPorts": {port: {} for port in bindings},
        "HostConfig": {
            "NetworkMode": network,
            "PortBindings": bindings,
            "Mounts": mounts,
            "Devices": [],
            "DeviceRequests": [],
            "CapDrop": ["ALL"],
            "CapAdd": list(FTP_CAPABILITIES),
            "SecurityOpt": ["no-new-privileges:true"],
            "Privileged": False,
            "Init": True,
            "RestartPolicy": {"Name": "no"},
            "LogConfig": LOG_CONFIG,
            "PidsLimit": FTP_PIDS_LIMIT,
            **ftp_limit_settings(),
            **(engine_settings or {}),
        },
        "NetworkingConfig": {"EndpointsConfig": {network: {"Aliases": ["ftp"]}}},
    }
