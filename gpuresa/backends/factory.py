"""Which backend serves this daemon's host: its `engine` says."""

from __future__ import annotations

from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.sessions.protocol import SessionBackend


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
    from gpuresa.backends.engines import Runtime

    return Runtime(config)
