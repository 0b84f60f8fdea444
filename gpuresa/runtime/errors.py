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
