"""The demo's files: a config that loads, with the status page on a free local port."""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuresa.commands import demo
from gpuresa.commands.demo import STATUS_PORT, status_page, write_demo
from gpuresa.commands.demo_gpus import choose_gpus
from gpuresa.config.reading import load_config
from gpuresa.config.sections import HostConfig

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


@pytest.mark.parametrize(
    ("listing", "runtimes", "count", "mode"),
    [
        ([], {"runc"}, 0, "none"),  # no driver: nvidia-smi printed nothing
        (["GPU 0: NVIDIA H100 (UUID: GPU-1)"], {"runc", "nvidia"}, 1, "nvidia"),
        (["GPU 0: A (UUID: GPU-1)", "GPU 1: A (UUID: GPU-2)"], {"runc"}, 2, "devices"),
        (["No devices were found"], {"nvidia"}, 0, "none"),
    ],
)
def test_the_demo_books_a_gpu_where_the_host_has_one(
    tmp_path: Path, listing: list[str], runtimes: set[str], count: int, mode: str
) -> None:
    gpus = choose_gpus(listing, runtimes)
    assert (gpus.count, gpus.mode) == (count, mode)
    host = load_config(
        write_demo(tmp_path, NOW, timedelta(seconds=30), timedelta(minutes=5), gpus).config
    ).host()
    assert host.gpu_mode == mode
    assert host.gpus == ("auto" if count else ())
    # without NVIDIA's toolkit, the driver's libraries are bind-mounted with the devices
    assert bool(host.driver_libraries) == (mode == "devices")


def test_the_demo_uses_the_default_kinds_of_ports(tmp_path: Path) -> None:
    host = load_config(
        write_demo(tmp_path, NOW, timedelta(seconds=30), timedelta(minutes=5)).config
    ).host()
    defaults = HostConfig(name="x")
    # SSH and FTP control privileged, as by default; passive ports where the default range is
    assert defaults.ssh_ports.first <= host.ssh_ports.first < 1024
    assert host.ftp_ports.last < 1024
    assert host.ftp_passive_ports.first >= defaults.ftp_passive_ports.first > 1024
