"""Sessions on Docker. The only package that imports `docker`; see `runtime.Runtime`.

`Runtime` creates, starts, checks, adopts, messages and removes sessions;
every Docker call goes through `engine.Engine`; `labels` names sessions' objects
and reads sessions back from their labels, `create_payloads` builds the exact API
payloads, `templates` and `images` the session images, `stopping` and
`processes` end sessions from the host, `session_files` writes what a
session shows its user, `sidecar` brings back a lost FTP sidecar and
`garbage` collects what failures leave behind.
"""

from gpuresa.runtime.errors import (
    EngineTimeout,
    ImageMissing,
    PortRefused,
    RuntimeUnavailable,
    SessionError,
)
from gpuresa.runtime.runtime import Runtime

__all__ = [
    "EngineTimeout",
    "ImageMissing",
    "PortRefused",
    "Runtime",
    "RuntimeUnavailable",
    "SessionError",
]
