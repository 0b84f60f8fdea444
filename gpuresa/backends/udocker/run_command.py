"""The `udocker run` of a session's container, as a udocker host and a Slurm job both start it.

The container gets the session's files (read-only), gpuresa's scripts
(read-only), the site's inputs (read-only), the output (read-write) and any
other folders given; its first process is gpuresa's `session.sh` with the
template's command. The launcher (`scripts/launcher.py`) makes the read-only
mounts read-only and sizes /dev/shm, from the environment returned here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gpuresa.access import Account
from gpuresa.backends.udocker import launch, tools
from gpuresa.backends.udocker.cgroups import SessionCgroup
from gpuresa.backends.udocker.devices import driver_volumes
from gpuresa.backends.udocker.records import Record
from gpuresa.backends.udocker.sockets import host_tool_folder
from gpuresa.config.sections import Config
from gpuresa.gpus.access import GpuAccess
from gpuresa.homes.paths import enabled as homes_enabled
from gpuresa.homes.paths import home_target, view_path
from gpuresa.sessions.labels import SESSION_FILES_TARGET
from gpuresa.sessions.templates import resolve_template

# where gpuresa's scripts are in every session's container
SCRIPTS_TARGET = PurePosixPath("/opt/gpuresa-udocker")


@dataclass(frozen=True)
class RunCommand:
    """`head + tail` runs the container; options only the caller knows (a Slurm job's GPUs)
    go between the two. `environment`: what udocker runs in."""

    head: list[str]
    tail: list[str]
    environment: dict[str, str]


def session_run(
    config: Config,
    account: Account,
    key: str,
    template: str,
    cuda: str | None,
    container: str,
    files: Path,
    output: Path,
    *,
    volumes: Sequence[tuple[str, str, bool]] = (),
    devices: Sequence[str] = (),
    values: Mapping[str, str] = {},
) -> RunCommand:
    """The `udocker run` of session `key`'s `container` (as `account`), with its session
    `files` and `output` folders, more read-only `volumes` (source, target, read-only),
    `devices` (host paths) and environment `values` inside."""
    storage = config.storage
    chosen, _ = resolve_template(config.templates, template, cuda)
    bound = [(str(files), str(SESSION_FILES_TARGET), True)]
    bound.append((str(tools.SCRIPTS), str(SCRIPTS_TARGET), True))
    bound += [(str(mount.source), str(mount.target), True) for mount in storage.inputs]
    bound.append((str(output), str(storage.output_target), False))
    bound += volumes
    arguments = ["run", "--nobanner"]
    arguments += [f"--volume={source}:{target}" for source, target, _ in bound]
    arguments += [f"--device={device}" for device in devices]
    inside = {**values, "GPURESA_USER": account.login, "GPURESA_SESSION": key}
    arguments += [f"--env={name}={value}" for name, value in sorted(inside.items())]
    tail = ["--entrypoint=/bin/sh", container, f"{SCRIPTS_TARGET}/session.sh"]
    tail += list(chosen.command or ())
    readonly = [target for _, target, read_only in bound if read_only]
    environment = tools.environment(
        config,
        account,
        {
            "GPURESA_READONLY": json.dumps(readonly),
            "GPURESA_SHM_SIZE": str(config.limits.shm_size),
        },
    )
    return RunCommand(tools.udocker_command(config, arguments), tail, environment)


def start_container(
    config: Config,
    account: Account,
    record: Record,
    files: Path,
    gpu: GpuAccess,
    root: Path,
    cgroup: SessionCgroup,
    log_file: Path,
) -> None:
    """Start the session's container (`session_run`) as `account`, in its `cgroup`, with
    the GPUs `gpu` gives (device nodes, driver files under `root`); its output in `log_file`."""
    spec = record.spec
    # the login's folder of the tools' sockets, at the same path as on the host, where the
    # login's sshd forwards to them (`gpuresa.backends.tool_folders`)
    sockets = str(host_tool_folder(config, spec.key))
    # the login's lasting home, where `_show_home` mounted it (see `homes.store`)
    home = view_path(config, spec.user, spec.key, by_login=True)
    homes = [(str(home), str(home_target(spec.user)), False)] if homes_enabled(config) else []
    run = session_run(
        config,
        account,
        spec.key,
        spec.template,
        spec.cuda,
        record.container,
        files,
        record.output_dir,
        volumes=[*driver_volumes(root, gpu.mounts), (sockets, sockets, False), *homes],
        devices=[device["PathOnHost"] for device in gpu.devices],
        values={**gpu.environment, "GPURESA_TOOLS_DIR": sockets},
    )
    launch.spawn(cgroup, account, run.head + run.tail, run.environment, log_file)
