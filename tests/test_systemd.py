"""sd_notify against real datagram sockets, and the systemd unit checked as systemd reads it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from unit_sandbox import DROP_INS, MOUNT_NAMESPACE_OPTIONS, unit_directives

from gpuresa import systemd

UNIT = Path(__file__).parents[1] / "systemd" / "gpuresa.service"


@pytest.fixture(autouse=True)
def _not_under_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the variables it needs; none leak in from a real service manager."""
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=["path", "abstract"])
def listener(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[socket.socket]:
    """A datagram socket like systemd's, named in $NOTIFY_SOCKET (a path or "@name")."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(tmp_path / "notify")
        sock.bind(address)
        monkeypatch.setenv("NOTIFY_SOCKET", address)
    else:
        name = f"gpuresa-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    sock.settimeout(5)
    try:
        yield sock
    finally:
        sock.close()


def received(sock: socket.socket) -> str:
    return sock.recv(4096).decode("utf-8")


def test_ready_status_watchdog_stopping_arrive(listener: socket.socket) -> None:
    assert systemd.ready("polling 2 calendars") is True
    assert received(listener) == "READY=1\nSTATUS=polling 2 calendars"
    assert systemd.status("3 sessions running") is True
    assert received(listener) == "STATUS=3 sessions running"
    assert systemd.watchdog() is True
    assert received(listener) == "WATCHDOG=1"
    assert systemd.reloading() is True
    assert received(listener) == "RELOADING=1"
    assert systemd.stopping("sessions keep running") is True
    assert received(listener) == "STOPPING=1\nSTATUS=sessions keep running"
    assert systemd.notify("EXTEND_TIMEOUT_USEC=5000000") is True
    assert received(listener) == "EXTEND_TIMEOUT_USEC=5000000"


def test_a_status_stays_one_line(listener: socket.socket) -> None:
    # a line break would let the text send another NAME=value
    systemd.status("calendar gpu1 failed:\nWATCHDOG=trigger")
    assert received(listener) == "STATUS=calendar gpu1 failed: WATCHDOG=trigger"


def test_unicode_status(listener: socket.socket) -> None:
    systemd.status("réservation de zoë")
    assert received(listener) == "STATUS=réservation de zoë"


def test_without_systemd_nothing_is_sent() -> None:
    assert systemd.notify("READY=1") is False
    assert systemd.ready() is False
    assert systemd.status("x") is False
    assert systemd.watchdog() is False
    assert systemd.stopping() is False


@pytest.mark.parametrize("address", ["", "vsock:2:1234", "relative/path"])
def test_unsupported_addresses_are_ignored(monkeypatch: pytest.MonkeyPatch, address: str) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert systemd.ready() is False


def test_a_socket_that_is_gone_gives_false_not_an_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert systemd.watchdog() is False
    monkeypatch.setenv("NOTIFY_SOCKET", f"@gpuresa-test-gone-{uuid.uuid4().hex}")
    assert systemd.watchdog() is False


@pytest.mark.parametrize(
    ("microseconds", "pid", "expected"),
    [
        ("60000000", None, 60.0),
        ("60000000", "self", 60.0),
        ("1500000", None, 1.5),
        # inherited from a parent: not ours
        ("60000000", "other", None),
        ("60000000", "not-a-pid", None),
        ("0", None, None),
        ("-5", None, None),
        ("sixty", None, None),
        ("", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch,
    microseconds: str | None,
    pid: str | None,
    expected: float | None,
) -> None:
    if microseconds is not None:
        monkeypatch.setenv("WATCHDOG_USEC", microseconds)
    if pid == "self":
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    elif pid == "other":
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    elif pid is not None:
        monkeypatch.setenv("WATCHDOG_PID", pid)
    assert systemd.watchdog_interval() == expected


# --- the unit file ------------------------------------------------------------------------


def test_unit_has_the_required_directives() -> None:
    unit = unit_directives(UNIT.read_text())
    service = unit["Service"]
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]
    assert service["WatchdogSec"] == ["60"]
    assert service["Restart"] == ["on-failure"]
    assert service["StateDirectory"] == ["gpuresa"]
    assert service["ConfigurationDirectory"] == ["gpuresa"]
    assert service["ExecStart"][0].endswith("/gpuresa run")
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    credentials = {value.split(":")[0] for value in service["LoadCredential"]}
    assert credentials == {"caldav-password", "smtp-password"}
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["User"] == ["root"]
    # mounts (the running area, output images, writable layers) need CAP_SYS_ADMIN, and the
    # host's mount namespace: dockerd must see them
    assert "CAP_SYS_ADMIN" in service["CapabilityBoundingSet"][0].split()
    assert set(service) & MOUNT_NAMESPACE_OPTIONS == set()
    assert "ExecStartPre" not in service
    assert "docker.service" in unit["Unit"]["After"][0].split()
    assert "docker.service" in unit["Unit"]["Wants"][0].split()
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.parametrize(
    "path", [UNIT, *sorted(DROP_INS.glob("*.conf"))], ids=lambda path: path.name
)
def test_every_directive_of_the_unit_is_explained(path: Path) -> None:
    # the unit is documentation: each setting has a comment just above it or
    # belongs to a commented group of settings
    lines = path.read_text().splitlines()
    unexplained = []
    for index, line in enumerate(lines):
        if not line or line.startswith(("#", "[")):
            continue
        above = lines[index - 1]
        if not above.startswith("#") and not (above and above[0].isalpha()):
            unexplained.append(line)
    assert unexplained == []


def test_the_drop_ins_change_the_service_only() -> None:
    names = sorted(path.name for path in DROP_INS.glob("*.conf"))
    assert names == ["slurm.conf", "udocker.conf"]
    for name in names:
        assert set(unit_directives((DROP_INS / name).read_text())) == {"Service"}


def test_the_unit_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` when the machine has it, else a strict reading of the file.

    verify insists that ExecStart's program exists, so the check runs on a
    copy whose ExecStart names a stand-in executable.
    """
    analyze = shutil.which("systemd-analyze")
    text = UNIT.read_text()
    if analyze is None:
        # no systemd tools here: the file must at least read as a unit
        unit = unit_directives(text)
        assert set(unit) == {"Unit", "Service", "Install"}
        return
    stand_in = tmp_path / "bin" / "gpuresa"
    stand_in.parent.mkdir()
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)
    copy = tmp_path / "gpuresa.service"
    [exec_start] = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    copy.write_text(text.replace(exec_start, f"ExecStart={stand_in} run"))
    result = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    # verify returns 0 even for unknown directives; any message is a problem
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and "docker.service" not in line
    ]
    assert result.returncode == 0 and problems == [], result.stdout + result.stderr


def test_verify_reports_a_bad_directive(tmp_path: Path) -> None:
    """The check above would notice a typo (it never passes on silence alone)."""
    analyze = shutil.which("systemd-analyze")
    copy = tmp_path / "typo.service"
    copy.write_text("[Service]\nType=notify\nExecStart=/bin/true\nProtectSystm=strict\n")
    if analyze is None:
        unit = unit_directives(copy.read_text())
        assert "ProtectSystem" not in unit["Service"]
        return
    result = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert "ProtectSystm" in result.stdout + result.stderr


def test_a_listener_that_never_reads_does_not_block_the_sender(listener: socket.socket) -> None:
    # the queue of an unread datagram socket fills up; then sending must give up, not hang
    assert systemd.status("first") is True
    for index in range(5000):
        if not systemd.status(f"status number {index}"):
            break
    else:
        pytest.fail("5000 statuses were queued on a socket nobody reads")
