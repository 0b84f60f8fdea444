"""Sessions on Docker and Podman: the engines backend. The only package that imports `docker`.

`Runtime` creates, starts, checks, adopts, messages and removes sessions;
every Docker call goes through `engine.Engine`; `sessions.labels` names sessions' objects
and reads sessions back from their labels, `create_payloads` builds the exact API
payloads, `images` the session images (from `sessions.templates`), `stopping` and
`processes` end sessions from the host, `sessions.files` writes what a
session shows its user, `sidecar` brings back a lost FTP sidecar and
`garbage` collects what failures leave behind.
"""

from gpuresa.backends.engines.runtime import Runtime
from gpuresa.sessions.errors import (
    EngineTimeout,
    ImageMissing,
    PortRefused,
    RuntimeUnavailable,
    SessionError,
)

__all__ = [
    "EngineTimeout",
    "ImageMissing",
    "PortRefused",
    "Runtime",
    "RuntimeUnavailable",
    "SessionError",
]
