"""`gpuresa outputs list|prune|serve|prepare-area`: finished and running outputs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpuresa.backends.engines.output_service import OutputService
from gpuresa.backends.factory import open_backend
from gpuresa.commands.template_commands import docker_errors
from gpuresa.config.reading import load_config
from gpuresa.errors import UserError
from gpuresa.inert import echo
from gpuresa.outputs.disk import disk_warnings
from gpuresa.outputs.records import OutputFolder
from gpuresa.outputs.running_area import ensure_area
from gpuresa.outputs.tree import walk
from gpuresa.sessions.errors import SessionError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("outputs", help="session outputs kept on this host")
    actions = parser.add_subparsers(dest="outputs_command", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="every output folder, its size and removal date")
    listing.add_argument("--user", help="only this login's outputs")
    listing.add_argument("--json", action="store_true", help="JSON instead of a table")
    listing.set_defaults(handler=list_command)

    prune = actions.add_parser("prune", help="remove the outputs whose retention is over")
    prune.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    prune.set_defaults(handler=prune_command)

    serve = actions.add_parser("serve", help="start or check the output service (SFTP)")
    serve.set_defaults(handler=serve_command)

    area = actions.add_parser(
        "prepare-area", help="make the running outputs' folder a root-only nosuid,nodev mount"
    )
    area.set_defaults(handler=prepare_area_command)


def _service(arguments: argparse.Namespace) -> OutputService:
    config = load_config(arguments.config)
    return OutputService(config, open_backend(config))


def folder_sizes(path: Path) -> tuple[int, int]:
    """(bytes its files hold, bytes they take on the disk) below `path`, at any depth, never
    following a link; (0, 0) when it cannot be read.

    The two differ: a file written as zeros may be kept sparse (copied out of a
    session's image, say) and take no block, a compressed disk takes fewer, and
    a small file takes a whole block. Users think of the first.
    """
    held = on_disk = 0

    def count(_folder: int, _name: str, details: os.stat_result) -> None:
        nonlocal held, on_disk
        if stat.S_ISREG(details.st_mode):
            held += details.st_size
            on_disk += details.st_blocks * 512  # st_blocks counts 512-byte units

    with contextlib.suppress(OSError):
        walk(path, count)
    return held, on_disk


def human_size(count: int) -> str:
    """`count` bytes in the largest binary unit that keeps it at 1 or more: "3.0 MiB"."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _row(folder: OutputFolder, service: OutputService) -> dict[str, Any]:
    removal = folder.removal(service.config.storage)
    held, on_disk = folder_sizes(folder.path)
    if folder.image is not None:
        # never copied out of its capped image: the image is what the disk holds
        with contextlib.suppress(OSError):
            details = folder.image.stat()
            held, on_disk = details.st_size, details.st_blocks * 512
    return {
        "user": folder.user,
        "path": str(folder.path),
        "key": folder.key,
        "bytes": held,
        "disk_bytes": on_disk,
        "in_use": folder.busy,
        "ended": folder.ended.isoformat() if folder.ended else None,
        "notice_sent": folder.notice_sent.isoformat() if folder.notice_sent else None,
        "removal": removal.isoformat() if removal else None,
        "in_image": folder.image is not None,
    }


def list_command(arguments: argparse.Namespace) -> int:
    service = _service(arguments)
    with docker_errors():
        folders = service.folders()
    rows = [_row(folder, service) for folder in folders if arguments.user in (None, folder.user)]
    if arguments.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        echo("no outputs")
        return 0
    echo(f"{'USER':<12} {'SIZE':>10} {'ON DISK':>10} {'ENDED':<17} {'REMOVAL':<17} PATH")
    for row in rows:
        ended = "in use" if row["in_use"] else (row["ended"] or "?")[:16]
        removal = "never" if row["removal"] is None else row["removal"][:16]
        size, on_disk = human_size(row["bytes"]), human_size(row["disk_bytes"])
        path = f"{row['path']} (in its image)" if row["in_image"] else row["path"]
        echo(f"{row['user']:<12} {size:>10} {on_disk:>10} {ended:<17} {removal:<17} {path}")
    return 0


def prune_command(arguments: argparse.Namespace) -> int:
    service = _service(arguments)
    with docker_errors():
        removed = service.prune(datetime.now(UTC), dry_run=arguments.dry_run)
    verb = "would remove" if arguments.dry_run else "removed"
    for folder in removed:
        echo(f"{verb} {folder.path} ({folder.user})")
    if not removed:
        echo("nothing to remove")
    return 0


def serve_command(arguments: argparse.Namespace) -> int:
    service = _service(arguments)
    for warning in disk_warnings(service.config):
        echo(f"warning: {warning}")
    with docker_errors():
        try:
            state = service.ensure_running()
        except SessionError as error:
            raise UserError(f"the output service could not be started: {error}") from None
    echo(f"output service {state.action} on port {state.port} for {len(state.logins)} login(s)")
    return 0


def prepare_area_command(arguments: argparse.Namespace) -> int:
    """Make the running outputs' area root-only, nosuid and nodev (each daemon start does too)."""
    config = load_config(arguments.config)
    try:
        path = ensure_area(config)
    except SessionError as error:
        raise UserError(str(error)) from None
    print(f"running outputs are kept in {path} (root only, nosuid, nodev)")
    return 0
