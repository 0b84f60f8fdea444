"""Session backends, one package each (`engines`: Docker and Podman, `udocker`, `slurm`).

`factory.open_backend` picks a host's; what they all share is `gpuresa.sessions`.
"""
