"""`gpuresa demo`: the whole service on this machine, with nothing configured.

It writes a config, an ICS calendar folder with one booking that starts about
30 s later, a demo user with a fresh SSH key and an input folder, all under a
demo directory; then it runs the daemon in the foreground and prints how to
connect when the session starts.
"""

from __future__ import annotations

import getpass
import json
import logging
import shutil
import socket
import subprocess
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpuresa.commands.demo_gpus import NO_GPUS, DemoGpus, detect_gpus
from gpuresa.commands.host_commands import release_host
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config, HostConfig
from gpuresa.errors import UserError
from gpuresa.model import Session
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.host_ca import HostCA

log = logging.getLogger(__name__)

DEMO_USER = "demo"
DEMO_HOST = "demo"
DEMO_TEMPLATE = "pytorch"
BASE_IMAGE = "gpuresa/base:bookworm"
# The status page's port when free (the one config.example.toml suggests), else the next.
STATUS_PORT = 9464


@dataclass(frozen=True)
class DemoFiles:
    """Where the demo keeps its files."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def calendar(self) -> Path:
        return self.root / "calendar"

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def private_key(self) -> Path:
        return self.root / "demo_key"

    @property
    def inputs(self) -> Path:
        return self.root / "input"

    @property
    def output(self) -> Path:
        return self.root / "output"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    @property
    def ftps_certificate(self) -> Path:
        return self.root / "ftps-cert.pem"


def free_port_block(size: int, start: int) -> int:
    """The first port from `start` up where `size` consecutive ports are free on 127.0.0.1."""
    port = start
    while port + size < 65000:
        if all(_port_free(candidate) for candidate in range(port, port + size)):
            return port
        port += size
    raise UserError(f"no {size} free consecutive ports above {start} on 127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def write_demo(
    root: Path,
    now: datetime,
    start_in: timedelta,
    length: timedelta,
    gpus: DemoGpus = NO_GPUS,
) -> DemoFiles:
    """Write the demo's config, key, input folder and a booking starting at now + start_in.

    `gpus`: what the demo host hands out (`detect_gpus()` on a real run).
    """
    files = DemoFiles(root.resolve())
    for folder in (files.calendar, files.keys, files.inputs, files.output, files.state):
        folder.mkdir(parents=True, exist_ok=True)
    if not files.private_key.exists():
        subprocess.run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "demo@gpuresa",
                "-f",
                str(files.private_key),
            ],
            check=True,
        )
    shutil.copyfile(files.private_key.with_suffix(".pub"), files.keys / f"{DEMO_USER}.pub")
    (files.inputs / "README.txt").write_text(
        "This folder is the site's input data, mounted read-only at /data.\n"
    )
    # privileged SSH, FTP and SFTP ports, as by default (no host user can bind them; see
    # docs/ports.md), and passive ports where the default range lies (FTP servers refuse
    # privileged ones)
    defaults = HostConfig(name=DEMO_HOST)
    ssh_first = free_port_block(10, defaults.ssh_ports.first)
    ftp_first = free_port_block(10, ssh_first + 10)
    sftp_port = free_port_block(1, ftp_first + 10)
    passive_first = free_port_block(40, defaults.ftp_passive_ports.first)
    # the status page and /metrics: Prometheus's usual gpuresa port, or the next free one
    status_port = free_port_block(1, STATUS_PORT)
    files.config.write_text(
        f"""# Written by `gpuresa demo`; every key is explained in config.example.toml.
[daemon]
host = "{DEMO_HOST}"
state_dir = "{files.state}"
poll_interval = "5s"
prepare_ahead = "25s"
stop_grace = "5s"
cancel_grace = "30s"
orphan_grace = "1m"
warnings = ["2m", "1m"]

[reservations]
timezone = "UTC"

[[calendars]]
name = "demo"
kind = "ics"
url = "{files.calendar}"
host = "{DEMO_HOST}"
default_template = "{DEMO_TEMPLATE}"

[[hosts]]
name = "{DEMO_HOST}"
{gpus.toml()}
bind_address = "127.0.0.1"
public_name = "127.0.0.1"
ssh_ports = "{ssh_first}-{ssh_first + 9}"
ftp_ports = "{ftp_first}-{ftp_first + 9}"
ftp_passive_ports = "{passive_first}-{passive_first + 39}"
ftp_passive_per_session = 10

[templates]
base_image = "{BASE_IMAGE}"

[users]
keys_dir = "{files.keys}"
host_authorized_keys = false

[storage]
output_root = "{files.output}"
sftp_port = {sftp_port}

[[storage.inputs]]
source = "{files.inputs}"
target = "/data"

[limits]
shm_size = "256m"

[notify]
enabled = false

