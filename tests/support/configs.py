"""Configs for tests and benchmarks: one in-memory builder, one TOML file writer.

`config_of` parses tables layered onto a small base (host gpu1 with four
GPUs), the way the pure tests build theirs. `write_daemon_config` writes the
TOML file a daemon under test reads: a calendar (an ICS folder, or a CalDAV
URL with its credentials), one host with free ports on 127.0.0.1 for
`sessions` sessions, keys for the users, and any extra tables.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuresa.commands.demo import free_port_block
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config

BASE_IMAGE = "gpuresa/base:bookworm"

# The base `config_of` layers onto.
BASE: Mapping[str, Any] = {
    "daemon": {"host": "gpu1"},
    "hosts": [{"name": "gpu1", "gpus": [0, 1, 2, 3]}],
}


def free_ports(size: int) -> int:
    """The first of `size` consecutive free ports on 127.0.0.1, below the ephemeral range,
    reserved for this test until `release_ports` (see `PORT_RESERVATIONS`).

    A port in the kernel's ephemeral range (`ip_local_port_range`, 32768-60999
    by default) may be the local end of any outgoing connection meanwhile (to
    the engine, a relay, a calendar), and the engine then cannot bind it: the
    test would see "taken by another program". Random, so that tests running
    at once rarely try the same block, and reserved, so that a block free now
    but bound only later is never handed to a test beside it.
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        first = free_port_block(size, random.randint(min(10000, low // 2), low - 1000))
        if _reserve(range(first, first + size)):
            return first
    raise RuntimeError(f"no {size} free ports that no other test holds")


# one file per port a test process holds, naming its pid: pytest-xdist's workers (and the
# runs inside a run) each pick ports, and a file made with O_EXCL is taken by one only
PORT_RESERVATIONS = Path("/tmp/gpuresa-test-ports")
_held: list[Path] = []


def _reserve(ports: range) -> bool:
    """Reserve every port of `ports` for this process, or none of them."""
    PORT_RESERVATIONS.mkdir(mode=0o700, exist_ok=True)
    taken: list[Path] = []
    for port in ports:
        path = PORT_RESERVATIONS / str(port)
        if not _take(path):
            for mine in taken:
                mine.unlink(missing_ok=True)
            return False
        taken.append(path)
    _held.extend(taken)
    return True


def _take(path: Path) -> bool:
    for _ in range(2):
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            if _holder_alive(path):
                return False
            path.unlink(missing_ok=True)  # a process that died holding it
            continue
        with os.fdopen(descriptor, "w") as handle:
            handle.write(str(os.getpid()))
        return True
    return False


def _holder_alive(path: Path) -> bool:
    try:
        pid = int(path.read_text() or "0")
    except (OSError, ValueError):
        return True  # being written: its maker is alive
    if pid == 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def release_ports() -> None:
    """Give back the ports this process reserved (at the end of each test, and its own)."""
    while _held:
        _held.pop().unlink(missing_ok=True)


atexit.register(release_ports)


def config_of(*layers: Mapping[str, Any], base: bool = True, source: str = "test.toml") -> Config:
    """The config of `layers` merged in order (tables merged, other values replaced).

    `base`: start from `BASE` (else from nothing: every default).
    """
    merged: dict[str, Any] = _merge({}, BASE) if base else {}
    for layer in layers:
        merged = _merge(merged, layer)
    return parse_config(merged, source)


def _merge(into: Mapping[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(into)
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@dataclass(frozen=True)
class CalDav:
    """A CalDAV calendar and its credentials (a Radicale server's)."""

    url: str
    username: str
    password_file: Path


def write_daemon_config(
    directory: Path,
    *,
    host: str,
    calendar: CalDav | None = None,
    sessions: int = 2,
    passive_per_session: int = 5,
    gpus: Sequence[int] = (0,),
    users: Sequence[str] = ("alice",),
    daemon: str = "",
    limits: str = "",
    extra: str = "",
    host_lines: str = "",
    gpu_mode: str = "none",
) -> Path:
    """Write `directory/config.toml` for a daemon under test; returns its path.

    `calendar`: None for an ICS folder (`directory/calendar`, made here).
    `sessions`: how many sessions the host's SSH and FTP ports allow at
    once. `users`: each gets the key `directory/key` (made once). `daemon`:
    lines for the [daemon] table (its defaults here: a 1 s poll, 5 s prepared
    ahead, 1 s stop grace). `limits`: lines for [limits]. `extra`: tables
    appended to the file. `host_lines`: lines for the [[hosts]] table.
    `gpu_mode`: the host's (none by default: no GPU is placed; "devices" with
    `support.gpu_nodes`' stand-in nodes where one must be).
    """
    keys = directory / "keys"
    keys.mkdir(exist_ok=True)
    key_file = directory / "key"
    if not key_file.exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key_file)], check=True
        )
    for user in users:
        (keys / f"{user}.pub").write_text(key_file.with_suffix(".pub").read_text())
    passive = passive_per_session * sessions
    # the last port: the output service's, of this test alone (never the default 222)
    first = free_ports(2 * sessions + passive + 1)
    if calendar is None:
        folder = directory / "calendar"
        folder.mkdir(exist_ok=True)
        calendar_lines = f'kind = "ics"\nurl = "{folder}"'
    else:
        calendar_lines = (
            f'url = "{calendar.url}"\nusername = "{calendar.username}"\n'
            f'password_file = "{calendar.password_file}"'
        )
    defaults = {"poll_interval": '"1s"', "prepare_ahead": '"5s"', "stop_grace": '"1s"'}
    given = {line.split("=", 1)[0].strip() for line in daemon.splitlines() if "=" in line}
    daemon_lines = "\n".join(
        [f"{key} = {value}" for key, value in defaults.items() if key not in given] + [daemon]
    )
    config = directory / "config.toml"
    config.write_text(
        f"""
[daemon]
host = "{host}"
state_dir = "{directory / "state"}"
{daemon_lines}
[[calendars]]
name = "{"folder" if calendar is None else "caldav"}"
{calendar_lines}
host = "{host}"
default_template = "pytorch"
[[hosts]]
name = "{host}"
gpus = {list(gpus)}
gpu_mode = "{gpu_mode}"
bind_address = "127.0.0.1"
ssh_ports = "{first}-{first + sessions - 1}"
ftp_ports = "{first + sessions}-{first + 2 * sessions - 1}"
ftp_passive_ports = "{first + 2 * sessions}-{first + 2 * sessions + passive - 1}"
ftp_passive_per_session = {passive_per_session}
{host_lines}
[templates]
base_image = "{BASE_IMAGE}"
[users]
keys_dir = "{keys}"
host_authorized_keys = false
[storage]
output_root = "{directory / "output"}"
sftp_port = {first + 2 * sessions + passive}
[limits]
shm_size = "64m"
{limits}
{extra}"""
    )
    return config
