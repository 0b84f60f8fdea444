"""The daemon under the systemd unit's restrictions, on the default config, with a real session.

There is no systemd here, so `unit_sandbox` reads the unit's [Service] lines
and applies them with the kernel's mechanisms (bounding set, no_new_privs,
seccomp, a mount namespace if the unit made one). A booking on the defaults
(Docker, `session_quota = "auto"`, `layer_size` 30g) must start, its output
must reach the folder the host sees, and it must end cleanly; without what the
unit grants, the booking is refused with its reason and the daemon lives on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import unit_sandbox
from conftest import TEST_HOST, DockerHarness
from daemon_stage import wait_ssh_ready
from support.configs import write_daemon_config
from test_daemon_cli import ics_event
from unit_sandbox import Restrictions

from gpuresa.backends.engines import Runtime
from gpuresa.config.reading import load_config
from gpuresa.config.sections import Config
from gpuresa.homes.paths import image_path
from gpuresa.journal.store import Journal
from gpuresa.outputs.running_area import RUNNING_FOLDER, area, running_path

CONTENT = "written under the unit\n"
GIB = 1 << 30


class NotifyListener:
    """systemd's side of sd_notify: an abstract datagram socket, every message kept."""

    def __init__(self) -> None:
        self.name = f"gpuresa-unit-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []

    def read(self) -> list[str]:
        with contextlib.suppress(TimeoutError, BlockingIOError):
            while True:
                self.messages.append(self.sock.recv(4096).decode())
        return self.messages

    def wait(self, line: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line in message.splitlines() for message in self.read()):
                return True
        return False


class SandboxedDaemon:
    """`gpuresa run` under `limits`, as the unit would start it, its log in a file."""

    def __init__(self, config_file: Path, log_file: Path, limits: Restrictions) -> None:
        self.log_file = log_file
        self.notify = NotifyListener()
        command = [sys.executable, "-m", "gpuresa.cli", "--config", str(config_file), "-v", "run"]
        environment = dict(os.environ)
        # a short watchdog so that its pings show within the test
        environment.update(NOTIFY_SOCKET="@" + self.notify.name, WATCHDOG_USEC="2000000")
        self.process = subprocess.Popen(
            unit_sandbox.sandboxed(limits, command),
            stdout=log_file.open("ab"),
            stderr=subprocess.STDOUT,
            env=environment,
        )

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def terminate(self) -> int:
        """SIGTERM, as `systemctl stop` sends it; the exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(30)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.notify.sock.close()


@pytest.fixture
def daemon_log(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    log_file = tmp_path / "daemon.log"
    yield log_file
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed and log_file.exists():
        print("--- daemon log:\n" + log_file.read_text()[-20000:])


def default_config(directory: Path) -> tuple[Path, Config]:
    """A daemon's config on the defaults: Docker, session_quota "auto", layer_size 30g."""
    config_file = write_daemon_config(directory, host=TEST_HOST, sessions=1, gpus=())
    config = load_config(config_file)
    assert config.storage.session_quota == "auto"
    assert config.limits.layer_size != "off" and config.limits.layer_size.bytes == 30 * GIB
    runtime = Runtime(config)
    runtime.ensure_image("pytorch", None)
    runtime.ensure_ftp_image()
    return config_file, config


def book(directory: Path, key: str, start: datetime, end: datetime) -> None:
    (directory / "calendar" / f"{key}.ics").write_text(ics_event(key, start, end, "alice", ""))


def session_containers(harness: DockerHarness, key: str) -> list[Any]:
    return [c for c in harness.ours() if c.labels.get("gpuresa.reservation") == key]


def unmount_area(config: Config) -> None:
    """Undo the running area's mount, which outlives the daemon by design."""
    while os.path.ismount(area(config)):
        subprocess.run(["umount", "--lazy", str(area(config))], check=False)


def test_the_unit_keeps_the_daemon_in_the_hosts_mount_namespace() -> None:
    # a mount made in a namespace of the daemon's own never reaches the engine
    limits = unit_sandbox.restrictions()
    assert limits.mount_namespace == ()
    assert "CAP_SYS_ADMIN" in limits.capabilities
    assert limits.no_new_privileges