[telemetry]
backend = "none"
listen = "127.0.0.1:{status_port}"
"""
    )
    start = (now + start_in).replace(microsecond=0)
    end = start + length
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    uid = f"demo-{uuid.uuid4().hex[:8]}@gpuresa"
    (files.calendar / "demo-booking.ics").write_text(
        "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//gpuresa//demo//EN\r\n"
        "BEGIN:VEVENT\r\n"
        f"UID:{uid}\r\nDTSTAMP:{stamp}\r\nCREATED:{stamp}\r\n"
        f"DTSTART:{start.strftime('%Y%m%dT%H%M%SZ')}\r\n"
        f"DTEND:{end.strftime('%Y%m%dT%H%M%SZ')}\r\n"
        f"SUMMARY:{DEMO_USER}\r\n"
        f"DESCRIPTION:template: {DEMO_TEMPLATE}\\ngpus: 1\r\n"
        "END:VEVENT\r\nEND:VCALENDAR\r\n"
    )
    return files


def status_page(config: Config) -> str:
    """The address of the status page the demo's config serves."""
    return f"http://{config.telemetry.listen}/"


def access_text(files: DemoFiles, config: Config, session: Session, public_host: str) -> str:
    """What the demo prints when its session starts: each command works as printed."""
    key = f"-i {files.private_key} -o UserKnownHostsFile={files.known_hosts}"
    login = f"{session.user}@{public_host}"
    ftp = f"ftp://{public_host}:{session.ftp_port}"
    curl = f"curl --ssl-reqd --cacert {files.ftps_certificate} -u {session.ftp_user}:"
    curl += session.ftp_password
    lftp_settings = f"set ftp:ssl-force true; set ssl:ca-file {files.ftps_certificate}"
    return (
        f"\n  Session {session.key} is up until {session.end:%H:%M:%S} UTC.\n"
        f"  The host's @cert-authority lines are in {files.known_hosts}, its FTPS\n"
        f"  certificate in {files.ftps_certificate} (`gpuresa trust` prints both).\n"
        f"\n  SSH:\n    ssh {key} -p {session.ssh_port} {login}\n"
        f"\n  FTPS (explicit TLS; this session's password: {session.ftp_password}):\n"
        f"    lftp -u {session.ftp_user},{session.ftp_password} -p {session.ftp_port} "
        f'-e "{lftp_settings}" {public_host}\n'
        f"    {curl} -T {files.inputs / 'README.txt'} {ftp}/\n"
        f"    {curl} {ftp}/README.txt -o README.txt\n"
        f"\n  After the end ({session.end:%H:%M:%S} UTC), the output, read-only:\n"
        f"    sftp {key} -P {config.storage.sftp_port} {login}\n"
    )


def run_demo(root: Path, start_in: timedelta, length: timedelta) -> None:
    """Write the demo files, build the template image, run the daemon until Ctrl-C, then
    remove what the demo made (its sessions, the output service, mounts)."""
    from gpuresa.backends.engines import Runtime
    from gpuresa.daemon import Daemon

    now = datetime.now(UTC)
    gpus = detect_gpus(docker_runtimes())
    files = write_demo(root, now, start_in, length, gpus)
    config: Config = load_config(files.config)
    runtime = Runtime(config)
    print(f"gpuresa demo: files in {files.root} (run as {getpass.getuser()})")
    print(f"gpuresa demo: {gpus.summary()}")
    print(f"gpuresa demo: building the {DEMO_TEMPLATE} template on {BASE_IMAGE} if needed…")
    image = runtime.ensure_image(DEMO_TEMPLATE, None)
    runtime.ensure_ftp_image()
    print(f"gpuresa demo: image {image} ready")
    write_trust_files(files, config)
    start = (now + start_in).replace(microsecond=0)
    print(
        f"gpuresa demo: {DEMO_USER!r} booked {DEMO_HOST!r} from {start:%H:%M:%S} "
        f"to {start + length:%H:%M:%S} UTC (calendar: {files.calendar})"
    )
    print(f"gpuresa demo: status page at {status_page(config)} (metrics at /metrics)")
    print(
        "gpuresa demo: the daemon runs in the foreground; Ctrl-C stops it and removes the "
        "demo's sessions, containers and mounts (the files stay in the folder above).",
        flush=True,
    )

    def show_access(session: Session, public_host: str) -> None:
        print(access_text(files, config, session, public_host), flush=True)

    try:
        Daemon(config, runtime=runtime, on_start=show_access).run()
    finally:
        print("gpuresa demo: removing the demo's sessions, containers and mounts…", flush=True)
        stopped, _kept, released = release_host(config, runtime, everything=True)
        removed = [f"session {key}" for key in stopped] + [str(item) for item in released]
        print(f"gpuresa demo: removed {', '.join(removed) or 'nothing'}", flush=True)


def write_trust_files(files: DemoFiles, config: Config) -> None:
    """The demo's known_hosts (the host CAs' lines) and FTPS certificate, for its commands."""
    files.known_hosts.write_text(HostCA(config).known_hosts_text())
    shutil.copyfile(HostCredentials(config).tls_files()[0], files.ftps_certificate)


def docker_runtimes() -> set[str]:
    """The runtimes the Docker engine knows ("runc", "nvidia"…); none when it does not answer."""
    try:
        info = subprocess.run(
            ["docker", "info", "--format", "{{json .Runtimes}}"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        return set(json.loads(info or "{}"))
    except (OSError, subprocess.SubprocessError, ValueError):
        return set()
