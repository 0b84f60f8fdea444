"""What a session backend can do, so that nobody outside `backends/` asks which one it is.

Each backend class declares its `capabilities` (one of the values below), and
`host_capabilities(host)` gives the same value from a `[[hosts]]` entry alone,
for the pure planner and the config checks, which open no backend. This
module is the one place outside the factory that maps an `engine` name to
what it means; `tests/test_backend_contract.py` checks that each backend's
declaration is the one its host's entry gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuresa.config.sections import HostConfig


@dataclass(frozen=True)
class Capabilities:
    """What the sessions of a backend's host are like.

    - **places_gpus**: a scheduler picks each session's devices on a node of its
      choosing: the planner books a GPU count and no indices, and gpuresa does
      not count the host's GPUs (the backend refuses what a node cannot hold).
    - **serves_outputs**: outputs are read through each login's own account
      (the session's sshd, the login's files): the host has no output service.
    - **ftp_sidecar**: each session has an FTPS sidecar serving its output.
    - **own_host_key**: the session's sshd runs as the booking's login, with a
      host key of its own (no certificate of the host's authority proves it).
    - **ssh_as_login**: and no root beside that sshd binds its port: its ports
      are unprivileged ones (a host user could bind a privileged one no less).
    - **remote_nodes**: sessions run on other machines (a cluster's nodes): this
      machine's GPUs and processes are not theirs.
    - **isolation**: what separates two sessions, in a sentence for the admin.
    - **tool_sockets**: where a template's browser tools (`[[tools]]`) put their unix
      sockets, which the session's sshd forwards: "session" (a folder of the session's
      own filesystem, its sshd inside), "host" (a host folder of the login's, bound at
      the same path: its sshd runs on the host) or "none" (no tools are started).
    """

    places_gpus: bool
    serves_outputs: bool
    ftp_sidecar: bool
    own_host_key: bool
    ssh_as_login: bool
    remote_nodes: bool
    isolation: str
    tool_sockets: str = "session"


_SHARED_OUTPUTS = (
    "outputs root-only and nosuid,nodev while running, privileges cleared at hand-over"
)

DOCKER = Capabilities(
    places_gpus=False,
    serves_outputs=False,
    ftp_sidecar=True,
    own_host_key=False,
    ssh_as_login=False,
    remote_nodes=False,
    isolation=f"docker userns-remap (one host uid is root in every session; {_SHARED_OUTPUTS})",
)
PODMAN = Capabilities(
    places_gpus=False,
    serves_outputs=False,
    ftp_sidecar=True,
    own_host_key=False,
    ssh_as_login=False,
    remote_nodes=False,
    isolation=f"podman userns=auto (a host id range per session; {_SHARED_OUTPUTS})",
)
UDOCKER = Capabilities(
    places_gpus=False,
    serves_outputs=True,
    ftp_sidecar=False,
    own_host_key=True,
    # root binds each session's port for it (see `backends.udocker.listening`)
    ssh_as_login=False,
    remote_nodes=False,
    isolation="udocker sessions as the booking's own login (root of a user namespace that "
    "maps only the login's uid; cgroups gpuresa owns; its ssh port bound by root)",
    # the host's network namespace: a tool's socket is a file only the login can reach
    tool_sockets="host",
)
SLURM = Capabilities(
    places_gpus=True,
    serves_outputs=True,
    ftp_sidecar=False,
    own_host_key=True,
    ssh_as_login=True,
    remote_nodes=True,
    isolation="slurm jobs as the booking's own login (no root in a session; the job's "
    "GPUs confined by the cluster's cgroup.conf)",
    tool_sockets="none",
)

_BY_ENGINE = {"docker": DOCKER, "podman": PODMAN, "udocker": UDOCKER, "slurm": SLURM}


def host_capabilities(host: HostConfig | None) -> Capabilities:
    """The capabilities of the backend that serves `host` (None: a Docker engine's, as the
    factory opens for a daemon whose host is not configured)."""
    return DOCKER if host is None else _BY_ENGINE[host.engine]