def test_a_default_booking_runs_under_the_units_restrictions(
    tmp_path: Path, docker_harness: DockerHarness, daemon_log: Path
) -> None:
    config_file, config = default_config(tmp_path)
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=12)
    end = start + timedelta(seconds=25)
    book(tmp_path, "unit-1", start, end)
    daemon = SandboxedDaemon(config_file, daemon_log, unit_sandbox.restrictions())
    try:
        assert daemon.notify.wait("READY=1", 60), daemon.log()[-3000:]
        assert wait_ssh_ready(config, "unit-1", time.monotonic() + 60) is not None
        [main] = [
            c
            for c in session_containers(docker_harness, "unit-1")
            if c.labels["gpuresa.role"] == "main"
        ]
        code, output = main.exec_run(
            [
                "sh",
                "-c",
                f"printf '{CONTENT}' > /output/result.txt && df -B1 --output=size / /output "
                "&& echo kept > /home/alice/kept && stat -c %U /home/alice/kept",
            ],
            user="alice",
        )
        assert code == 0, output
        *sizes, home_owner = output.decode().split()[1:]
        root_size, output_size = (int(line) for line in sizes)
        # the login's lasting home is mounted, theirs, through the unit's capabilities
        assert home_owner == "alice"
        assert image_path(config, "alice").exists()
        # the writable layer is its own 30g filesystem (the host's disk is bigger)
        assert root_size <= 30 * GIB
        # the output is its image, mounted where dockerd sees it, and the host reads it there
        running = running_path(config, "unit-1")
        assert os.path.ismount(running)
        assert (running / "result.txt").read_text() == CONTENT
        assert os.statvfs(running).f_blocks * os.statvfs(running).f_frsize == output_size
        # the session ends at its end, and its output is handed over where the host sees it
        deadline = time.monotonic() + (end - datetime.now(UTC)).total_seconds() + 30
        while time.monotonic() < deadline and session_containers(docker_harness, "unit-1"):
            time.sleep(0.2)
        assert session_containers(docker_harness, "unit-1") == []
        handed: list[Path] = []
        while time.monotonic() < deadline and not handed:
            handed = [
                path
                for path in config.storage.output_root.rglob("result.txt")
                if ".running" not in str(path)
            ]
            time.sleep(0.2)
        assert [path.read_text() for path in handed] == [CONTENT]
        assert not os.path.ismount(running)
        assert "WATCHDOG=1" in daemon.notify.read()
        assert daemon.terminate() == 0
        assert daemon.notify.wait("STOPPING=1", 5)
        assert "Traceback" not in daemon.log()
    finally:
        daemon.close()
        unmount_area(config)


def refused_reason(config: Config, key: str, daemon: SandboxedDaemon, timeout: float) -> str:
    """The journal's reason why session `key` did not start (fails the test if it started)."""
    deadline = time.monotonic() + timeout
    journal_file = config.daemon.state_dir / "journal.sqlite"
    while time.monotonic() < deadline:
        assert daemon.process.poll() is None, "the daemon died:\n" + daemon.log()[-3000:]
        if journal_file.exists():
            journal = Journal(journal_file, read_only=True)
            with contextlib.closing(journal):
                state = journal.states.get(key)
                assert state != "running", "the session started without what it needs"
                if state in ("failed", "rejected"):
                    return " ".join(e.detail for e in journal.history.entries() if e.key == key)
        time.sleep(0.5)
    raise AssertionError("no refusal within the time allowed:\n" + daemon.log()[-3000:])


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        # no mount(2): neither the running area nor an image can be mounted
        (unit_sandbox.restrictions().without("CAP_SYS_ADMIN"), "not permitted"),
        # no id maps: no user namespace shows a session its user's home
        (unit_sandbox.restrictions().without("CAP_SETUID"), "home cannot be mounted"),
        # a mount namespace of its own (ProtectSystem= and the like): the area made there
        # is not a mount the engine sees
        (unit_sandbox.restrictions().with_mount_namespace("ProtectSystem"), RUNNING_FOLDER),
    ],
    ids=["without-CAP_SYS_ADMIN", "without-CAP_SETUID", "in-a-mount-namespace"],
)
def test_without_what_the_unit_grants_the_booking_is_refused_with_its_reason(
    tmp_path: Path,
    docker_harness: DockerHarness,
    daemon_log: Path,
    limits: Restrictions,
    reason: str,
) -> None:
    config_file, config = default_config(tmp_path)
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=8)
    book(tmp_path, "unit-2", start, start + timedelta(minutes=5))
    daemon = SandboxedDaemon(config_file, daemon_log, limits)
    try:
        detail = refused_reason(config, "unit-2", daemon, 60)
        assert reason in detail.lower() or reason in detail, detail
        assert session_containers(docker_harness, "unit-2") == []
        assert daemon.terminate() == 0
        assert "Traceback" not in daemon.log()
    finally:
        daemon.close()
        unmount_area(config)


# --- what each backend needs, under the unit alone and with its drop-in ---------------------

LOGIN = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
BIND_PRIVILEGED = [
    sys.executable, "-c", "import socket; socket.socket().bind(('127.0.0.1', 700))",
]  # fmt: skip


CONTAINER_NAMESPACES = ["unshare", "-U", "--map-root-user", "--mount", "--pid", "--fork", "true"]
READ_CLOCK = (
    "import ctypes; state = ctypes.create_string_buffer(512); "
    "raise SystemExit(ctypes.CDLL(None).adjtimex(state) < 0)"
)


def runs(limits: Restrictions, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        unit_sandbox.sandboxed(limits, argv), capture_output=True, text=True, timeout=60
    )


