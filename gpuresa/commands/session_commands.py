"""`gpuresa session start|list|stop`: sessions by hand, for tests and debugging.

An ad-hoc session's key starts with "@adhoc-" (an internal key, which no calendar
can name): a running daemon adopts it and stops it at the end it was given
(`--until`), not before.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any, cast
from zoneinfo import ZoneInfo

from gpuresa.backends.engines import Runtime
from gpuresa.backends.factory import open_backend
from gpuresa.commands.template_commands import docker_errors
from gpuresa.config.reading import load_config
from gpuresa.config.schema import Invalid, parse_duration
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.inert import echo
from gpuresa.model import AD_HOC_PREFIX, Session
from gpuresa.sessions.labels import utc_text

DEFAULT_LENGTH = "2h"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("session", help="start, list or stop sessions by hand")
    actions = parser.add_subparsers(dest="session_command", metavar="ACTION", required=True)

    start = actions.add_parser("start", help="start an ad-hoc session now")
    start.add_argument("--user", required=True, help="the login that gets the session")
    start.add_argument("--template", required=True, help="an allowed template")
    start.add_argument("--cuda", metavar="VERSION", help="a CUDA variant (default: preferred)")
    gpus = start.add_mutually_exclusive_group()
    gpus.add_argument("--gpus", metavar="0,1", help="these GPU indices")
    gpus.add_argument(
        "--gpu-count",
        type=int,
        metavar="N",
        help="the N lowest free GPUs (default: 1 when the host has GPUs, else 0)",
    )
    start.add_argument(
        "--until",
        metavar="WHEN",
        default=DEFAULT_LENGTH,
        help="end: an ISO date-time (site time zone unless given) or a duration "
        f'such as "90m" (default: {DEFAULT_LENGTH})',
    )
    start.add_argument(
        "--key",
        help=f"the session key (default: {AD_HOC_PREFIX}<random>; a running daemon stops a "
        "session whose key neither starts with @ nor is booked)",
    )
    start.add_argument("--timeout", type=float, default=30, help="seconds to wait for SSH")
    start.set_defaults(handler=start_command)

    listing = actions.add_parser("list", help="this host's sessions, as Docker shows them")
    listing.add_argument("--json", action="store_true", help="JSON instead of a table")
    listing.set_defaults(handler=list_command)

    stop = actions.add_parser("stop", help="stop a session (its output is kept)")
    stop.add_argument("key", metavar="KEY")
    stop.add_argument(
        "--grace", help="time the user's processes get to exit (default: daemon.stop_grace)"
    )
    stop.set_defaults(handler=stop_command)


def parse_until(text: str, now: datetime, timezone: str) -> datetime:
    """An end given as a duration from `now` or an ISO date-time (naive: site time)."""
    try:
        return now + parse_duration(text)
    except Invalid:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise UserError(
            f'--until {text!r}: expected an ISO date-time such as "2025-06-01T18:00" '
            'or a duration such as "2h"'
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=ZoneInfo(timezone))
    return moment.astimezone(UTC)


def parse_gpu_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UserError(f"--gpus {text!r}: expected GPU indices such as 0,1") from None


def start_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    runtime = cast(Runtime, open_backend(config))
    now = datetime.now(UTC)
    end = parse_until(arguments.until, now, config.reservations.timezone)
    with docker_errors():
        gpus: tuple[int, ...] | int
        if arguments.gpus is not None:
            gpus = parse_gpu_list(arguments.gpus)
        elif arguments.gpu_count is not None:
            if arguments.gpu_count < 0:
                raise UserError("--gpu-count must be 0 or more")
            gpus = arguments.gpu_count
        else:
            gpus = 1 if runtime.host_gpus() else 0
        spec = runtime.new_spec(
            arguments.user,
            arguments.template,
            end,
            cuda=arguments.cuda,
            gpus=gpus,
            start=now,
            key=arguments.key,
        )
        # an ad-hoc session may wait for its images: the daemon's starts never build
        runtime.ensure_image(spec.template, spec.cuda)
        runtime.ensure_ftp_image()
        session = runtime.start(spec, ready_timeout=arguments.timeout)
    echo(describe(session, config))
    return 0


def describe(session: Session, config: Config) -> str:
    """How to reach a session, for people."""
    host = config.host(session.host)
    public = host.public_name or (
        host.bind_address if host.bind_address not in ("0.0.0.0", "::") else host.name
    )
    timezone = ZoneInfo(config.reservations.timezone)
    gpus = ",".join(map(str, session.gpu_indices)) or "none"
    return "\n".join(
        [
            f"session {session.key} ({session.state}) for {session.user} until "
            f"{session.end.astimezone(timezone):%Y-%m-%d %H:%M %Z}",
            f"  template {session.template} (CUDA {session.cuda or '-'}), GPUs {gpus}",
            f"  ssh -p {session.ssh_port} {session.user}@{public}",
            f"  ftp {public} {session.ftp_port} (passive mode), login {session.ftp_user}, "
            f"password {session.ftp_password}",
            f"  output kept in {session.output_dir}",
        ]
    )


def _plain(session: Session) -> dict[str, Any]:
    return {
        "key": session.key,
        "user": session.user,
        "host": session.host,
        "state": session.state,
        "template": session.template,
        "cuda": session.cuda,
        "gpus": list(session.gpu_indices),
        "start": utc_text(session.start),
        "end": utc_text(session.end),
        "ssh_port": session.ssh_port,
        "ftp_port": session.ftp_port,
        "ftp_passive_ports": [session.ftp_passive_first, session.ftp_passive_last],
        "ftp_user": session.ftp_user,
        "output_dir": str(session.output_dir),
        "email": session.email,
        "containers": list(session.containers),
    }


def list_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    with docker_errors():
        sessions = open_backend(config).list_sessions()
    if arguments.json:
        print(json.dumps([_plain(session) for session in sessions], indent=2))
        return 0
    if not sessions:
        echo(f"no sessions on {config.daemon.host}")
        return 0
    timezone = ZoneInfo(config.reservations.timezone)
    rows = [("KEY", "USER", "STATE", "TEMPLATE", "GPUS", "SSH", "FTP", "ENDS")]
    for session in sessions:
        rows.append(
            (
                session.key,
                session.user,
                session.state,
                f"{session.template} {session.cuda or ''}".strip(),
                ",".join(map(str, session.gpu_indices)) or "-",
                str(session.ssh_port),
                str(session.ftp_port),
                f"{session.end.astimezone(timezone):%Y-%m-%d %H:%M %Z}",
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def stop_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    grace = config.daemon.stop_grace
    if arguments.grace is not None:
        try:
            grace = parse_duration(arguments.grace)
        except Invalid as error:
            raise UserError(f"--grace: {error}") from None
    backend = open_backend(config)
    with docker_errors():
        # through the session protocol, which every backend speaks (a cluster's too)
        found = [item for item in backend.list_sessions() if item.key == arguments.key]
        session = found[0] if found else None
        backend.stop(arguments.key, grace)
    if session is None:
        echo(f"no session {arguments.key} on {config.daemon.host}: nothing to stop")
    else:
        echo(f"session {arguments.key} stopped; output kept in {session.output_dir}")
    return 0
