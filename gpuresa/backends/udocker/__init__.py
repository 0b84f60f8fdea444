"""Sessions without a root engine: udocker in runc mode, as the booking login (see `backend`)."""

from gpuresa.backends.udocker.backend import UdockerBackend

__all__ = ["UdockerBackend"]