def test_the_unit_alone_lets_the_daemon_act_as_a_login_and_map_ids() -> None:
    """What every host needs: a login's identity (Slurm's runuser, udocker's setpriv) and a
    user namespace whose id maps root writes (each session's view of its user's home)."""
    limits = unit_sandbox.restrictions()
    assert runs(limits, [*LOGIN[:-1], "true"]).returncode == 0
    assert runs(limits, ["runuser", "-u", "nobody", "--", "true"]).returncode == 0
    # the homes' own code: a user namespace, its maps written by the daemon
    script = (
        "from gpuresa.homes.idmap import _namespace_of; "
        "_namespace_of('0 100000 65536\\n', '0 100000 65536\\n')"
    )
    mapped = runs(limits, [sys.executable, "-c", script])
    assert mapped.returncode == 0, mapped
    # and nothing else: no mount or network namespace of its own
    refused = runs(limits, ["unshare", "--mount", "--net", "true"])
    assert refused.returncode != 0 and "not permitted" in refused.stderr, refused


@pytest.mark.parametrize(
    ("drop_in", "argv", "refusal"),
    [
        # udocker: runc and the logins' nsenter make and enter namespaces (the unit allows
        # user namespaces alone, for the homes' id maps)
        ("udocker.conf", [*LOGIN, *CONTAINER_NAMESPACES], "not permitted"),
        # udocker: root binds the sessions' privileged ports
        ("udocker.conf", BIND_PRIVILEGED, "Permission denied"),
    ],
    ids=["udocker-namespaces", "udocker-port"],
)
def test_a_backend_needs_its_drop_in(drop_in: str, argv: list[str], refusal: str) -> None:
    alone = runs(unit_sandbox.restrictions(), argv)
    assert alone.returncode != 0 and refusal in alone.stderr, alone
    with_drop_in = runs(unit_sandbox.restrictions(drop_in), argv)
    assert with_drop_in.returncode == 0, with_drop_in


def test_udocker_sessions_outlive_a_stop_of_the_daemon() -> None:
    # they are the daemon's children, in its control group: control-group would kill them
    assert unit_sandbox.service_lines()["KillMode"] == ["control-group"]
    assert unit_sandbox.service_lines("udocker.conf")["KillMode"] == ["process"]
    assert unit_sandbox.service_lines("slurm.conf")["KillMode"] == ["control-group"]


@pytest.mark.parametrize(
    "argv",
    [
        # RestrictAddressFamilies= (netlink is allowed, for iptables; raw packets are not)
        [sys.executable, "-c", "import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)"],
        # SystemCallFilter=~@clock: even adjtimex() that only reads (modes 0), which needs no
        # capability, is refused
        [sys.executable, "-c", READ_CLOCK],
        # RestrictRealtime=
        ["chrt", "--fifo", "1", "true"],
        # LockPersonality=
        ["setarch", "--addr-no-randomize", "true"],
        # RestrictNamespaces= (root is refused too)
        ["unshare", "--mount", "true"],
        # NoNewPrivileges=: the kernel's flag is set (a set-uid program gives nothing)
        ["grep", "--quiet", "NoNewPrivs:\t0", "/proc/self/status"],
    ],
    ids=["packet", "clock", "realtime", "personality", "namespaces", "no-new-privileges"],
)
def test_the_emulated_restrictions_bite(argv: list[str]) -> None:
    # a restriction the emulation let through would make the daemon's pass above meaningless
    result = runs(unit_sandbox.restrictions(), argv)
    assert result.returncode != 0, result
    # and each of them runs where nothing is restricted
    assert subprocess.run(argv, capture_output=True, timeout=60).returncode == 0


def test_a_set_uid_file_in_an_ended_output_is_copied_out_of_its_image(tmp_path: Path) -> None:
    # why the unit has no RestrictSUIDSGID=: the hand-over copies an output with `cp -a`
    # before it clears the bits, and a user's set-uid file would make that copy fail
    hostile = tmp_path / "output" / "shell"
    hostile.parent.mkdir()
    hostile.write_text("#!/bin/sh\n")
    hostile.chmod(0o4755)
    copy = tmp_path / "copy"
    result = runs(unit_sandbox.restrictions(), ["cp", "-a", f"{hostile.parent}/", str(copy)])
    assert result.returncode == 0, result
    assert (copy / "shell").stat().st_mode & 0o7777 == 0o4755


def test_an_unknown_hardening_line_is_not_silently_ignored(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    unit = tmp_path / "gpuresa.service"
    unit.write_text(unit_sandbox.UNIT.read_text() + "[Service]\nRestrictSUIDSGID=yes\n")
    monkeypatch.setattr(unit_sandbox, "UNIT", unit)
    with pytest.raises(ValueError, match="RestrictSUIDSGID"):
        unit_sandbox.restrictions()
