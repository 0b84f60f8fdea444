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
import logging
from pathlib import Path
from typing import Any

from gpuresa.access import Account, host_account
from gpuresa.backends.udocker import tools
from gpuresa.backends.udocker.images import UdockerImages, container_exists, make_container
from gpuresa.backends.udocker.run_command import session_run
from gpuresa.config.sections import Config
from gpuresa.homes.folders import folder_home
from gpuresa.homes.paths import home_target
from gpuresa.sessions.errors import SessionError

log = logging.getLogger(__name__)


def udocker_config(config: Config) -> Config:
    """`config` with the udocker folder on the cluster's shared folder unless one is set."""
    if config.udocker.root is not None:
        return config
    udocker = dataclasses.replace(config.udocker, root=config.slurm.shared_dir / "udocker")
    return dataclasses.replace(config, udocker=udocker)


class JobContainers:
    """The udocker containers of a cluster's sessions, one per session, in its login's
    repository, named like the session's job and a random suffix (see `Record.container`)."""

    def __init__(self, config: Config) -> None:
        self.config = udocker_config(config)
        # images: built by the image engine, saved, loaded per login (as on udocker hosts)
        self.images = UdockerImages(self.config)

    def provisioned(self, template: str | None, cuda: str | None) -> bool:
        return template is None or self.images.present(template, cuda)

    def provision(self, template: str | None, cuda: str | None) -> None:
        if template is not None:
            self.images.ensure(template, cuda)

    def _account(self, user: str) -> Account:
        account = host_account(user)
        if account is None:
            raise SessionError(f"{user!r} has no account on the cluster")
        return account

    def make(self, key: str, user: str, template: str, cuda: str | None, name: str) -> None:
        """Load the template's image for `user` and make container `name` from it (as the
        user; a name not given before). Raises `SessionError` (`ImageMissing` when the image
        is not built yet)."""
        account = self._account(user)
        image = self.images.load(key, account, template, cuda)
        make_container(self.config, account, image, name, key)
        log.info("%s: container %s made for %s from %s", key, name, user, image)

    def remove(self, key: str, user: str, name: str) -> None:
        """Remove container `name` from `user`'s repository (in the background), if there."""
        account = host_account(user)
        if account is not None and container_exists(self.config, account, name):
            tools.remove_detached(self.config, account, name, key)

    def job_settings(
        self, key: str, user: str, template: str, cuda: str | None, name: str, files: Path,
        output: Path,
    ) -> dict[str, Any]:  # fmt: skip
        """What the job needs to run container `name` (see `jobscript`): udocker's command
        line before and after the options only the node knows (its GPUs, the job's id), the
        environment to run it in, and the command that enters it for a login."""
        account = self._account(user)
        # the login's lasting home, on the shared folder the nodes see (see `homes.store`)
        owner = (account.uid, account.gid)
        home = folder_home(self.config, self.config.slurm.shared_dir, user, owner)
        homes = [(str(home), str(home_target(user)), False)] if home is not None else []
        run = session_run(
            self.config, account, key, template, cuda, name, files, output, volumes=homes
        )
        return {
            "head": run.head,
            "tail": run.tail,
            "nvidia": tools.udocker_command(self.config, ["setup", "--nvidia", name]),
            "env": run.environment,
            "enter": ["/bin/sh", str(tools.SCRIPTS / "enter.sh")],
        }
