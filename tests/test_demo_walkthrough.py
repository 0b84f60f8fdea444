"""`make demo` as a newcomer follows it: each command the demo prints works as printed.

The real demo (`gpuresa demo`, the default ports: privileged SSH, FTP and SFTP,
passive ports of the default range) on Docker, its booking shortened. The
test runs what the demo prints, in the order a user would: `ssh` (trusting
the host only through the printed known_hosts file, non-interactively), FTPS
upload and download with lftp and curl (checking the printed certificate),
SFTP right after the end; then Ctrl-C, and nothing of the demo is left.
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BASE_IMAGE
from support.waiting import wait_for

from gpuresa.outputs.credentials import self_signed

pytestmark = [pytest.mark.docker]

GPURESA = Path(sys.executable).parent / "gpuresa"


class Demo:
    """A running `gpuresa demo` and the lines it printed so far."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.process = subprocess.Popen(
            [str(GPURESA), "demo", "--dir", str(root), "--start-in", "25s", "--length", "75s"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.incoming: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.incoming.put(line.rstrip("\n"))

    def wait_for(self, predicate: str, timeout: float) -> None:
        """Read lines until one contains `predicate`; fails with the output so far."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.incoming.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            self.lines.append(line)
            if predicate in line:
                return
        pytest.fail(f"the demo did not print {predicate!r}:\n" + "\n".join(self.lines))

    def printed(self, program: str) -> list[list[str]]:
        """The commands the demo printed that run `program`, as argument lists."""
        return [
            shlex.split(line.strip())
            for line in self.lines
            if line.strip().startswith(f"{program} ")
        ]

    def interrupt(self) -> int:
        """Ctrl-C, as a terminal sends it to the demo's process group; its exit status."""
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(timeout=120)
        finally:
            while not self.incoming.empty():
                self.lines.append(self.incoming.get())


@pytest.fixture
def demo(tmp_path: Path, docker_client: Any) -> Iterator[Demo]:
    docker_client.images.get(BASE_IMAGE)  # `make setup` built the demo's base image
    running = Demo(tmp_path / "demo")
    yield running
    if running.process.poll() is None:
        os.killpg(running.process.pid, signal.SIGKILL)
        running.process.wait()
        # a demo killed before its own clean-up: its release, as an admin would run it
        subprocess.run(
            [
                str(GPURESA),
                "host",
                "release",
                "--all",
                "--config",
                str(running.root / "config.toml"),
            ],
            check=False,
        )


def run(command: list[str], stdin: str = "", timeout: float = 60) -> str:
    result = subprocess.run(
        command, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"{shlex.join(command)}:\n{result.stdout}{result.stderr}"
    return result.stdout


def demo_traces(root: Path) -> list[str]:
    """What of the demo is on the machine: containers, networks, mounts, loop devices."""
    traces = []
    for kind in ("ps", "network ls"):
        listed = subprocess.run(
            ["docker", *kind.split(), "-q", "--filter", "label=gpuresa.host=demo"]
            + (["-a"] if kind == "ps" else []),
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        traces += [f"docker {kind}: {name}" for name in listed]
    traces += [
        f"mount: {line}"
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if str(root) in line
    ]
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    traces += [f"loop: {line}" for line in loops.splitlines() if str(root) in line]
    return traces


def test_each_command_the_demo_prints_works_as_printed(demo: Demo, tmp_path: Path) -> None:
    demo.wait_for("Ctrl-C stops it", 600)  # the image is built on the first run
    demo.wait_for("sftp ", 120)
    # SSH, trusting the host through the printed known_hosts file alone: no prompt
    (ssh,) = demo.printed("ssh")
    said = run([*ssh, "-o", "BatchMode=yes", "id -un; cat /data/README.txt"], timeout=60)
    assert said.splitlines()[0] == "demo" and "input data" in said
    run([*ssh, "-o", "BatchMode=yes", "echo written over ssh > /output/from-ssh.txt"])

    # FTPS: lftp, then curl, each checking the printed certificate
    (lftp,) = demo.printed("lftp")
    upload = tmp_path / "upload.bin"
    upload.write_bytes(os.urandom(3 * 1024 * 1024))
    fetched = tmp_path / "fetched-lftp.bin"
    run(lftp, f"put {upload} -o by-lftp.bin\nget by-lftp.bin -o {fetched}\nbye\n")
    assert fetched.read_bytes() == upload.read_bytes()
    curl_upload, curl_download = demo.printed("curl")
    run(curl_upload)
    here = tmp_path / "here"
    here.mkdir()
    subprocess.run(curl_download, cwd=here, check=True, timeout=60)
    assert "input data" in (here / "README.txt").read_text()

    # a certificate the client does not trust is refused (the check above is real)
    stranger = tmp_path / "stranger.pem"
    stranger.write_bytes(self_signed("127.0.0.1")[1])
    trusted = str(demo.root / "ftps-cert.pem")
    refused = subprocess.run(
        [str(stranger) if arg == trusted else arg for arg in curl_download],
        cwd=here, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 60, refused.stderr  # curl: the peer's certificate is not trusted

    # SFTP right after the end
    demo.wait_for("stopped; its output goes to", 180)
    demo.wait_for("read-only (", 60)  # handed over, then moved to its final place
    (sftp,) = demo.printed("sftp")
    logins_outputs = demo.root / "output" / "demo"
    wait_for(lambda: any(logins_outputs.iterdir()), 10, "the output at its final place")
    (output,) = logins_outputs.iterdir()
    listing = run([*sftp[:1], "-b", "-", *sftp[1:]], f"ls {output.name}\n")
    assert "from-ssh.txt" in listing and "by-lftp.bin" in listing, listing

    # Ctrl-C: the daemon stops and the demo removes everything it made
    assert demo.interrupt() == 0, "\n".join(demo.lines)
    assert demo_traces(demo.root) == []
    assert (demo.root / "output" / "demo").is_dir()  # the output stays
