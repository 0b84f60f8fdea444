"""Sessions as Slurm jobs in reservations (see `backend`)."""

from gpuresa.backends.slurm.backend import SlurmBackend, slurm_name

__all__ = ["SlurmBackend", "slurm_name"]
