"""The machine as a test run may change it: what it holds before the run, and after.

A run records the machine at its start and compares at its end: mounts under
the temporary folders (output roots and state folders of tests live there),
loop devices backed by a file there, network namespaces no process is in,
the cgroup folders of this run's test hosts (udocker sessions'), the host
accounts and groups of this run's tests (`conftest.run_login`), and
gpuresa-labelled containers and networks on Docker and Podman. Only what
is new counts, and only what this run can have made: other test runs on the
same machine (their own `pytest-N` folder, their own run prefix in the
labels) are left out, so neither the machine's old state nor a neighbour's
work fails this run.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# where tests make output roots and state folders, and the defaults of both (where a
# config that forgets one puts it)
TEMPORARY = (Path("/tmp"), Path("/var/tmp"), Path("/var/lib/gpuresa"), Path("/srv/gpuresa"))
NETNS = Path("/run/netns")
CGROUPS = Path("/sys/fs/cgroup")
# another pytest run's base folder (pytest-of-<user>/pytest-<n>), or one pytest's clean-up
# of old runs renamed on its way out (garbage-<uuid>): neither is this run's
PYTEST_BASE = re.compile(r"^/tmp/pytest-of-[^/]+/(pytest-\d+|garbage-[0-9a-f-]+)(/|$)")
# the labels that tie a container or a network to a test run, and what marks a run's values
TEST_HOST_VALUE = re.compile(r"^test-[0-9a-f]{10}$")


@dataclass(frozen=True)
class Machine:
    """What the machine holds that a run could leave behind (each item a line for a report)."""

    mounts: frozenset[str]
    loops: frozenset[str]
    namespaces: frozenset[str]
    cgroups: frozenset[str]
    accounts: frozenset[str]
    containers: frozenset[str]
    networks: frozenset[str]

    def new_since(self, before: Machine) -> list[str]:
        """What this holds that `before` did not, one line each."""
        return [
            f"{kind}: {item}"
            for kind, now, then in (
                ("mount", self.mounts, before.mounts),
                ("loop device", self.loops, before.loops),
                ("network namespace (no process in it)", self.namespaces, before.namespaces),
                ("cgroup folder", self.cgroups, before.cgroups),
                ("host account or group", self.accounts, before.accounts),
                ("container", self.containers, before.containers),
                ("network", self.networks, before.networks),
            )
            for item in sorted(now - then)
        ]


def _ours(path: str, base: Path) -> bool:
    """Whether `path` is under a temporary folder and not another pytest run's."""
    if path.startswith(f"{base}/") or path == str(base):
        return True
    if not any(path.startswith(f"{folder}/") for folder in TEMPORARY):
        return False
    return PYTEST_BASE.match(path) is None


def mounts(base: Path, mountinfo: str | None = None) -> frozenset[str]:
    """Mount points under the temporary folders (a point stacked twice counts twice)."""
    text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    found: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
        if _ours(point, base):
            found[point] = found.get(point, 0) + 1
    return frozenset(
        point if count == 1 else f"{point} (mounted {count} times)"
        for point, count in found.items()
    )


