"""Sessions on Docker. The only package that imports `docker`; see `runtime.Runtime`.

`Runtime` creates, starts, checks, adopts and removes sessions; every Docker
call goes through `engine.Engine`; `payload` builds the exact API payloads and
`templates` reads the session templates and hashes their images.
"""

from gpuresa.runtime.errors import RuntimeUnavailable, SessionError
from gpuresa.runtime.runtime import Runtime

__all__ = ["Runtime", "RuntimeUnavailable", "SessionError"]
