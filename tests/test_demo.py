"""The demo's files: a config that loads, with the status page on a free local port."""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuresa.commands import demo
from gpuresa.commands.demo import STATUS_PORT, status_page, write_demo
from gpuresa.config.reading import load_config

NOW = datetime(2026, 11, 22, 20, 0, tzinfo=UTC)


def test_the_demo_serves_its_status_page_on_127_0_0_1(tmp_path: Path) -> None:
    files = write_demo(tmp_path, NOW, timedelta(seconds=30), timedelta(minutes=5))
    config = load_config(files.config)
    assert config.telemetry.listen is not None
    host, port = config.telemetry.listen.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) >= STATUS_PORT
    assert status_page(config) == f"http://127.0.0.1:{port}/"
    # the port is free: the daemon can bind it
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", int(port)))


def test_a_taken_status_port_falls_back_to_a_free_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))  # another program holds the demo's usual port
        holder.listen()
        taken = int(holder.getsockname()[1])
        monkeypatch.setattr(demo, "STATUS_PORT", taken)
        files = write_demo(tmp_path, NOW, timedelta(seconds=30), timedelta(minutes=5))
        listen = load_config(files.config).telemetry.listen
        assert listen is not None and listen.startswith("127.0.0.1:")
        assert int(listen.rsplit(":", 1)[1]) > taken
