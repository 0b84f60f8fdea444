"""Which backend serves this daemon's host: its `engine` says."""

from __future__ import annotations

from gpuresa.backends.protocol import SessionBackend
from gpuresa.config.sections import Config
from gpuresa.errors import UserError


def open_backend(config: Config) -> SessionBackend:
    """The session backend of `config`'s host: udocker, a Slurm cluster, or the Docker/Podman
    `Runtime`."""
    try:
        engine = config.host().engine
    except UserError:
        engine = "docker"
    if engine == "udocker":
        from gpuresa.backends.udocker import UdockerBackend

        return UdockerBackend(config)
    if engine == "slurm":
        from gpuresa.backends.slurm import SlurmBackend

        return SlurmBackend(config)
    from gpuresa.runtime import Runtime

    return Runtime(config)


def ssh_as_login(engine: str) -> bool:
    """Whether the SSH servers of `engine`'s sessions run as the booking's login with no
    root beside them to bind a privileged port, so their ports are unprivileged and a host
    key of their own proves them (a capability the backend class declares)."""
    backend: type[object]
    if engine == "slurm":
        from gpuresa.backends.slurm import SlurmBackend

        backend = SlurmBackend
    elif engine == "udocker":
        from gpuresa.backends.udocker import UdockerBackend

        backend = UdockerBackend
    else:
        from gpuresa.runtime import Runtime

        backend = Runtime
    return bool(getattr(backend, "SSH_AS_LOGIN", False))
