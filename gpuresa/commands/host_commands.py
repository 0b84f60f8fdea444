"""`gpuresa host release [--all]`: let go of what gpuresa holds in the host's kernel."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
from collections.abc import Iterator
from pathlib import Path

from gpuresa.backends.engines.host_holds import Holding, release
from gpuresa.backends.engines.output_service import OutputService
from gpuresa.backends.factory import open_backend
from gpuresa.commands.template_commands import docker_errors
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.inert import echo
from gpuresa.outputs.handover import retry_pending
from gpuresa.sessions.protocol import SessionBackend

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("host", help="what gpuresa holds on this host")
    actions = parser.add_subparsers(dest="host_command", metavar="ACTION", required=True)
    releasing = actions.add_parser(
        "release",
        help="unmount and detach what no running session needs (--all: stop everything first)",
    )
    releasing.add_argument(
        "--all",
        action="store_true",
        help="stop every session and the output service first, then release everything",
    )
    releasing.set_defaults(handler=release_command)


def release_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    with _without_a_daemon(config), docker_errors():
        backend = open_backend(config)
        stopped, kept, released = release_host(config, backend, everything=arguments.all)
    for key in stopped:
        echo(f"stopped session {key}")
    for holding in released:
        echo(f"released {holding}")
    for holding in kept:
        of_a_session = holding.kind in ("mount", "cgroup") and holding.key is not None
        reason = "its session runs" if of_a_session and not holding.in_use else "in use"
        echo(f"kept {holding} ({reason})")
    if not (stopped or released or kept):
        echo("nothing to release")
    return 0


def release_host(
    config: Config, backend: SessionBackend, *, everything: bool
) -> tuple[list[str], list[Holding], list[Holding]]:
    """Release what no running session needs; with `everything`, stop them all first.

    Every session is stopped with the configured grace (its output handed
    over), the output service removed, outputs left in the running area
    handed over, then every mount of the area and every loop device
    released. Returns (the keys stopped, what is kept, what is released).
    """
    stopped = []
    if everything:
        for session in backend.list_sessions():
            backend.stop(session.key, config.daemon.stop_grace)
            stopped.append(session.key)
        service = OutputService(config, backend)
        if service.enabled:  # a host whose sessions serve their own outputs has none
            service.remove()
        retry_pending(config, (), _report)
        running: list[str] = []
    else:
        running = [session.key for session in backend.list_sessions()]
    kept, released = release(config, running, everything=everything)
    return stopped, kept, released


def _report(key: str, problem: str) -> None:
    log.error("%s: output not handed over: %s", key, problem)


@contextlib.contextmanager
def _without_a_daemon(config: Config) -> Iterator[None]:
    """Hold the daemon's lock of the state folder for the whole release; raise `UserError`
    while a daemon holds it. A daemon would start sessions again and mount what this command
    unmounts: one started meanwhile is refused ("another gpuresa daemon uses ...")."""
    state_dir = Path(config.daemon.state_dir)
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with (state_dir / "daemon.lock").open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"a gpuresa daemon runs with {config.daemon.state_dir}; stop it first "
                "(systemctl stop gpuresa), then run `gpuresa host release` again"
            ) from None
        yield  # the lock goes with the file's closing
