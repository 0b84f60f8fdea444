"""The template's container in a session's job: udocker, run by the booking's user.

With `[slurm] container = "udocker"` (the default) a session's job runs the
booking's template, as on a udocker host, and every SSH login of the user
lands in it. gpuresa (root, on the daemon's node) loads the template's image
into the login's udocker repository and makes the session's container there
ahead of the start (`udocker create` as the login: unpacking takes seconds, so
it is done at prepare); the job, on its node, as the login, runs it in
udocker's runc mode with the session's folders bound (inputs read-only, the
output read-write), writes the container's first process to its run folder,
and starts the user's sshd, whose `ForceCommand` enters that container.

Every node needs what the daemon's node has at the same paths: the udocker
folder (`[udocker] root`, default `<shared_dir>/udocker`, shared), gpuresa's
installation (udocker's package and the scripts are read from it), runc,
nsenter and python3. `[slurm] container = "none"` runs the node's own sshd
instead, for clusters where the nodes have neither.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from gpuresa.access import Account, host_account
from gpuresa.backends.udocker import tools
from gpuresa.backends.udocker.backend import SCRIPTS_TARGET, UdockerBackend
from gpuresa.config.sections import Config
from gpuresa.runtime.errors import SessionError
from gpuresa.runtime.payload import SESSION_FILES_TARGET
from gpuresa.runtime.templates import resolve_template

log = logging.getLogger(__name__)


def udocker_config(config: Config) -> Config:
    """`config` with the udocker folder on the cluster's shared folder unless one is set."""
    if config.udocker.root is not None:
        return config
    udocker = dataclasses.replace(config.udocker, root=config.slurm.shared_dir / "udocker")
    return dataclasses.replace(config, udocker=udocker)


class JobContainers:
    """The udocker containers of a cluster's sessions, one per session, in its login's
    repository, named like the session's job."""

    def __init__(self, config: Config) -> None:
        self.config = udocker_config(config)
        # images: built by the image engine, saved, loaded per login (as on udocker hosts)
        self.images = UdockerBackend(self.config)

    def provisioned(self, template: str | None, cuda: str | None) -> bool:
        return self.images.provisioned(template, cuda)

    def provision(self, template: str | None, cuda: str | None) -> None:
        self.images.provision(template, cuda)

    def _account(self, user: str) -> Account:
        account = host_account(user)
        if account is None:
            raise SessionError(f"{user!r} has no account on the cluster")
        return account

    def make(self, key: str, user: str, template: str, cuda: str | None, name: str) -> None:
        """Load the template's image for `user` and make container `name` from it (as the
        user); nothing when it is there already. Raises `SessionError` (`ImageMissing` when
        the image is not built yet)."""
        account = self._account(user)
        image = self.images.load_image(key, account, template, cuda)
        if (tools.repository(self.config, user) / "containers" / name).exists():
            return
        tools.run_udocker(self.config, account, ["create", f"--name={name}", image], key, 600)
        tools.run_udocker(self.config, account, ["setup", "--execmode=R1", name], key)
        log.info("%s: container %s made for %s from %s", key, name, user, image)

    def remove(self, key: str, user: str, name: str) -> None:
        """Remove container `name` from `user`'s repository (in the background)."""
        account = host_account(user)
        if account is not None:
            tools.remove_detached(self.config, account, name, key)

    def job_settings(
        self, user: str, template: str, cuda: str | None, name: str, files: Path, output: Path
    ) -> dict[str, Any]:
        """What the job needs to run container `name` (see `jobscript`): udocker's command
        line before and after the options only the node knows (its GPUs, the job's id), the
        environment to run it in, and the command that enters it for a login."""
        account = self._account(user)
        storage = self.config.storage
        chosen, _ = resolve_template(self.config.templates, template, cuda)
        volumes = [(str(files), str(SESSION_FILES_TARGET), True)]
        volumes.append((str(tools.SCRIPTS), str(SCRIPTS_TARGET), True))
        volumes += [(str(mount.source), str(mount.target), True) for mount in storage.inputs]
        volumes.append((str(output), str(storage.output_target), False))
        head = ["run", "--nobanner"]
        head += [f"--volume={source}:{target}" for source, target, _ in volumes]
        head.append(f"--env=GPURESA_USER={user}")
        tail = ["--entrypoint=/bin/sh", name, f"{SCRIPTS_TARGET}/session.sh"]
        tail += list(chosen.command or ())
        readonly = [target for _, target, read_only in volumes if read_only]
        environment = tools.environment(
            self.config,
            account,
            {
                "GPURESA_READONLY": json.dumps(readonly),
                "GPURESA_SHM_SIZE": str(self.config.limits.shm_size),
            },
        )
        return {
            "head": tools.udocker_command(self.config, head),
            "tail": tail,
            "nvidia": tools.udocker_command(self.config, ["setup", "--nvidia", name]),
            "env": environment,
            "enter": ["/bin/sh", str(tools.SCRIPTS / "enter.sh")],
        }
