"""How long a session takes to start and stop, against a bare `docker run` of its image.

`--engine podman` measures the same on the Podman service (its bare run gets
the user namespace of its own and the limits a Podman session gets).
`--engine udocker` measures a udocker host's sessions (run as a host account
the benchmark makes and removes): a login's first session, a start from the
login's spare container and one that unpacks its image, prepare, prepared
start until the login, stop; there is no bare run to compare with.

Measures, in one run and interleaved (so both see the same machine):

- session start (network, main container, FTP sidecar, readiness checks) until
  the user's SSH login succeeds, from nothing and from a prepared session;
- a bare `docker run` of the same image (same entrypoint, same login and key)
  until its sshd accepts the same login;
- session stop (containers and network removed, output kept).

Prints a table of medians; the target is a start at most 1.5 times the bare run.
Needs the engine and the local base image (`make setup`); everything it
makes is labelled with its own host name and removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import docker
import docker.errors
import paramiko

from gpuresa.backends.engines import Runtime
from gpuresa.backends.engines.engines import PODMAN_SOCKET
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.model import SessionSpec
from gpuresa.outputs.running_area import release_area

BASE_IMAGE = "gpuresa/base:bookworm"
LOGIN = "bench"
UID = 23456


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_block(size: int) -> int:
    for _ in range(200):
        first = random.randrange(40000, 60000 - size)
        if all(port_free(port) for port in range(first, first + size)):
            return first
    raise SystemExit(f"no {size} consecutive free ports in 40000-60000")


def make_config(root: Path, host: str, engine: str) -> Config:
    for folder in ("keys", "output", "state", "input"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    first = free_block(2 + 2 + 2 * 3)
    return parse_config(
        {
            "daemon": {"host": host, "state_dir": str(root / "state")},
            "hosts": [
                {
                    "name": host,
                    "engine": engine,
                    "gpus": [],
                    "gpu_mode": "none",
                    "bind_address": "127.0.0.1",
                    "ssh_ports": f"{first}-{first + 1}",
                    "ftp_ports": f"{first + 2}-{first + 3}",
                    "ftp_passive_ports": f"{first + 4}-{first + 9}",
                    "ftp_passive_per_session": 3,
                }
            ],
            "templates": {"base_image": BASE_IMAGE},
            "users": {
                "keys_dir": str(root / "keys"),
                "host_authorized_keys": False,
                "uids": {LOGIN: UID},
            },
            "storage": {
                "output_root": str(root / "output"),
                "inputs": [{"source": str(root / "input"), "target": "/data"}],
            },
            "limits": {"shm_size": "256m", "layer_size": os.environ.get("BENCH_LAYER_SIZE", "30g")},
        },
        str(root / "bench.toml"),
    )


def wait_for_login(port: int, key: paramiko.PKey, timeout: float = 30, user: str = LOGIN) -> None:
    """Return as soon as `user` logs in with `key` on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while True:
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            client.connect(
                "127.0.0.1",
                port,
                username=user,
                pkey=key,
                look_for_keys=False,
                allow_agent=False,
                timeout=2,
                banner_timeout=2,
                auth_timeout=2,
            )
            return
        except (OSError, EOFError, paramiko.SSHException):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
        finally:
            client.close()


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="measurements of each (>= 5)")
    parser.add_argument(
        "--engine",
        choices=("docker", "podman", "udocker"),
        default="docker",
        help="the engine to measure",
    )
    arguments = parser.parse_args()
    engine = arguments.engine
    rounds = max(5, arguments.rounds)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    if engine == "udocker":
        return udocker_main(rounds)

    host = f"bench-{uuid.uuid4().hex[:8]}"
    client: Any = (
        docker.DockerClient(base_url=PODMAN_SOCKET, timeout=120)
        if engine == "podman"
        else docker.from_env(timeout=120)
    )
    results: dict[str, list[float]] = {
        "bare": [],
        "session": [],
        "prepared": [],
        "prepare": [],
        "stop": [],
    }
    with tempfile.TemporaryDirectory(prefix="gpuresa-bench-") as directory:
        root = Path(directory)
        config = make_config(root, host, engine)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "key")], check=True
        )
        public_key = (root / "key.pub").read_text()
        (root / "keys" / f"{LOGIN}.pub").write_text(public_key)
        key = paramiko.Ed25519Key.from_private_key_file(str(root / "key"))
        runtime = Runtime(config, client)
        image = runtime.ensure_image("pytorch", None)
        runtime.ensure_ftp_image()
        bare_port = free_block(1)

        def spec() -> SessionSpec:
            end = datetime.now(UTC) + timedelta(hours=1)
            return runtime.new_spec(LOGIN, "pytorch", end, key=f"bench-{uuid.uuid4().hex[:8]}")

        bare_environment = {
            "GPURESA_USER": LOGIN,
            "GPURESA_UID": str(UID),
            "GPURESA_END": "2030-01-01T00:00:00Z",
        }
        # the keys, as gpuresa gives them: a file in a folder mounted read-only
        bare_files = root / "bare-session"
        bare_files.mkdir(mode=0o755)
        (bare_files / "authorized_keys").write_text(public_key)
        (bare_files / "authorized_keys").chmod(0o644)

        try:
            for _ in range(rounds):
                # bare run of the same image until the login works (with what the
                # engine needs for a login to work at all: Podman's user namespace)
                started = time.perf_counter()
                created = client.api.create_container_from_config(
                    {
                        "Image": image,
                        "Env": [f"{name}={value}" for name, value in bare_environment.items()],
                        "Labels": {"gpuresa.host": host},
                        "ExposedPorts": {"22/tcp": {}},
                        "HostConfig": {
                            "PortBindings": {
                                "22/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(bare_port)}]
                            },
                            "Binds": [f"{bare_files}:/etc/gpuresa/session:ro"],
                            **runtime.kind.main_settings(config.limits),
                        },
                    }
                )
                client.api.start(created["Id"])
                wait_for_login(bare_port, key)
                results["bare"].append(time.perf_counter() - started)
                runtime.engine.remove_container(created["Id"])

                # a session from nothing until the login works
                wanted = spec()
                started = time.perf_counter()
                session = runtime.start(wanted)
                wait_for_login(session.ssh_port, key)
                results["session"].append(time.perf_counter() - started)
                results["stop"].append(
                    timed(functools.partial(runtime.stop, wanted.key, timedelta(0)))
                )

                # a session prepared minutes earlier (as the daemon does) until the login works
                wanted = spec()
                results["prepare"].append(timed(functools.partial(runtime.prepare, wanted)))
                started = time.perf_counter()
                session = runtime.start(wanted)
                wait_for_login(session.ssh_port, key)
                results["prepared"].append(time.perf_counter() - started)
                runtime.stop(wanted.key, timedelta(0))
        finally:
            for container in client.containers.list(
                all=True, filters={"label": f"gpuresa.host={host}"}
            ):
                container.remove(force=True)
            for network in client.networks.list(filters={"label": f"gpuresa.host={host}"}):
                network.remove()
            # the running outputs' nosuid mount (and any session image below it) goes too
            with contextlib.suppress(OSError):
                release_area(config)

    bare = statistics.median(results["bare"])
    rows = [
        (f"bare `{engine} run` until SSH login", results["bare"]),
        ("session start until SSH login", results["session"]),
        ("prepared session start until SSH login", results["prepared"]),
        ("session prepare", results["prepare"]),
        ("session stop", results["stop"]),
    ]
    print(
        f"gpuresa session benchmark on {engine} ({rounds} rounds each, image {image}, "
        f"base {BASE_IMAGE})"
    )
    print(f"{'measure':<42} {'median':>8} {'min':>8} {'max':>8} {'/ bare':>7}")
    for label, values in rows:
        median = statistics.median(values)
        versus = f"{median / bare:.2f}x" if "start" in label else ""
        print(f"{label:<42} {median:>7.3f}s {min(values):>7.3f}s {max(values):>7.3f}s {versus:>7}")
    for label, measure in (
        ("from nothing", "session"),
        ("prepared (the daemon's way)", "prepared"),
    ):
        ratio = statistics.median(results[measure]) / bare
        verdict = "meets" if ratio <= 1.5 else "misses"
        print(
            f"session start {label} / bare {engine} run = {ratio:.2f}x ({verdict} the 1.5x target)"
        )
    return 0


