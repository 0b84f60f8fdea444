"""The exact Docker API payloads of a session, for each GPU mode; names and labels.

Pure functions, no engine: these pin what gpuresa asks Docker for, so a change
in what a container may do shows up here first.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.configs import config_of

from gpuresa.backends.engines.create_payloads import (
    FTP_CAPABILITIES,
    MAIN_CAPABILITIES,
    MainContainer,
    ftp_payload,
    main_payload,
    passive_address,
)
from gpuresa.backends.engines.engines import Docker, Podman
from gpuresa.config.sections import Config, HostConfig
from gpuresa.gpus.access import GpuAccess, gpu_access
from gpuresa.model import IdRange, SessionSpec
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import (
    ftp_name,
    safe_key,
    session_from_labels,
    session_labels,
    session_name,
)

START = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
END = datetime(2026, 3, 2, 17, 30, tzinfo=UTC)


def make_config(**host: Any) -> Config:
    return config_of(
        {
            "daemon": {"host": "gpu1"},
            "hosts": [
                {
                    "name": "gpu1",
                    "gpus": [0, 1, 2, 3],
                    "bind_address": "127.0.0.1",
                    "ssh_ports": "20000-20009",
                    "ftp_ports": "21000-21009",
                    "ftp_passive_ports": "30000-30099",
                    "ftp_passive_per_session": 3,
                    **host,
                }
            ],
            "storage": {
                "output_root": "/srv/output",
                "inputs": [
                    {"source": "/srv/ssd/datasets", "target": "/data"},
                    {"source": "/srv/ssd/models", "target": "/models"},
                ],
            },
            "limits": {"cpus": 8.0, "memory": "64g", "shm_size": "16g", "pids": 2048},
        }
    )


def make_spec(gpus: tuple[int, ...] = (1, 3), key: str = "evt-1@example.org") -> SessionSpec:
    return SessionSpec(
        key=key,
        user="alice",
        host="gpu1",
        template="pytorch",
        cuda="12.4",
        gpu_count=len(gpus),
        gpu_indices=gpus,
        start=START,
        end=END,
        ssh_port=20003,
        ftp_port=21003,
        ftp_passive_first=30009,
        ftp_passive_last=30011,
        email="alice@example.org",
    )


def host(mode: str, **settings: Any) -> HostConfig:
    return make_config(gpu_mode=mode, **settings).host()


# --- GPU modes -------------------------------------------------------------------------


def test_nvidia_mode_requests_explicit_device_ids_never_a_count() -> None:
    access = gpu_access(host("nvidia"), (1, 3))
    assert access.device_requests == [
        {
            "Driver": "nvidia",
            "Count": 0,
            "DeviceIDs": ["1", "3"],
            "Capabilities": [["gpu"]],
            "Options": {},
        }
    ]
    assert access.devices == [] and access.mounts == []
    assert access.environment == {
        "NVIDIA_VISIBLE_DEVICES": "1,3",
        # the toolkit shows only the booked GPUs, numbered from 0 inside
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
    }


def test_cdi_mode_names_each_gpu() -> None:
    access = gpu_access(host("cdi"), (0, 2))
    assert access.device_requests == [
        {
            "Driver": "cdi",
            "Count": 0,
            "DeviceIDs": ["nvidia.com/gpu=0", "nvidia.com/gpu=2"],
            "Capabilities": [],
            "Options": {},
        }
    ]
    assert access.environment["NVIDIA_VISIBLE_DEVICES"] == "0,2"
    assert access.environment["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_devices_mode_passes_nodes_at_their_own_paths_and_driver_files_read_only() -> None:
    existing = {
        "/dev/nvidia0",
        "/dev/nvidia1",
        "/dev/nvidia2",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
    }
    access = gpu_access(
        host("devices"),
        (2,),
        existing,
        [Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1")],
        [Path("/usr/bin/nvidia-smi")],
    )
    assert access.device_requests == []
    assert access.devices == [
        {"PathOnHost": path, "PathInContainer": path, "CgroupPermissions": "rwm"}
        for path in ["/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    ]
    assert access.mounts == [
        {
            "Type": "bind",
            "Source": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "Target": "/usr/local/nvidia/lib64/libcuda.so.1",
            "ReadOnly": True,
        },
        {
            "Type": "bind",
            "Source": "/usr/bin/nvidia-smi",
            "Target": "/usr/local/nvidia/bin/nvidia-smi",
            "ReadOnly": True,
        },
    ]
    # no toolkit: the driver sees every GPU, so CUDA is told the host's index
    assert access.environment == {"NVIDIA_VISIBLE_DEVICES": "2", "CUDA_VISIBLE_DEVICES": "2"}


def test_devices_mode_refuses_a_gpu_without_its_node() -> None:
    with pytest.raises(SessionError, match=r"no /dev/nvidia3.*driver loaded"):
        gpu_access(host("devices"), (3,), {"/dev/nvidia0", "/dev/nvidiactl"})
    with pytest.raises(SessionError, match="/dev/nvidiactl"):
        gpu_access(host("devices"), (0,), {"/dev/nvidia0"})


def test_none_mode_gives_nothing_and_refuses_gpus() -> None:
    assert gpu_access(host("none", gpus=[]), ()) == GpuAccess(
        environment={"NVIDIA_VISIBLE_DEVICES": "void"}
    )
    with pytest.raises(SessionError, match="gpu_mode 'none'"):
        gpu_access(host("none", gpus=[]), (0,))


@pytest.mark.parametrize("mode", ["nvidia", "cdi", "devices"])
def test_a_session_without_gpus_gets_none_in_every_mode(mode: str) -> None:
    # an image's NVIDIA_VISIBLE_DEVICES=all must not hand out every GPU
    assert gpu_access(host(mode), ()) == GpuAccess(environment={"NVIDIA_VISIBLE_DEVICES": "void"})


# --- whole payloads -------------------------------------------------------------------------


def test_main_payload_is_exactly_this() -> None:
    config = make_config(gpu_mode="nvidia")
    spec = make_spec()
    labels = session_labels(spec, 20123, Path("/srv/output/alice/x"), "alice")
    main = MainContainer(
        image="gpuresa/pytorch:12.4-abc",
        uid=20123,
        output_dir=Path("/srv/output/alice/x"),
        session_files=Path("/var/lib/gpuresa/sessions/evt-1"),
        command=("python3", "-m", "digits"),
        gpu=gpu_access(config.host(), spec.gpu_indices),
    )
    network = session_name("gpu1", spec.key)
    assert main_payload(config, spec, main, labels) == {
        "Image": "gpuresa/pytorch:12.4-abc",
        "Cmd": ["python3", "-m", "digits"],
        "Hostname": "gpu1-pytorch",
        "Env": [
            "CUDA_VISIBLE_DEVICES=0,1",
            "GPURESA_CUDA=12.4",
            "GPURESA_GPUS=1,3",
            "GPURESA_INPUTS=/data:/models",
            "GPURESA_OUTPUT=/output",
            "GPURESA_SESSION=evt-1@example.org",
            "GPURESA_TEMPLATE=pytorch",
            "GPURESA_UID=20123",
            "GPURESA_USER=alice",
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
            "NVIDIA_VISIBLE_DEVICES=1,3",
        ],
        "Labels": {**labels, "gpuresa.role": "main"},
        "ExposedPorts": {"22/tcp": {}},
        "HostConfig": {
            "NetworkMode": network,
            "PortBindings": {"22/tcp": [{"HostIp": "127.0.0.1", "HostPort": "20003"}]},
            "Mounts": [
                {
                    "Type": "bind",
                    "Source": "/srv/ssd/datasets",
                    "Target": "/data",
                    "ReadOnly": True,
                },
                {
                    "Type": "bind",
                    "Source": "/srv/ssd/models",
                    "Target": "/models",
                    "ReadOnly": True,
                },
                {
                    "Type": "bind",
                    "Source": "/srv/output/alice/x",
                    "Target": "/output",
                    "ReadOnly": False,
                },
                {
                    "Type": "bind",
                    "Source": "/var/lib/gpuresa/sessions/evt-1",
                    "Target": "/etc/gpuresa/session",
                    "ReadOnly": True,
                },
            ],
            "Devices": [],
            "DeviceRequests": [
                {
                    "Driver": "nvidia",
                    "Count": 0,
                    "DeviceIDs": ["1", "3"],
                    "Capabilities": [["gpu"]],
                    "Options": {},
                }
            ],
            "CapDrop": ["ALL"],
            "CapAdd": ["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID", "SYS_CHROOT"],
            "SecurityOpt": [],
            "Privileged": False,
            "Init": True,
            "RestartPolicy": {"Name": "no"},
            "LogConfig": {"Type": "json-file", "Config": {"max-size": "10m", "max-file": "2"}},
            "ShmSize": 16 * 1024**3,
            "PidsLimit": 2048,
            "NanoCpus": 8_000_000_000,
            "Memory": 64 * 1024**3,
        },
        "NetworkingConfig": {"EndpointsConfig": {network: {"Aliases": ["session"]}}},
    }


def test_ftp_payload_is_exactly_this() -> None:
    config = make_config(public_name="gpu1.example.org")
    spec = make_spec()
    labels = session_labels(spec, 20123, Path("/srv/output/alice/x"), "alice")
    network = session_name("gpu1", spec.key)
    payload = ftp_payload(
        config,
        spec,
        "gpuresa/session-ftp:1",
        20123,
        "alice",
        "s3cret",
        Path("/srv/output/alice/x"),
        labels,
        "192.0.2.10",
    )
    bindings = {
        "2121/tcp": [{"HostIp": "127.0.0.1", "HostPort": "21003"}],
        # passive ports: the same number inside and out, as PASV replies name them
        "30009/tcp": [{"HostIp": "127.0.0.1", "HostPort": "30009"}],
        "30010/tcp": [{"HostIp": "127.0.0.1", "HostPort": "30010"}],
        "30011/tcp": [{"HostIp": "127.0.0.1", "HostPort": "30011"}],
    }
    assert payload == {
        "Image": "gpuresa/session-ftp:1",
        "Cmd": [],
        "Hostname": "ftp",
        "Env": [
            "FTP_PASSIVE_ADDRESS=192.0.2.10",
            "FTP_PASSIVE_FIRST=30009",
            "FTP_PASSIVE_LAST=30011",
            "FTP_PASSWORD=s3cret",
            "FTP_PLAIN=no",
            "FTP_UID=20123",
            "FTP_USER=alice",
            f"GPURESA_SESSION={safe_key(spec.key)}",
        ],
        "Labels": {**labels, "gpuresa.role": "ftp"},
        "ExposedPorts": {port: {} for port in bindings},
        "HostConfig": {
            "NetworkMode": network,
            "PortBindings": bindings,
            "Mounts": [
                {
                    "Type": "bind",
                    "Source": "/srv/output/alice/x",
                    "Target": "/output",
                    "ReadOnly": False,
                }
            ],
            "Devices": [],
            "DeviceRequests": [],
            "CapDrop": ["ALL"],
            "CapAdd": ["CHOWN", "SETGID", "SETUID", "SYS_CHROOT"],
            "SecurityOpt": ["no-new-privileges:true"],
            "Privileged": False,
            "Init": True,
            "RestartPolicy": {"Name": "no"},
            "LogConfig": {"Type": "json-file", "Config": {"max-size": "10m", "max-file": "2"}},
            "PidsLimit": 128,
            "Memory": 256 * 1024**2,
            "MemorySwap": 256 * 1024**2,
            "NanoCpus": 500_000_000,
        },
        "NetworkingConfig": {"EndpointsConfig": {network: {"Aliases": ["ftp"]}}},
    }


@pytest.mark.parametrize("mode", ["nvidia", "cdi", "devices", "none"])
def test_no_payload_is_privileged_or_reaches_the_docker_socket(mode: str) -> None:
    config = make_config(gpu_mode=mode)
    spec = make_spec(gpus=() if mode == "none" else (0,))
    gpu = gpu_access(config.host(), spec.gpu_indices, {"/dev/nvidia0", "/dev/nvidiactl"})
    labels = session_labels(spec, 20123, Path("/srv/output/a"), "alice")
    main = MainContainer(
        "image",
        20123,
        Path("/srv/output/a"),
        Path("/var/lib/gpuresa/sessions/a"),
        gpu=gpu,
    )
    payloads = [
        main_payload(config, spec, main, labels),
        ftp_payload(config, spec, "ftp", 20123, "alice", "pw", Path("/srv/output/a"), labels),
    ]
    for payload in payloads:
        settings = payload["HostConfig"]
        assert settings["Privileged"] is False
        assert settings["CapDrop"] == ["ALL"]
        assert set(settings["CapAdd"]) <= set(MAIN_CAPABILITIES) | set(FTP_CAPABILITIES)
        assert "SYS_ADMIN" not in settings["CapAdd"] and "NET_ADMIN" not in settings["CapAdd"]
        sources = [mount["Source"] for mount in settings["Mounts"]]
        assert not any("docker.sock" in source or source == "/" for source in sources)
        # every mount comes from the config: inputs, the output folder, and
        # the session's own files, read-only
        allowed = {"/srv/ssd/datasets", "/srv/ssd/models", "/srv/output/a"}
        session_files = "/var/lib/gpuresa/sessions/a"
        assert set(sources) <= allowed | {session_files}
        assert all(
            mount["ReadOnly"] for mount in settings["Mounts"] if mount["Source"] == session_files
        )
        assert "host" not in (
            settings["NetworkMode"],
            settings.get("PidMode"),
            settings.get("IpcMode"),
        )
    # sudo needs setuid binaries: no no-new-privileges on the main container only
    assert payloads[0]["HostConfig"]["SecurityOpt"] == []
    assert payloads[1]["HostConfig"]["SecurityOpt"] == ["no-new-privileges:true"]


@pytest.mark.parametrize(
    ("public_name", "bind_address", "expected"),
    [
        ("gpu1.example.org", "0.0.0.0", "gpu1.example.org"),
        (None, "192.0.2.10", "192.0.2.10"),
        (None, "0.0.0.0", ""),
    ],
)
def test_passive_address(public_name: str | None, bind_address: str, expected: str) -> None:
    settings: dict[str, Any] = {"bind_address": bind_address}
    if public_name:
        settings["public_name"] = public_name
    assert passive_address(make_config(**settings).host()) == expected


# --- names and labels ------------------------------------------------------------------------


def test_names_are_docker_safe_and_carry_the_host() -> None:
    key = "040000008200E00074C5B7101A82E008@outlook:RECURRENCE-ID/2026"
    name = session_name("gpu1", key)
    assert name.startswith("gpuresa-gpu1-")
    assert ftp_name("gpu1", key) == f"{name}-ftp"
    assert all(character.isalnum() or character in "_.-" for character in name)


@given(st.text(min_size=1, max_size=200), st.text(min_size=1, max_size=200))
def test_safe_keys_are_safe_and_never_collide(first: str, second: str) -> None:
    for key in (first, second):
        made = safe_key(key)
        # up to 40 readable characters, a dash and 20 hex digits
        assert made and len(made) <= 61
        assert all(character in "abcdefghijklmnopqrstuvwxyz0123456789_.-" for character in made)
        assert not made.startswith(("-", "."))
    if first != second:
        assert safe_key(first) != safe_key(second)


def test_labels_give_the_session_back() -> None:
    spec = make_spec()
    labels = session_labels(spec, 20123, Path("/srv/output/alice/x"), "alice")
    session = session_from_labels(labels, "running", ("main", "ftp"), "pw")
    assert (session.key, session.user, session.host, session.template, session.cuda) == (
        spec.key,
        "alice",
        "gpu1",
        "pytorch",
        "12.4",
    )
    assert session.gpu_indices == (1, 3)
    assert (session.start, session.end) == (START, END)
    assert (session.ssh_port, session.ftp_port) == (20003, 21003)
    assert (session.ftp_passive_first, session.ftp_passive_last) == (30009, 30011)
    assert session.output_dir == Path("/srv/output/alice/x")
    assert (session.ftp_user, session.ftp_password, session.email) == ("alice", "pw", spec.email)
    moved = datetime(2026, 3, 2, 19, 0, tzinfo=UTC)
    assert session_from_labels(labels, "running", (), end=moved).end == moved


def test_labels_gpuresa_did_not_write_are_refused() -> None:
    with pytest.raises(KeyError):
        session_from_labels({"gpuresa.reservation": "x"}, "running", ())


def test_podman_sessions_ask_for_a_namespace_of_their_own_and_the_sidecar_shares_it() -> None:
    config = make_config()
    spec = make_spec(gpus=())
    labels = session_labels(spec, 20123, Path("/srv/output/alice/x"), "alice")
    podman = Podman()
    main = MainContainer(
        image="gpuresa/pytorch:1",
        uid=20123,
        output_dir=Path("/srv/output/alice/x"),
        session_files=Path("/var/lib/gpuresa/sessions/evt-1"),
        engine_settings=podman.main_settings(config.limits),
    )
    settings = main_payload(config, spec, main, labels)["HostConfig"]
    assert settings["UsernsMode"] == "auto:size=65536"
    assert settings["Sysctls"] == {"net.ipv4.ip_unprivileged_port_start": "0"}
    limits = {limit["Name"]: (limit["Soft"], limit["Hard"]) for limit in settings["Ulimits"]}
    assert limits["nproc"] == (config.limits.pids, config.limits.pids)
    assert 0 < limits["nofile"][0] == limits["nofile"][1]
    # everything else is the Docker payload's: no capability, mount or privilege more
    docker_settings = main_payload(
        config, spec, dataclasses.replace(main, engine_settings={}), labels
    )["HostConfig"]
    assert {
        name: value for name, value in settings.items() if name not in main.engine_settings
    } == docker_settings

    ids = IdRange(2131072, 2131072, 65536)
    sidecar = ftp_payload(
        config,
        spec,
        "gpuresa/session-ftp:1",
        20123,
        "alice",
        "s3cret",
        Path("/srv/output/alice/x"),
        labels,
        engine_settings=podman.sidecar_settings(ids, config.limits),
    )["HostConfig"]
    assert sidecar["UsernsMode"] == (
        "auto:size=65536,uidmapping=0:2131072:65536,gidmapping=0:2131072:65536"
    )
    # Docker adds nothing: userns-remap is the engine's own setting
    assert Docker().main_settings(config.limits) == {}
    assert Docker().sidecar_settings(ids, config.limits) == {}
    with pytest.raises(SessionError, match="not known"):
        podman.sidecar_settings(None, config.limits)
