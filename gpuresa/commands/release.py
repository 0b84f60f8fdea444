"""Release a host completely: every session stopped, the output service removed, the
output area unmounted. What the demo does on Ctrl-C, and what an admin runs before
taking a host out of service (`gpuresa release`).
"""

from __future__ import annotations

import argparse
import logging

from gpuresa.backends.factory import open_backend
from gpuresa.backends.protocol import SessionBackend
from gpuresa.config.sections import Config
from gpuresa.outputs.service import OutputService
from gpuresa.runtime.errors import RuntimeUnavailable, SessionError
from gpuresa.runtime.output_area import release_area

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    release = subparsers.add_parser(
        "release",
        help="stop every session of this host, remove the output service, unmount (host freed)",
    )
    release.set_defaults(handler=release_command)


def release_command(arguments: argparse.Namespace) -> int:
    from gpuresa.config.reading import load_config

    config = load_config(arguments.config)
    removed = release_host(config, open_backend(config))
    print(f"released {config.daemon.host}: {', '.join(removed) or 'nothing was left'}")
    return 0


def release_host(config: Config, runtime: SessionBackend) -> list[str]:
    """Stop every session of this host (outputs kept and handed over), remove the output
    service and the engine's leftovers, unmount the output area; what was removed.

    Idempotent: a host with nothing left is released at once.
    """
    removed = []
    for session in runtime.list_sessions():
        runtime.stop(session.key, config.daemon.stop_grace)
        removed.append(f"session {session.key}")
    try:
        service = OutputService(config, runtime)
        if service.enabled and service.find() is not None:
            service.remove()
            removed.append("the output service")
    except (SessionError, RuntimeUnavailable) as error:
        log.warning("the output service was not removed: %s", error)
    removed.extend(runtime.cleanup(()))
    release_area(config)
    return removed
