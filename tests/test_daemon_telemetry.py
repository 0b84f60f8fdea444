"""The daemon with GPU telemetry: /metrics and the page while a session runs, idle notices,
GPUs gone from the host left out of planning, and the SIGTERM budget with the server up.

The GPUs are the recorded H100 answers (tests/nvml_replay.py) given to the
telemetry gateway. This machine has no GPU and no NVIDIA runtime, so Docker
is reached through a client that drops the session's NVIDIA device request
(what the NVIDIA runtime would have served) and passes everything else to the
real engine: the session holds GPU 0 in its labels as on a GPU host.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import docker
import pytest
from conftest import DockerHarness, SMTPServer, free_port
from nvml_replay import RecordedNvml
from prometheus_client.parser import text_string_to_metric_families
from support.waiting import wait_for
from test_daemon_cli import ics_event, write_ics_config
from test_daemon_outages import wait_until_running

from gpuresa.backends.engines import Runtime
from gpuresa.config.reading import load_config
from gpuresa.daemon import Daemon
from gpuresa.daemon.observing import held_back, planning_inventory
from gpuresa.gpus.telemetry import Telemetry
from gpuresa.gpus.tracker import HostInspector
from gpuresa.model import SessionSpec
from gpuresa.planning.actions import Recreate, Start, Stop

BUSY_PERCENT = 98  # what the recorded busy H100 said (nvml-busy.json)


class SwitchableNvml:
    """The recorded NVML answers of one moment ("busy", "idle"), switched by the test."""

    def __init__(self, name: str) -> None:
        self.recorded = RecordedNvml(name)
        self.NVMLError = self.recorded.NVMLError

    def switch(self, name: str) -> None:
        self.recorded = RecordedNvml(name)

    def samples(self) -> int:
        """How many GPU samples were taken since the last switch."""
        return sampled(self.recorded)

    def __getattr__(self, function: str) -> Any:
        return getattr(self.recorded, function)


def sampled(nvml: RecordedNvml) -> int:
    """How many GPU samples `nvml` answered (each reads the GPUs' use once)."""
    return nvml.calls.count("nvmlDeviceGetUtilizationRates")


def after_more_samples(daemon: Daemon, samples: Callable[[], int], more: int) -> None:
    """Return once `more` samples were taken and every notice they caused was sent.

    What a test asserts then did not happen had its chances: evidence the
    daemon looked, which a fixed sleep on a loaded machine cannot give.
    """
    wanted = samples() + more
    wait_for(lambda: samples() >= wanted, 30 + 2 * more, f"{more} more GPU samples")
    assert daemon.outbox is not None
    outbox = daemon.outbox
    wait_for(lambda: outbox.backlog() == 0, 30, "the notices sent")


class _NoNvidiaApi:
    """docker-py's low-level API with the NVIDIA device requests taken out of new containers."""

    def __init__(self, api: Any) -> None:
        self._api = api

    def create_container_from_config(self, config: dict[str, Any], name: str) -> Any:
        host = dict(config.get("HostConfig") or {})
        host.pop("DeviceRequests", None)
        return self._api.create_container_from_config({**config, "HostConfig": host}, name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)


class EngineWithoutNvidia:
    """A `docker.DockerClient` stand-in: one real client per thread, NVIDIA requests dropped."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = docker.from_env(max_pool_size=16)
        return client

    @property
    def api(self) -> Any:
        return _NoNvidiaApi(self._client().api)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client(), name)


def gpu_config(directory: Path, smtp_port: int, listen: str, telemetry: str = "") -> Path:
    """An ICS-folder config whose host hands out GPU 0, with [telemetry] and mail."""
    config_file = write_ics_config(directory)
    text = config_file.read_text().replace('gpu_mode = "none"', 'gpu_mode = "nvidia"')
    text += (
        f'[notify]\nenabled = true\nsmtp_host = "127.0.0.1"\nsmtp_port = {smtp_port}\n'
        '[users.emails]\nalice = "alice@example.org"\n'
        f'[telemetry]\nbackend = "nvml"\nsample_interval = "1s"\nlisten = "{listen}"\n'
        f"{telemetry}"
    )
    config_file.write_text(text)
    return config_file


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return str(answer.read().decode("utf-8"))


def samples(text: str) -> dict[str, list[Any]]:
    families = text_string_to_metric_families(text)
    return {family.name: family.samples for family in families}


def test_metrics_page_and_one_idle_notice_while_a_session_runs(
    tmp_path: Path, docker_harness: DockerHarness, smtp_server: SMTPServer
) -> None:
    port = free_port()
    config_file = gpu_config(
        tmp_path,
        smtp_server.port,
        f"127.0.0.1:{port}",
        'idle_threshold = 5\nidle_after = "3s"\n',
    )
    config = load_config(config_file)
    start = datetime.now(UTC).replace(microsecond=0)
    key = "telemetry-1"
    (tmp_path / "calendar" / "a.ics").write_text(
        ics_event(key, start, start + timedelta(minutes=30), "alice", "gpus: 1")
    )
    nvml = SwitchableNvml("busy")
    daemon = Daemon(
        config,
        runtime=Runtime(config, EngineWithoutNvidia()),
        telemetry=Telemetry("nvml", nvml=nvml),
        # the recorded GPU has no node of its own: /dev/nvidia0 may be another test's
        # stand-in, which this session's devices cgroup does not allow (a "lost" GPU, and the
        # session made again, is the next test's matter)
        inspector=HostInspector(device_pattern=str(tmp_path / "no-node-{minor}")),
    )
    daemon.start()
    try:
        wait_until_running(daemon, key, 60)
        metrics = f"http://127.0.0.1:{port}/metrics"

        def utilization_of_session() -> list[Any]:
            found = samples(get(metrics)).get("gpuresa_gpu_utilization_percent", [])
            return [sample for sample in found if sample.labels["key"] == key]

        wait_for(utilization_of_session, 30, "the session's GPU use in /metrics")
        [gpu] = utilization_of_session()
        assert gpu.labels == {
            "gpu": "0",
            "uuid": gpu.labels["uuid"],
            "user": "alice",
            "key": key,
        }
        assert gpu.labels["uuid"].startswith("GPU-")
        assert gpu.value == BUSY_PERCENT
        scraped = samples(get(metrics))
        by_state = {s.labels["state"]: s.value for s in scraped["gpuresa_sessions"]}
        assert by_state == {"created": 0, "running": 1, "stopped": 0}
        assert [s.value for s in scraped["gpuresa_telemetry_up"]] == [1]
        assert [s.value for s in scraped["gpuresa_gpus_booked"]] == [1]

        # the start's latency, from its dispatch to the session answering, is counted once
        def start_counts() -> list[float]:
            found = samples(get(metrics)).get("gpuresa_session_start_seconds", [])
            return [sample.value for sample in found if sample.name.endswith("_count")]

        wait_for(start_counts, 10, "the start's latency in /metrics")
        assert start_counts() == [1]
        page = get(f"http://127.0.0.1:{port}/")
        assert key in page and "alice" in page

        # the GPU falls idle: after idle_after one notice to alice, with the figures
        nvml.switch("idle")
        messages = smtp_server.wait_for(2, timeout=60)
        idle = [m for m in messages if "idle" in str(m["Subject"])]
        assert len(idle) == 1
        body = idle[0].get_content()
        assert str(idle[0]["To"]) == "alice@example.org"
        assert key in body and "0 %" in body and "threshold 5 %" in body
        # it stays idle: no second notice, idle_after (3 s) and more later
        after_more_samples(daemon, nvml.samples, 5)
        assert len([m for m in smtp_server.messages if "idle" in str(m["Subject"])]) == 1
        idle_gpus = samples(get(metrics))["gpuresa_gpus_idle"]
        assert [s.value for s in idle_gpus] == [1]
    finally:
        daemon.shutdown()


def main_container(harness: DockerHarness) -> Any:
    mains = [c for c in harness.ours() if c.labels.get("gpuresa.role") == "main"]
    return mains[0] if len(mains) == 1 else None


def test_a_session_whose_container_lost_its_gpus_is_recreated_once(
    tmp_path: Path, docker_harness: DockerHarness, smtp_server: SMTPServer
) -> None:
    config = load_config(gpu_config(tmp_path, smtp_server.port, f"127.0.0.1:{free_port()}"))
    start = datetime.now(UTC).replace(microsecond=0)
    key = "lost-1"
    (tmp_path / "calendar" / "a.ics").write_text(
        ics_event(key, start, start + timedelta(minutes=30), "alice", "gpus: 1")
    )
    # /dev/kmsg stands for the GPU's device node: Docker's device cgroup never lets a
    # container open it, as after a host `systemctl daemon-reload` took the GPU away
    nvml = RecordedNvml("busy")
    daemon = Daemon(
        config,
        runtime=Runtime(config, EngineWithoutNvidia()),
        telemetry=Telemetry("nvml", nvml=nvml),
        inspector=HostInspector(device_pattern="/dev/kmsg"),
    )
    began = int(time.time()) - 1

    def mains_made() -> list[dict[str, str]]:
        """The labels of each main container made for the session so far, oldest first.

        Read from the engine's events: the first may be gone before a listing sees it
        (the loss is seen in the first sample after the start, often within a second).
        """
        events = docker_harness.client.events(
            since=began,
            until=int(time.time()) + 1,
            decode=True,
            filters={"type": "container", "event": "create",
                     "label": [f"gpuresa.reservation={key}", "gpuresa.role=main",
                               f"gpuresa.host={docker_harness.host_name}"]},
        )  # fmt: skip
        return [event["Actor"]["Attributes"] for event in events]

    daemon.start()
    try:

        def made_again() -> list[dict[str, str]] | None:
            made = mains_made()
            return made if len(made) >= 2 else None

        made = wait_for(made_again, 60, "the session's main container made again")
        first, second = made[:2]
        assert first["gpuresa.output"] == second["gpuresa.output"]
        wait_until_running(daemon, key, 60)
        main = main_container(docker_harness)
        assert main is not None and main.labels["gpuresa.output"] == first["gpuresa.output"]
        wait_for(
            lambda: any("recreated" in str(m["Subject"]) for m in smtp_server.messages),
            20,
            "the notice of the recreation",
        )
        # the new containers cannot open it either: not recreated again, nor told again,
        # however many samples see the loss
        after_more_samples(daemon, lambda: sampled(nvml), 6)
        assert len(mains_made()) == 2
        assert main_container(docker_harness).id == main.id
        told = [m for m in smtp_server.messages if "recreated" in str(m["Subject"])]
        assert len(told) == 1
        assert "output folder and your booking are unchanged" in told[0].get_content()
    finally:
        daemon.shutdown()


def test_shutdown_with_the_server_up_and_a_client_that_never_finishes(tmp_path: Path) -> None:
    port = free_port()
    config_file = write_ics_config(tmp_path)
    config_file.write_text(
        config_file.read_text() + f'[telemetry]\nbackend = "none"\nlisten = "127.0.0.1:{port}"\n'
    )
    daemon = Daemon(load_config(config_file))
    daemon.start()
    wait_for(lambda: "gpuresa_sessions" in get(f"http://127.0.0.1:{port}/metrics"), 20, "metrics")
    # a client that opened a request and never sent the rest of it
    hanging = socket.create_connection(("127.0.0.1", port))
    hanging.sendall(b"GET /metrics HTTP/1.1\r\n")
    try:
        began = time.monotonic()
        daemon.shutdown()
        assert time.monotonic() - began < 5
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        hanging.close()


def test_a_taken_listen_address_is_one_clear_error(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    config_file = write_ics_config(tmp_path)
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    config_file.write_text(config_file.read_text() + f'[telemetry]\nlisten = "{address}"\n')
    daemon = Daemon(load_config(config_file))
    try:
        from gpuresa.errors import UserError

        with pytest.raises(UserError, match=r"\[telemetry\] listen"):
            daemon.start()
        # the state directory is free again for a daemon started after the fix
        config_file.write_text(config_file.read_text().replace(f'listen = "{address}"\n', ""))
        fixed = Daemon(load_config(config_file))
        fixed.start()
        fixed.shutdown()
    finally:
        taken.close()


def spec(key: str, gpus: tuple[int, ...]) -> SessionSpec:
    start = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
    return SessionSpec(
        key=key, user="alice", host="h", template="pytorch", cuda=None,
        gpu_count=len(gpus), gpu_indices=gpus,
        start=start, end=start + timedelta(hours=2), ssh_port=20000, ftp_port=21000,
        ftp_passive_first=22000, ftp_passive_last=22009, email=None,
    )  # fmt: skip


def test_a_gpu_gone_from_the_host_is_left_out_of_planning(tmp_path: Path) -> None:
    host = load_config(write_ics_config(tmp_path)).host()
    assert planning_inventory(host, (0, 1, 2, 3), {2: "GPU-2"}).gpus == (0, 1, 3)
    assert planning_inventory(host, (0, 1), {}).gpus == (0, 1)
    actions = [
        Stop("ending"),
        Start("on-lost", spec=spec("on-lost", (1, 2))),
        Recreate("recreate-lost", spec=spec("recreate-lost", (2,))),
        Start("elsewhere", spec=spec("elsewhere", (0,))),
    ]
    kept, held = held_back(actions, {2: "GPU-2"})
    assert [action.key for action in kept] == ["ending", "elsewhere"]
    assert held == ["on-lost", "recreate-lost"]