def udocker_main(rounds: int) -> int:
    """The udocker rows: a host account of its own as the login, in a folder users traverse.

    A login's first session loads and unpacks the image; each later one takes the spare
    container made after the one before (`backends.udocker.spares`), which the benchmark
    waits for, as a login's next booking would find it. The same starts with
    `spare_containers = false` show what a session costs that unpacks its image."""
    from gpuresa.backends.udocker import UdockerBackend
    from gpuresa.backends.udocker.spares import spares

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from support.accounts import remove_account

    host = f"bench-{uuid.uuid4().hex[:8]}"
    login = f"bu{uuid.uuid4().hex[:8]}"
    results: dict[str, list[float]] = {
        name: [] for name in ("first", "session", "prepared", "prepare", "unpacking", "stop")
    }
    root = Path(tempfile.mkdtemp(prefix="gpuresa-bench-udocker-"))
    root.chmod(0o755)
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", login], check=True)
    try:
        data = make_config(root, host, "udocker")
        for folder in ("keys", "output", "state", "input"):
            (root / folder).chmod(0o755)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "key")], check=True
        )
        (root / "keys" / f"{login}.pub").write_text((root / "key.pub").read_text())
        key = paramiko.Ed25519Key.from_private_key_file(str(root / "key"))
        backend = UdockerBackend(data)
        unpacking = UdockerBackend(
            replace(data, udocker=replace(data.udocker, spare_containers=False))
        )

        def spec() -> SessionSpec:
            end = datetime.now(UTC) + timedelta(hours=1)
            return backend.new_spec(login, "pytorch", end, key=f"bench-{uuid.uuid4().hex[:8]}")

        def start_until_login(side: UdockerBackend, wanted: SessionSpec) -> float:
            started = time.perf_counter()
            session = side.start(wanted)
            wait_for_login(session.ssh_port, key, user=login)
            return time.perf_counter() - started

        def spare_ready() -> None:
            archive = backend.images.archive("pytorch", None)
            assert archive is not None
            deadline = time.monotonic() + 600
            while not spares(data, login, archive[1]) and time.monotonic() < deadline:
                time.sleep(0.2)

        backend.provision("pytorch", None)
        wanted = spec()
        results["first"].append(start_until_login(backend, wanted))
        # each session's maker (in its cgroup) makes the next one's spare before it ends
        spare_ready()
        backend.stop(wanted.key, timedelta(0))
        for _ in range(rounds):
            wanted = spec()
            results["session"].append(start_until_login(backend, wanted))
            spare_ready()
            results["stop"].append(timed(functools.partial(backend.stop, wanted.key, timedelta(0))))

            wanted = spec()
            results["prepare"].append(timed(functools.partial(backend.prepare, wanted)))
            results["prepared"].append(start_until_login(backend, wanted))
            spare_ready()  # no maker at work beside the start that unpacks
            backend.stop(wanted.key, timedelta(0))

            wanted = spec()
            results["unpacking"].append(start_until_login(unpacking, wanted))
            unpacking.stop(wanted.key, timedelta(0))
        for session in backend.list_sessions():
            backend.kill(session.key)
    finally:
        remove_account(login)  # its spare's maker first, which writes in `root`
        shutil.rmtree(root, ignore_errors=True)
    print(f"gpuresa session benchmark on udocker ({rounds} rounds each, base {BASE_IMAGE})")
    print(f"{'measure':<50} {'median':>8} {'min':>8} {'max':>8}")
    for label, measure in (
        ("a login's first session: start until SSH login", "first"),
        ("session start until SSH login (from the spare)", "session"),
        ("prepared session start until SSH login", "prepared"),
        ("session prepare (from the spare)", "prepare"),
        ("session start until SSH login, unpacking", "unpacking"),
        ("session stop", "stop"),
    ):
        values = results[measure]
        median = statistics.median(values)
        print(f"{label:<50} {median:>7.3f}s {min(values):>7.3f}s {max(values):>7.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
