"""The two ways the runtime fails: the engine is away, or a session is refused."""

from __future__ import annotations

from gpuresa.errors import UserError


class RuntimeUnavailable(Exception):
    """The Docker engine does not answer (down, restarting, or too slow).

    Nothing was decided about any session: the daemon retries with backoff.
    """


class SessionError(UserError):
    """A session that was refused or failed, with a reason a person can act on.

    Raised before anything is created for a bad request (unknown template,
    invalid login, GPUs the host lacks, no SSH key), and after a rollback for a
    start that failed (the reason names the container and quotes its log).
    """


class EngineTimeout(SessionError):
    """One engine call did not finish in time: that action failed, the engine may be fine."""


class ImageMissing(SessionError):
    """A session's image is not built yet; the daemon builds it off the loop and retries."""

    def __init__(self, message: str, template: str | None = None, cuda: str | None = None) -> None:
        super().__init__(message)
        # None for the FTP sidecar's image
        self.template = template
        self.cuda = cuda


class PortRefused(SessionError):
    """The engine could not bind these host ports (another program listens there)."""

    def __init__(self, message: str, ports: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ports = ports
