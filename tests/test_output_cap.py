"""Each session's output is capped on a disk without project quotas (ext4 as installed).

The output root of these tests is on the machine's own root filesystem (ext4
without prjquota), so the cap is a filesystem image per session, mounted at
the running path. A user who fills it (as themselves or as sudo root) gets
ENOSPC; the output disk stays above free_refuse and the next user's session
starts; the output, also of a session killed mid-write, reaches its owner.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from support.configs import config_of
from support.waiting import wait_for
from test_runtime import (  # noqa: F401  (the fixtures `images` and `docker_site`)
    Site,
    docker_site,
    images,
    run,
    running_output,
    ssh_login,
)

from gpuresa.outputs.capped import (
    SMALLEST_AUTO_CAP,
    cap_refusal,
    committed_bytes,
    image_path,
    session_cap,
)
from gpuresa.outputs.disk import free_bytes, measure, mount_of, quota_problem
from gpuresa.outputs.handover import retry_pending
from gpuresa.outputs.owners import output_owner

CAP = "64m"


def capped(site: Site, quota: str = CAP) -> Site:
    storage = dataclasses.replace(site.config.storage, session_quota=quota)
    return dataclasses.replace(site, config=dataclasses.replace(site.config, storage=storage))


@pytest.fixture
def plain_site(docker_site: Site) -> Site:  # noqa: F811  (the fixture imported above)
    """A Docker site whose output root is on this machine's ext4 (no project quotas)."""
    return docker_site


def fill(client: Any, target: str, sudo: bool = False) -> str:
    """dd zeros into `target` until it stops; returns what dd said."""
    prefix = "sudo -n " if sudo else ""
    code, output = run(client, f"{prefix}dd if=/dev/zero of={target} bs=1M count=200 2>&1")
    assert code != 0, output
    return output


def test_a_full_output_stops_its_session_alone(plain_site: Site) -> None:
    site = capped(plain_site)
    # the premise: this disk has no project quotas, so an image keeps the cap
    assert quota_problem(mount_of(site.config.storage.output_root)) is not None
    runtime = site.runtime()
    alice = runtime.start(site.spec(runtime, "alice"))
    try:
        image = image_path(site.config, alice.key)
        assert image.is_file() and image.stat().st_size == 64 * 1024**2
        assert os.path.ismount(running_output(site, alice))
        with ssh_login(alice, "alice", site.key("alice")) as client:
            assert "No space left on device" in fill(client, "/output/as-user")
            assert "No space left on device" in fill(client, "/output/as-root", sudo=True)
            code, output = run(client, "df -k --output=size /output | tail -1")
            assert code == 0 and int(output) < 70 * 1024, output
            assert "nosuid" in run(client, "grep ' /output ' /proc/self/mountinfo")[1]
        state = measure(site.config.storage, site.config.daemon.state_dir)
        assert state.free - committed_bytes(site.config) > free_bytes(
            site.config.storage.free_refuse, state.total
        )
        # another user's session starts on time, its own cap untouched
        started = time.monotonic()
        bob = runtime.start(site.spec(runtime, "bob"))
        try:
            assert time.monotonic() - started < 30
            with ssh_login(bob, "bob", site.key("bob")) as client:
                assert run(client, "dd if=/dev/zero of=/output/x bs=1M count=8 2>&1")[0] == 0
        finally:
            runtime.stop(bob.key, timedelta(seconds=1))
    finally:
        runtime.stop(alice.key, timedelta(seconds=1))
    # the hand-over copied the output out of its image, which is gone
    written = alice.output_dir / "as-user"
    assert written.stat().st_size > 8 * 1024**2
    # handed over read-only: root's, the cap is final
    assert written.stat().st_uid == (alice.output_dir / "as-root").stat().st_uid == 0
    assert stat.S_IMODE(written.stat().st_mode) == 0o640
    assert not image.exists() and not os.path.ismount(running_output(site, alice))


def test_a_session_killed_mid_write_leaves_an_output_for_its_owner(plain_site: Site) -> None:
    site = capped(plain_site)
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime, "alice"))
    partial = running_output(site, session) / "partial"
    with ssh_login(session, "alice", site.key("alice")) as client:
        client.exec_command("dd if=/dev/zero of=/output/partial bs=1M count=50")
        wait_for(lambda: partial.exists() and partial.stat().st_size > 0, 30, "the write")
    # the host goes away mid-write: containers killed, no stop, no hand-over
    for name in session.containers:
        site.client.api.remove_container(name, force=True)
    image = image_path(site.config, session.key)
    assert image.is_file()
    reports: list[tuple[str, str]] = []
    assert retry_pending(site.config, set(), lambda key, why: reports.append((key, why))) == 1
    assert reports == []
    partial = session.output_dir / "partial"
    assert partial.is_file() and partial.stat().st_uid == 0
    assert partial.stat().st_gid == output_owner("alice", site.config).gid
    assert not image.exists() and not os.path.ismount(running_output(site, session))


def test_a_cap_beyond_the_free_space_is_refused_with_its_reason(plain_site: Site) -> None:
    site = capped(plain_site, "900t")
    runtime = site.runtime()
    with pytest.raises(Exception, match="cannot hold another session's output cap"):
        runtime.start(site.spec(runtime, "alice"))
    assert not list(image_path(site.config, "x").parent.glob("*.img"))


def test_an_auto_cap_is_not_refused_for_what_was_written_since_it_was_measured(
    tmp_path: Path,
) -> None:
    # a booking of every GPU gets all the room: anything written between the cap's
    # measure and the check (another session, the journal) must not refuse its start
    config = config_of(
        {"storage": {"output_root": str(tmp_path / "output"), "session_quota": "auto"},
         "daemon": {"state_dir": str(tmp_path / "state")}}
    )  # fmt: skip
    (tmp_path / "output").mkdir()
    limit = session_cap(config, booked_gpus=4, host_gpus=4)
    assert limit is not None and limit > SMALLEST_AUTO_CAP
    (tmp_path / "output" / "meanwhile").write_bytes(os.urandom(8 << 20))
    os.sync()
    assert cap_refusal(config, limit) is None
    # a room below the smallest cap still refuses, with the disk's state
    refusal = cap_refusal(config, SMALLEST_AUTO_CAP - 1)
    assert refusal is not None and "no room for another session's output" in refusal
    # a size set by the admin is checked against the disk as it is now
    fixed = dataclasses.replace(config.storage, session_quota="1g")
    too_big = measure(fixed, config.daemon.state_dir).free + 1
    refusal = cap_refusal(dataclasses.replace(config, storage=fixed), too_big)
    assert refusal is not None and "cannot hold another session's output cap" in refusal
