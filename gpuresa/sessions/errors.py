"""How the runtime fails: the engine is away, or a session's action failed or was refused.

`RuntimeUnavailable` means nothing could be asked of the engine at all; every
other failure is a `SessionError` about one session, with a reason a person can
act on, and some carry what the daemon needs to act on it (`ImageMissing`,
`PortRefused`).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuresa.errors import UserError


class RuntimeUnavailable(Exception):
    """The Docker engine cannot be reached at all (no socket, connection refused).

    Nothing was decided about any session: the daemon retries with backoff.
    """


class SessionError(UserError):
    """A session that was refused or failed, with a reason a person can act on.

    Raised before anything is created for a bad request (unknown template,
    invalid login, GPUs the host lacks, no SSH key), and after a rollback for a
    start that failed (the reason names the container and quotes its log).
    """


class EngineTimeout(SessionError):
    """The engine took the request but did not answer in time: that action failed.

    The engine may still carry it out; the daemon retries or escalates (a stop
    that timed out is followed by `Runtime.kill`).
    """


class ImageMissing(SessionError):
    """A session's image is not on this host; `prepare` and `start` never build one.

    `template` and `cuda` name the template variant to build with
    `Runtime.ensure_image(template, cuda)`; both are None for the FTP
    sidecar's image (`Runtime.ensure_ftp_image()`).
    """

    def __init__(self, message: str, template: str | None = None, cuda: str | None = None):
        super().__init__(message)
        self.template = template
        self.cuda = cuda

    @property
    def ftp_sidecar(self) -> bool:
        """Whether the missing image is the FTP sidecar's."""
        return self.template is None


class PortRefused(SessionError):
    """Docker refused to publish `ports`: another program (or container) holds them.

    The session was rolled back; the daemon remembers these ports and gives
    the session others.
    """

    def __init__(self, message: str, ports: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.ports = tuple(sorted(set(ports)))
