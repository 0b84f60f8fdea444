"""Each session's CPUs, memory and writable layer, on the real engines.

A session gets its share of the host (read back from the engine and from its
own cgroup), a session that takes memory without end is killed inside its
limit while another answers, and one that writes without end into its root
filesystem meets ENOSPC while another user's session still starts at once.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from test_runtime import (  # noqa: F401  (the fixtures `built` and `site`)
    Site,
    built_fixture,
    run,
    site_fixture,
    ssh_login,
)

from gpuresa.config.schema import Size
from gpuresa.config.sections import LimitsConfig
from gpuresa.sessions.limits import MEMORY_STEP

MIB = 1 << 20

# cgroup v2 files, else v1's, as the session sees them
CGROUP_LIMITS = (
    "cat /sys/fs/cgroup/memory.max 2>/dev/null || "
    "cat /sys/fs/cgroup/memory/memory.limit_in_bytes; "
    "cat /sys/fs/cgroup/cpu.max 2>/dev/null || "
    "echo $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us) $(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)"
)


def with_limits(site: Site, **limits: Any) -> Site:
    """`site` with `[limits]` changed."""
    changed = dataclasses.replace(site.config.limits, **limits)
    return dataclasses.replace(site, config=dataclasses.replace(site.config, limits=changed))


def cgroup_limits(session: Any, site: Site) -> tuple[int, float]:
    """(memory bytes, CPUs) of the session's cgroup, read inside it."""
    with ssh_login(session, session.user, site.key(session.user)) as client:
        code, output = run(client, CGROUP_LIMITS)
    assert code == 0, output
    memory, quota, period = output.split()
    return int(memory), int(quota) / int(period)


def test_a_session_gets_its_share_of_the_host_and_explicit_limits_win(site: Site) -> None:
    site = with_limits(site, reserve_cpus=1.5, reserve_memory=Size(1 << 30))
    runtime = site.runtime()
    info = site.client.info()
    session = runtime.start(site.spec(runtime, "alice"))
    host = site.client.containers.get(session.containers[0]).attrs["HostConfig"]
    # a host without GPUs: everything but the reserve
    cpus = max(round(info["NCPU"] - 1.5, 2), 0.1)
    memory = (info["MemTotal"] - (1 << 30)) // MEMORY_STEP * MEMORY_STEP
    assert host["NanoCpus"] == round(cpus * 1e9)
    assert host["Memory"] == memory
    assert host["MemorySwap"] == memory, "no swap on top of the limit"
    inside_memory, inside_cpus = cgroup_limits(session, site)
    assert inside_memory == memory
    assert abs(inside_cpus - cpus) < 0.011
    ftp = site.client.containers.get(session.containers[1]).attrs["HostConfig"]
    assert (ftp["NanoCpus"], ftp["Memory"]) == (500_000_000, 256 * MIB)

    explicit = with_limits(site, cpus=0.3, memory=Size(300 * MIB))
    runtime = explicit.runtime()
    session = runtime.start(explicit.spec(runtime, "bob"))
    host = explicit.client.containers.get(session.containers[0]).attrs["HostConfig"]
    assert (host["NanoCpus"], host["Memory"]) == (300_000_000, 300 * MIB)
    inside_memory, inside_cpus = cgroup_limits(session, explicit)
    assert inside_memory == 300 * MIB
    assert abs(inside_cpus - 0.3) < 0.011


def test_a_session_that_takes_memory_without_end_is_killed_alone(site: Site) -> None:
    site = with_limits(site, memory=Size(200 * MIB))
    runtime = site.runtime()
    hog = runtime.start(site.spec(runtime, "alice"))
    neighbour = runtime.start(site.spec(runtime, "bob"))
    with ssh_login(hog, "alice", site.key("alice")) as client:
        started = time.monotonic()
        # 10 MB more at a time, kept: it grows until the limit kills it
        hog_command = "python3 -c 'kept = []\nwhile True: kept.append(bytearray(10**7))'"
        _, output = run(client, f"{hog_command}; echo $?")
        took = time.monotonic() - started
        assert output.split()[0] == "137", output  # SIGKILL: the OOM killer
        assert took < 20
        # the session itself goes on: sshd was not what took the memory
        assert run(client, "echo alive")[1].strip() == "alive"
    with ssh_login(neighbour, "bob", site.key("bob")) as client:
        assert run(client, "echo ok") == (0, "ok\n")
    container = site.client.containers.get(hog.containers[0])
    assert container.status == "running"


def test_a_session_that_writes_without_end_meets_its_cap_and_others_start(site: Site) -> None:
    site = with_limits(site, layer_size=Size(128 * MIB))
    runtime = site.runtime()
    writer = runtime.start(site.spec(runtime, "alice"))
    folder = _layer_folder(site, writer.containers[0])
    assert _mounted(folder), "the layer has a filesystem of its own"
    # a set-id file or a device node the session's root leaves there gives nothing on the host
    options = _mount_options(folder)
    assert {"nosuid", "nodev"} <= options, options
    assert not list((site.config.daemon.state_dir / "layers").glob("*.img")), "backing unlinked"
    with ssh_login(writer, "alice", site.key("alice")) as client:
        code, output = run(client, "sudo -n dd if=/dev/zero of=/root/big bs=1M count=1024 2>&1")
        assert code != 0 and "No space left on device" in output, output
        code, output = run(client, "dd if=/dev/zero of=/tmp/more bs=1M count=64 2>&1")
        assert code != 0 and "No space left on device" in output, output
        code, output = run(client, "df -B1 --output=size / | tail -1")
        assert int(output) <= 128 * MIB, output
    # everyone else: another user's session starts as fast as ever
    started = time.monotonic()
    other = runtime.start(site.spec(runtime, "bob"))
    assert time.monotonic() - started < 30
    with ssh_login(other, "bob", site.key("bob")) as client:
        assert run(client, "dd if=/dev/zero of=/tmp/fine bs=1M count=16 2>&1")[0] == 0
    runtime.stop(writer.key, timedelta(seconds=2))
    # the engine's removal unmounted it and freed its loop device
    assert not _mounted(folder) and not folder.exists()


def test_the_layer_cap_can_be_turned_off(site: Site) -> None:
    site = with_limits(site, layer_size="off")
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    assert not _mounted(_layer_folder(site, session.containers[0]))


def _layer_folder(site: Site, container: str) -> Path:
    attributes = site.client.containers.get(container).attrs
    return Path(attributes["GraphDriver"]["Data"]["UpperDir"]).parent


def _mounted(folder: Path) -> bool:
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    return any(line.split()[4] == str(folder) for line in mounts)


def _mount_options(folder: Path) -> set[str]:
    """The per-mount options of the mount at `folder`, from /proc/self/mountinfo."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(folder):
            return set(fields[5].split(","))
    raise AssertionError(f"{folder} is not a mount point")


def test_limits_config_keeps_its_types() -> None:
    limits = LimitsConfig()
    assert limits.layer_size == Size(30 << 30) and str(limits.shm_size) == "8g"
