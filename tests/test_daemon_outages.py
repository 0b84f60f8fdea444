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
from conftest import DockerHarness
from test_daemon_cli import ics_event, write_ics_config

from gpuresa.config import load_config
from gpuresa.daemon import Daemon
from gpuresa.runtime import Runtime


def test_daemon_waits_for_docker_and_starts_the_session_when_it_is_back(
    tmp_path: Path, docker_harness: DockerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_file = write_ics_config(tmp_path, 'docker_retry_max = "2s"')
    calendar = tmp_path / "calendar"
    config = load_config(config_file)
    real = Runtime(config, docker.from_env())
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
