"""The output service's container as plain data: its accounts and its create payload.

Pure functions, like `gpuresa.sessions.labels` for sessions, so the tests pin
what the service is given (see `service.py` for why each setting is there).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from gpuresa.backends.engines.create_payloads import LOG_CONFIG
from gpuresa.config.sections import Config
from gpuresa.outputs.owners import Owner
from gpuresa.sessions.labels import INSTALLATION_LABEL

OUTPUTS_ROLE = "outputs"
PAYLOAD_LABEL = "gpuresa.payload-hash"
PORT_LABEL = "gpuresa.sftp-port"
SERVICE_PORT = 2222
OUTPUTS_TARGET = PurePosixPath("/outputs")
ACCOUNTS_TARGET = PurePosixPath("/etc/gpuresa-outputs")
HOST_KEYS_TARGET = PurePosixPath("/etc/gpuresa-host-keys")
# sshd: SETUID/SETGID (become the login), SYS_CHROOT (its chroot and the
# pre-auth one), KILL (the monitor signals its unprivileged child); CHOWN for
# the entrypoint alone and SETPCAP to drop both before sshd starts (from the
# bounding set: nothing started later gets them back). No DAC_OVERRIDE: root
# reads only its own files.
CAPABILITIES = ("CHOWN", "KILL", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT")
PIDS_LIMIT = 256
MEMORY_BYTES = 512 * 1024 * 1024


def probe_address(bind_address: str) -> str:
    """Where this host reaches a port published on `bind_address`."""
    if bind_address in ("0.0.0.0", ""):
        return "127.0.0.1"
    return "::1" if bind_address == "::" else bind_address


def service_name(host: str, installation: str) -> str:
    """The container's name: one per installation (two on one engine and one host name
    would otherwise take the same name)."""
    return f"gpuresa-{host}-outputs-{installation[:8]}"


def services_split(
    containers: Iterable[Mapping[str, Any]], installation: str, output_root: Path
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """(this installation's, another's) among a host's output service containers (`inspect`
    outputs).

    An installation's carries its label (`identity`). One without it was made before the
    label existed: this installation's when it serves this installation's output root, which
    another's never does (see `ownership` for the sessions' own rule).
    """
    mine: list[Mapping[str, Any]] = []
    others: list[Mapping[str, Any]] = []
    for container in containers:
        owner = (container.get("Config", {}).get("Labels") or {}).get(INSTALLATION_LABEL)
        if owner == installation or (not owner and _serves(container, output_root)):
            mine.append(container)
        else:
            others.append(container)
    return mine, others


def _serves(container: Mapping[str, Any], output_root: Path) -> bool:
    """Whether `container` binds `output_root` at /outputs (the `Mounts` of an `inspect`, as
    both engines show them: Podman leaves `HostConfig.Mounts` out)."""
    return any(
        mount.get("Destination") == str(OUTPUTS_TARGET) and mount.get("Source") == str(output_root)
        for mount in container.get("Mounts") or []
    )


def accounts_text(owners: Collection[Owner], privsep_uid: int) -> tuple[str, str]:
    """The /etc/passwd and /etc/group of the service for `owners` (pure)."""
    passwd = [
        "root:x:0:0:root:/root:/usr/sbin/nologin",
        f"sshd:x:{privsep_uid}:{privsep_uid}:sshd:/run/sshd:/usr/sbin/nologin",
    ]
    group = ["root:x:0:", f"sshd:x:{privsep_uid}:"]
    for owner in sorted(owners, key=lambda item: item.login):
        passwd.append(
            f"{owner.login}:x:{owner.uid}:{owner.gid}:gpuresa outputs:/:/usr/sbin/nologin"
        )
        group.append(f"{owner.login}:x:{owner.gid}:")
    return "\n".join(passwd) + "\n", "\n".join(group) + "\n"


def service_payload(
    config: Config, image: str, accounts: Path, host_keys: Path, labels: Mapping[str, str]
) -> dict[str, Any]:
    """The create payload of the output service (see the module docstring)."""
    host = config.host()
    storage = config.storage
    mounts = [
        {"Type": "bind", "Source": str(storage.output_root), "Target": str(OUTPUTS_TARGET),
         "ReadOnly": True},
        {"Type": "bind", "Source": str(accounts), "Target": str(ACCOUNTS_TARGET),
         "ReadOnly": True},
        {"Type": "bind", "Source": str(host_keys), "Target": str(HOST_KEYS_TARGET),
         "ReadOnly": True},
    ]  # fmt: skip
    return {
        "Image": image,
        "Cmd": [],
        # numeric: the engine reads no /etc/passwd (the image's is gpuresa's, mounted later)
        "User": "0:0",
        "Hostname": f"{config.daemon.host}-outputs"[:63],
        "Env": [],
        "Labels": dict(labels),
        "ExposedPorts": {f"{SERVICE_PORT}/tcp": {}},
        "HostConfig": {
            "UsernsMode": "host",
            "PortBindings": {
                f"{SERVICE_PORT}/tcp": [
                    {"HostIp": host.bind_address, "HostPort": str(storage.sftp_port)}
                ]
            },
            "Mounts": mounts,
            "Tmpfs": {"/run": "mode=0755,size=1m", "/tmp": "mode=1777,size=1m"},
            # not read-only: the entrypoint makes / and /etc root's (see entrypoint.sh)
            "ReadonlyRootfs": False,
            "CapDrop": ["ALL"],
            "CapAdd": list(CAPABILITIES),
            "SecurityOpt": ["no-new-privileges:true"],
            "Privileged": False,
            "Init": True,
            "RestartPolicy": {"Name": "unless-stopped"},
            # failed logins are logged: its log is capped as the sessions' are
            "LogConfig": LOG_CONFIG,
            "PidsLimit": PIDS_LIMIT,
            "Memory": MEMORY_BYTES,
        },
    }