def loops(base: Path) -> frozenset[str]:
    """Loop devices backed by a file under the temporary folders (deleted or not)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        result = subprocess.run(["losetup", "-J"], capture_output=True, text=True, timeout=30)
        devices = json.loads(result.stdout or "{}").get("loopdevices", [])
        return frozenset(
            f"{device['name']} ({device['back-file']})"
            for device in devices
            if _ours(str(device.get("back-file") or "").removesuffix(" (deleted)"), base)
        )
    return frozenset()


def namespaces() -> frozenset[str]:
    """Named network namespaces that no process is in."""
    used = set()
    for process in Path("/proc").iterdir():
        if process.name.isdigit():
            with contextlib.suppress(OSError):
                used.add(os.stat(process / "ns" / "net").st_ino)
    found = set()
    with contextlib.suppress(OSError):
        for entry in NETNS.iterdir():
            with contextlib.suppress(OSError):
                if entry.stat().st_ino not in used:
                    found.add(entry.name)
    return frozenset(found)


def cgroups(prefix: str) -> frozenset[str]:
    """The cgroup folders of this run's test hosts (`/sys/fs/cgroup/<controller>/gpuresa/
    test-<prefix>…`, with or without `@<installation>`, and what is in them), relative to
    `/sys/fs/cgroup`."""
    host_folder = re.compile(rf"^test-{re.escape(prefix)}[0-9a-f]*(@[0-9a-f]+)?$")
    found = set()
    for host in CGROUPS.glob(f"*/gpuresa/test-{glob.escape(prefix)}*"):
        if host_folder.match(host.name) and host.is_dir():
            found.add(str(host.relative_to(CGROUPS)))
            found.update(
                str(entry.relative_to(CGROUPS)) for entry in host.iterdir() if entry.is_dir()
            )
    return frozenset(found)


def accounts(prefix: str, etc: Path = Path("/etc")) -> frozenset[str]:
    """The host accounts and groups named by `conftest.run_login` for this run."""
    name = re.compile(rf"^[a-z]+{re.escape(prefix)}[0-9a-f]{{6}}[0-9]*$")
    found = set()
    for kind, table in (("account", "passwd"), ("group", "group")):
        with contextlib.suppress(OSError):
            for line in (etc / table).read_text().splitlines():
                entry = line.split(":", 1)[0]
                if name.match(entry):
                    found.add(f"{kind} {entry}")
    return frozenset(found)


def _of_this_run(labels: dict[str, str], prefix: str) -> bool:
    """Whether `labels` carry this run's prefix: its run label, or its test host name
    (what a test made beside a benchmark, a demo or another run is told apart by them)."""
    if not any(name.startswith("gpuresa.") for name in labels):
        return False
    run = labels.get("gpuresa.test-run", "")
    host = labels.get("gpuresa.host", "")
    return run.startswith(prefix) or (
        TEST_HOST_VALUE.match(host) is not None and host.removeprefix("test-").startswith(prefix)
    )


def engine_things(clients: Iterable[tuple[str, Any]], prefix: str) -> tuple[set[str], set[str]]:
    """(containers, networks) with gpuresa's labels on each engine answering."""
    containers: set[str] = set()
    networks: set[str] = set()
    for engine, client in clients:
        with contextlib.suppress(Exception):  # an engine that does not answer shows nothing
            for listed in client.api.containers(all=True):
                if _of_this_run(listed.get("Labels") or {}, prefix):
                    name = (listed.get("Names") or ["?"])[0].lstrip("/")
                    containers.add(f"{engine} {name} ({str(listed['Id'])[:12]})")
        with contextlib.suppress(Exception):
            for network in client.api.networks():
                if _of_this_run(network.get("Labels") or {}, prefix):
                    networks.add(f"{engine} {network.get('Name')}")
    return containers, networks


def machine(base: Path, prefix: str, clients: Iterable[tuple[str, Any]]) -> Machine:
    """The machine now, as far as a run with `base` folder and run `prefix` may change it."""
    containers, networks = engine_things(clients, prefix)
    return Machine(
        mounts(base),
        loops(base),
        namespaces(),
        cgroups(prefix),
        accounts(prefix),
        frozenset(containers),
        frozenset(networks),
    )


def machine_of_run(base: Path, prefix: str, podman_socket: str) -> Machine:
    """`machine` with a client of each engine that answers (Docker's from the environment)."""
    import docker

    clients = []
    for engine in ("docker", "podman"):
        with contextlib.suppress(Exception):  # an engine that does not answer holds nothing
            if engine == "podman":
                client = docker.DockerClient(base_url=podman_socket, timeout=30)
            else:
                client = docker.from_env(timeout=30)
            client.ping()
            clients.append((engine, client))
    try:
        return machine(base, prefix, clients)
    finally:
        for _, client in clients:
            client.close()
