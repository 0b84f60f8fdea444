"""The daemon when the Docker engine does not answer: it waits, retries, and catches up.

The daemon reaches the engine through a socket path that does not exist at
first; making it a link to the real socket is the engine "coming back".
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import docker
import pytest
from conftest import BASE_IMAGE, TEST_HOST, DockerHarness, free_port
from test_daemon_cli import ics_event

from gpuresa.config import load_config
from gpuresa.daemon import Daemon
from gpuresa.runtime import Runtime


def test_daemon_waits_for_docker_and_starts_the_session_when_it_is_back(
    tmp_path: Path, docker_harness: DockerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    calendar = tmp_path / "calendar"
    calendar.mkdir()
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "alice.pub").write_text(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHs4Zp2n8m0rXr8m0c2mKqzCZkqk1Qv4cJQy6o0qQy8A alice\n"
    )
    first = free_port()
    while first > 64000:
        first = free_port()
    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f"""
[daemon]
host = "{TEST_HOST}"
state_dir = "{tmp_path / "state"}"
poll_interval = "1s"
docker_retry_max = "2s"
[[calendars]]
name = "folder"
kind = "ics"
url = "{calendar}"
host = "{TEST_HOST}"
default_template = "pytorch"
[[hosts]]
name = "{TEST_HOST}"
gpus = [0]
gpu_mode = "none"
bind_address = "127.0.0.1"
ssh_ports = "{first}-{first + 1}"
ftp_ports = "{first + 2}-{first + 3}"
ftp_passive_ports = "{first + 4}-{first + 13}"
ftp_passive_per_session = 5
[templates]
base_image = "{BASE_IMAGE}"
[users]
keys_dir = "{keys}"
host_authorized_keys = false
[storage]
output_root = "{tmp_path / "output"}"
[limits]
shm_size = "64m"
"""
    )
    config = load_config(config_file)
    real = Runtime(config, docker.from_env())
    real.ensure_image("pytorch", None)
    start = datetime.now(UTC).replace(microsecond=0)
    (calendar / "a.ics").write_text(
        ics_event("outage-1", start, start + timedelta(minutes=30), "alice", "gpus: 1")
    )

    link = tmp_path / "docker.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{link}")
    daemon = Daemon(config)
    daemon.start()
    try:
        time.sleep(4)
        # nothing could start, nothing crashed, and the retries back off
        assert real.list_sessions() == []
        assert daemon.docker_backoff > timedelta(seconds=1)
        assert daemon.scheduler.get_job("docker-retry") is not None
        assert daemon.journal.state("outage-1") == "booked"

        os.symlink("/var/run/docker.sock", link)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if daemon.journal.state("outage-1") == "running":
                break
            time.sleep(0.2)
        assert [(session.key, session.state) for session in real.list_sessions()] == [
            ("outage-1", "running")
        ]
        assert daemon.journal.state("outage-1") == "running"
        assert daemon.docker_backoff == timedelta(seconds=1)
    finally:
        daemon.shutdown()
